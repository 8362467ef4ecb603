"""Helpers for plugin authors: tiny models, example batches, and the packed-vs-alone equivalence check."""
