"""Packing: the packed batch, the collator that builds it, the padded reference, re-padding and dataset checks."""
