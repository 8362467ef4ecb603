"""Causal-LM packing: labels default to ``input_ids``, and every example must fit the model's positions.

The packing itself is :class:`~padfree_plugins.collator.PackingCollator`'s (labels travel per token and each
example's first label is set to -100, so that the shifted loss never trains an example to continue the one
before it). This module adds what a causal-LM dataset needs on top:

* **labels from input_ids** when the examples carry no ``labels`` (what ``DataCollatorForLanguageModeling``
  and ``DataCollatorWithFlattening`` do); user labels, including -100 masks for prompts or user turns
  (completion-only / assistant-only loss), are kept as they are;
* **the model's limit** (for every task, by :func:`padfree_plugins.builtin.core.packing_collator`): an example
  longer than ``max_position_embeddings`` (minus the architecture's first position) is an error that says what to
  do, instead of an index error or silent extrapolation mid-training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .batch import PackedBatch
from .collator import PackingCollator, WrapsPackingCollator
from .config import PadfreeConfig
from .specs import Architecture, Task

#: ``task_options`` of the ``causal_lm`` task, with their defaults.
OPTIONS = {"labels_from_input_ids": True}


@dataclass
class CausalLMCollator(WrapsPackingCollator):
    """The ``causal_lm`` collator: labels default to ``input_ids``, then the :class:`PackingCollator` packs
    (and refuses examples longer than the model takes)."""

    packing: PackingCollator
    labels_from_input_ids: bool = True

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        if (self.labels_from_input_ids and isinstance(examples, Sequence) and examples
                and all(isinstance(ex, Mapping) and ex.get("labels") is None for ex in examples)):
            examples = [{**ex, "labels": ex["input_ids"]} for ex in examples]
        return self.packing(examples)


def causal_lm_collator(task: Task, architecture: Architecture, model_config: Any,
                       config: PadfreeConfig) -> CausalLMCollator:
    """The collator for the ``causal_lm`` task, from the resolved specs and the acceleration config."""
    from .builtin.core import packing_collator
    from .builtin.task_options import read_options

    options = read_options(task.name, config.task_options, OPTIONS, {"labels_from_input_ids": (True, False)})
    required = tuple(dict.fromkeys((*task.required_keys, *(() if options["labels_from_input_ids"] else ("labels",)))))
    packing = dataclasses.replace(packing_collator(task, architecture, model_config, config), required_keys=required)
    return CausalLMCollator(packing, options["labels_from_input_ids"])
