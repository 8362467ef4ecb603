"""Builtin architecture plugins, one module per model family."""
