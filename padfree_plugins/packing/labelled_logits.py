"""Labelled logits only: a packed causal-LM batch names the positions whose next token carries a label, so the
model projects only those onto the vocabulary (transformers' ``logits_to_keep``) and its loss reads their labels
(``shift_labels``). Same loss and gradients; prompt tokens of completion-only SFT and each example's last token
cost no LM-head row and no softmax over the vocabulary."""

from __future__ import annotations

from typing import Any

import torch

#: Batch keys added by :func:`keep_labelled_logits` (model inputs of the ``causal_lm`` task when present).
LABELLED_LOGITS_KEYS = ("logits_to_keep", "shift_labels")


def keep_labelled_logits(batch: Any) -> Any:
    """Add ``logits_to_keep`` (the positions whose next label is not -100, int64 ``[K]``) and ``shift_labels``
    (those labels, ``[1, K]``) to a packed causal-LM batch, in place; a batch without labels is left as it is.

    The model then computes logits ``[1, K, V]`` for those positions only and its loss uses ``shift_labels`` as
    they are; transformers' ``Trainer`` counts ``shift_labels`` for ``num_items_in_batch``. Run on the host, in
    the collator: no device synchronisation in the training step.
    """
    labels = batch.get("labels")
    if labels is None:
        return batch
    row = labels.reshape(-1)
    shifted = torch.cat([row[1:], row.new_full((1,), -100)])
    positions = torch.nonzero(shifted != -100).reshape(-1)
    batch["logits_to_keep"] = positions
    batch["shift_labels"] = shifted[positions].unsqueeze(0)
    return batch


def drop_labelled_logits(batch: Any) -> Any:
    """``batch`` without the keys of :func:`keep_labelled_logits` (for calls that need every position's logits)."""
    if not any(key in batch for key in LABELLED_LOGITS_KEYS):
        return batch
    kept = {key: value for key, value in batch.items() if key not in LABELLED_LOGITS_KEYS}
    return type(batch)(kept) if isinstance(batch, dict) else kept  # a PackedBatch stays one
