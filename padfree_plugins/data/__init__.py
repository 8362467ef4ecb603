"""Training data: ``instructions.jsonl`` (the embedded default of ``padfree-plugins train``), reading and tokenizing
rows (:mod:`~padfree_plugins.data.loading`), a tokenizer trained on the spot (:mod:`~padfree_plugins.data.tokenizer`).

A low layer: nothing here imports padfree_plugins beyond :mod:`padfree_plugins.errors`.
"""
