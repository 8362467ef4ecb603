"""The plugin contract: the hooks, the declarations plugins return, the protocols of what hooks return, and
the host that discovers and calls plugins."""
