"""The ``causal_lm`` task plugin (causal language modelling / SFT): labels default to ``input_ids``, and every
example must fit the model's positions.

The packing itself is :class:`~padfree_plugins.packing.collator.PackingCollator`'s (labels travel per token and each
example's first label is set to -100, so that the shifted loss never trains an example to continue the one
before it). This module adds what a causal-LM dataset needs on top:

* **labels from input_ids** when the examples carry no ``labels`` (what ``DataCollatorForLanguageModeling``
  and ``DataCollatorWithFlattening`` do); user labels, including -100 masks for prompts or user turns
  (completion-only / assistant-only loss), are kept as they are;
* **the model's limit** (for every task, by :func:`padfree_plugins.packing.collator.packing_collator`): an example
  longer than ``max_position_embeddings`` (minus the architecture's first position) is an error that says what to
  do, instead of an index error or silent extrapolation mid-training;
* **labelled logits only** (:mod:`~padfree_plugins.packing.labelled_logits`, task option ``labelled_logits_only``,
  on by default): for training through HF ``Trainer`` the batch also holds the positions whose next token carries a
  label, and the plugin's own loss call has the model project only those onto the vocabulary (transformers'
  ``logits_to_keep``) and read their labels (``shift_labels``). Same loss and gradients; prompt / user-turn tokens
  of completion-only SFT, and the last token of every example, no longer cost an LM-head row and a softmax over the
  vocabulary. Every other forward on the batch (a ``training_step`` of the user's) gets every position's logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from padfree_plugins.config.schema import PadfreeConfig
from padfree_plugins.config.task_options import read_options
from padfree_plugins.contract.declarations import Architecture, Task
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.modeling.forward import ModelForward
from padfree_plugins.modeling.heads import check_lm_head
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.packing.collator import PackingCollator, WrapsPackingCollator, as_examples, packing_collator

#: ``task_options`` of the ``causal_lm`` task, with their defaults.
TASK = "causal_lm"
OPTIONS = {"labels_from_input_ids": True, "labelled_logits_only": True}
@dataclass
class CausalLMCollator(WrapsPackingCollator):
    """The ``causal_lm`` collator: labels default to ``input_ids``, then the :class:`PackingCollator` packs
    (and refuses examples longer than the model takes)."""

    packing: PackingCollator
    labels_from_input_ids: bool = True
    #: Whether trainers should hold labelled positions for their loss
    #: (:func:`~padfree_plugins.packing.labelled_logits.hold_labelled_logits`; the collator itself never does).
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
        check_lm_head(model, "causal_lm")


@hookimpl
def register_tasks():
    return [
        Task(
            TASK,
            token_keys=("labels",),
            masked_first_keys=("labels",),
            model_keys=("labels", "token_type_ids", "logits_to_keep", "shift_labels"),
            options=OPTIONS,
            description="causal language modelling / SFT: labels travel per token, each example's first label "
            "is ignored so no example learns from the one before it",
        ),
    ]


@hookimpl
def collate(task, architecture, model_config, config):
    return causal_lm_collator(task, architecture, model_config, config) if task.name == TASK else None


@hookimpl
def task_forward(task, architecture, config):
    return CausalLMForward.of(task, architecture) if task.name == TASK else None
