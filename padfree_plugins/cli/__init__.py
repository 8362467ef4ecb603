"""The ``padfree-plugins`` command line."""

from padfree_plugins.cli.app import app, main

__all__ = ["app", "main"]
