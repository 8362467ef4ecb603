"""Data shipped with padfree-plugins: ``instructions.jsonl``, the embedded default of ``padfree-plugins train``."""
