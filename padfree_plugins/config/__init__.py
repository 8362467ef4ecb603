"""The acceleration config (``padfree.yaml``), task options, and model configs read from local files."""
