"""Labelled logits only: a packed causal-LM batch names the positions whose next token carries a label, so the
model projects only those onto the vocabulary (transformers' ``logits_to_keep``) and its loss reads their labels
(``shift_labels``). Same loss and gradients; prompt tokens of completion-only SFT and each example's last token
cost no LM-head row and no softmax over the vocabulary.

A trainer's collator does not hand those keys to the model's every call: a forward of the user's on the same
batch (a second loss in ``training_step``, say) must see every position, as padded. It *holds* them under
:data:`HELD_KEY` (:func:`hold_labelled_logits`); the trainer plugin takes them out before user code sees the batch
(:func:`take_labelled_logits`) and passes them to the model in its own loss call only (:func:`with_labelled_logits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: Batch keys added by :func:`keep_labelled_logits` (model inputs of the ``causal_lm`` task when present).
LABELLED_LOGITS_KEYS = ("logits_to_keep", "shift_labels")
#: The batch key under which :func:`hold_labelled_logits` keeps :data:`LABELLED_LOGITS_KEYS` for a trainer plugin's
#: own loss (a nested dict of tensors: moved to the device, pinned and pickled with the batch; never a model input).
HELD_KEY = "padfree_labelled_logits"


def labelled_logits(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """``logits_to_keep`` (the positions whose next label is not -100, int64 ``[K]``) and ``shift_labels`` (those
    labels, ``[1, K]``) of a packed row's ``labels``."""
    row = labels.reshape(-1)
    shifted = torch.cat([row[1:], row.new_full((1,), -100)])
    positions = torch.nonzero(shifted != -100).reshape(-1)
    return {"logits_to_keep": positions, "shift_labels": shifted[positions].unsqueeze(0)}


def keep_labelled_logits(batch: Any) -> Any:
    """Add ``logits_to_keep`` and ``shift_labels`` (:func:`labelled_logits`) to a packed causal-LM batch, in place;
    a batch without labels is left as it is.

    The model then computes logits ``[1, K, V]`` for those positions only and its loss uses ``shift_labels`` as
    they are. Run on the host, in the collator: no device synchronisation in the training step. For a loop that
    calls the model itself; a trainer's collator holds them instead (:func:`hold_labelled_logits`).
    """
    labels = batch.get("labels")
    if labels is not None:
        batch.update(labelled_logits(labels))
    return batch


def hold_labelled_logits(batch: Any) -> Any:
    """:func:`labelled_logits` of a packed causal-LM batch under :data:`HELD_KEY`, in place (a batch without labels
    is left as it is): for the trainer plugin's own loss alone, not for ``model(**batch)``."""
    labels = batch.get("labels")
    if labels is not None:
        batch[HELD_KEY] = labelled_logits(labels)
    return batch


def take_labelled_logits(batch: Any) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """``batch`` without :data:`HELD_KEY` (a copy of the same type; ``batch`` itself when it has none), and what
    that key held (``None`` when absent)."""
    if not isinstance(batch, Mapping) or HELD_KEY not in batch:
        return batch, None
    return rebuilt(batch, {key: value for key, value in batch.items() if key != HELD_KEY}), batch[HELD_KEY]


def with_labelled_logits(batch: Any, held: dict[str, torch.Tensor]) -> Any:
    """``batch`` (a copy of the same type) with the held ``logits_to_keep`` / ``shift_labels``, on its labels'
    device."""
    device = batch["labels"].device
    return rebuilt(batch, {**batch, **{key: value.to(device) for key, value in held.items()}})


def rebuilt(batch: Any, items: dict[str, Any]) -> Any:
    """``items`` as a batch of ``batch``'s type (a ``PackedBatch`` keeps its ``model_keys``)."""
    if not isinstance(batch, dict):
        return items
    kept = type(batch)(items)
    if getattr(batch, "model_keys", None) is not None:
        kept.model_keys = batch.model_keys
    return kept


def drop_labelled_logits(batch: Any) -> Any:
    """``batch`` without the keys of :func:`keep_labelled_logits` (for calls that need every position's logits)."""
    if not any(key in batch for key in LABELLED_LOGITS_KEYS):
        return batch
    return rebuilt(batch, {key: value for key, value in batch.items() if key not in LABELLED_LOGITS_KEYS})
