"""Recipes: the embedded training run and the demo."""
