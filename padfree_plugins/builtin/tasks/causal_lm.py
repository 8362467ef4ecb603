"""Causal-LM packing: labels default to ``input_ids``, and every example must fit the model's positions.

The packing itself is :class:`~padfree_plugins.packing.collator.PackingCollator`'s (labels travel per token and each
example's first label is set to -100, so that the shifted loss never trains an example to continue the one
before it). This module adds what a causal-LM dataset needs on top:

* **labels from input_ids** when the examples carry no ``labels`` (what ``DataCollatorForLanguageModeling``
  and ``DataCollatorWithFlattening`` do); user labels, including -100 masks for prompts or user turns
  (completion-only / assistant-only loss), are kept as they are;
* **the model's limit** (for every task, by :func:`padfree_plugins.builtin.core.packing_collator`): an example
  longer than ``max_position_embeddings`` (minus the architecture's first position) is an error that says what to
  do, instead of an index error or silent extrapolation mid-training;
* **labelled logits only** (:func:`keep_labelled_logits`, task option ``labelled_logits_only``, on by default):
  for training through HF ``Trainer`` the batch also names the positions whose next token carries a label, so the
  model projects only those onto the vocabulary (transformers' ``logits_to_keep``) and the loss reads their
  labels (``shift_labels``). Same loss and gradients; prompt / user-turn tokens of completion-only SFT, and the
  last token of every example, no longer cost an LM-head row and a softmax over the vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.config.schema import PadfreeConfig
from padfree_plugins.contract.declarations import Architecture, Task
from padfree_plugins.modeling.forward import ModelForward
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.packing.collator import PackingCollator, WrapsPackingCollator, as_examples

#: ``task_options`` of the ``causal_lm`` task, with their defaults.
OPTIONS = {"labels_from_input_ids": True, "labelled_logits_only": True}
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


@dataclass
class CausalLMCollator(WrapsPackingCollator):
    """The ``causal_lm`` collator: labels default to ``input_ids``, then the :class:`PackingCollator` packs
    (and refuses examples longer than the model takes)."""

    packing: PackingCollator
    labels_from_input_ids: bool = True
    #: Whether trainers should add :func:`keep_labelled_logits`'s keys (the collator itself never does).
    labelled_logits_only: bool = True

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        examples = as_examples(examples)
        if (self.labels_from_input_ids and examples
                and all(isinstance(ex, Mapping) and ex.get("labels") is None for ex in examples)):
            examples = [{**ex, "labels": ex.get("input_ids")} for ex in examples]  # a missing one: packing says
        return self.packing(examples)


def causal_lm_collator(task: Task, architecture: Architecture, model_config: Any,
                       config: PadfreeConfig) -> CausalLMCollator:
    """The collator for the ``causal_lm`` task, from the resolved specs and the acceleration config."""
    from padfree_plugins.builtin.core import packing_collator
    from padfree_plugins.config.task_options import read_options

    options = read_options(task.name, config.task_options, OPTIONS,
                           {"labels_from_input_ids": (True, False), "labelled_logits_only": (True, False)})
    required = tuple(dict.fromkeys((*task.required_keys, *(() if options["labels_from_input_ids"] else ("labels",)))))
    packing = dataclasses.replace(packing_collator(task, architecture, model_config, config), required_keys=required)
    return CausalLMCollator(packing, options["labels_from_input_ids"], options["labelled_logits_only"])


@dataclass(frozen=True)
class CausalLMForward(ModelForward):
    """The default forward, for a model that must have a language-model head."""

    def check_model(self, model: Any) -> None:
        """At assembly: refuse a model without an LM head (it would fail at the first step, or train nothing)."""
        from padfree_plugins.modeling.heads import check_lm_head

        check_lm_head(model, "causal_lm")
