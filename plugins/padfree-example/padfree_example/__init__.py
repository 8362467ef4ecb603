"""padfree-example: an example third-party plugin for padfree-plugins (adds Cohere / Command-R)."""

__version__ = "0.1.0"
