"""Task ``seq_cls``: sequence classification and regression, padding-free, for encoders and decoders.

The base model runs on the packed row; every example's pooled token goes through the model's own head
(:mod:`padfree_plugins.builtin.heads`); the loss is the model's own ``loss_function`` (transformers'
``ForSequenceClassificationLoss``: regression, single-label or multi-label from ``config.problem_type`` and the
labels' dtype, exactly as the padded model decides).

Examples: ``input_ids`` (+ ``token_type_ids`` for pairs) and, for training, ``labels`` / ``label``: an int class,
a float (regression) or a list of floats (multi-label). ``task_options``: ``pairs`` (default false) — the inputs
are sentence pairs, so a model with token types needs ``token_type_ids`` in every example.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers.modeling_outputs import SequenceClassifierOutput

from ..hookspecs import hookimpl
from ..specs import Task
from ..task_options import read_options
from .heads import call_model, check_sequence_head, sequence_logits
from .task_collators import ExampleCollator, packing_for

TASK = "seq_cls"
OPTIONS = {"pairs": False}


@dataclass(frozen=True)
class SequenceClassificationForward:
    """``(model, packed batch) -> SequenceClassifierOutput(loss, logits [n, num_labels])``."""

    runs_inside_model_forward = True  # see heads.call_model

    def check_model(self, model: Any) -> None:
        """At assembly: the model has a head this task can run per example."""
        check_sequence_head(model, TASK)

    def __call__(self, model: Any, batch: Mapping, **loss_kwargs: Any) -> SequenceClassifierOutput:
        return call_model(model, lambda inner: self.compute(inner, batch))

    def compute(self, model: Any, batch: Mapping) -> SequenceClassifierOutput:
        logits = sequence_logits(model, batch)
        loss = None
        if batch.get("labels") is not None:
            loss = model.loss_function(logits=logits, labels=batch["labels"], pooled_logits=logits,
                                       config=model.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)


@hookimpl
def register_tasks():
    return [Task(TASK, example_keys=("labels", "label"), options=OPTIONS,
                 description="sequence classification / regression: the model's own head on every example's "
                 "pooled token (CLS, last token, mean), its own loss")]


# The assembly hooks below are plain, not trylast: the core plugin's defaults are trylast and answer every task,
# so this task's answers must come first. They return None for other tasks.
@hookimpl
def collate(task, architecture, model_config, config):
    if task.name != TASK:
        return None
    options = read_options(TASK, config.task_options, OPTIONS)
    return ExampleCollator(packing_for(task, architecture, model_config, config), pairs=bool(options["pairs"]),
                           type_vocab_size=int(getattr(model_config, "type_vocab_size", 0) or 0),
                           num_labels=int(getattr(model_config, "num_labels", 0) or 0))


@hookimpl
def task_forward(task, architecture, config):
    if task.name != TASK:
        return None
    read_options(TASK, config.task_options, OPTIONS)
    return SequenceClassificationForward()
