"""Task ``seq_cls``: sequence classification and regression, padding-free, for encoders and decoders.

The base model runs on the packed row; every example's pooled token goes through the model's own head
(:mod:`padfree_plugins.modeling.heads`); the loss is the model's own ``loss_function`` (transformers'
``ForSequenceClassificationLoss``: regression, single-label or multi-label from ``config.problem_type`` and the
labels' dtype, exactly as the padded model decides).

Examples: ``input_ids`` (+ ``token_type_ids`` for pairs) and, for training, ``labels`` / ``label``: an int class,
a float (regression) or a list of floats (multi-label). ``task_options``: ``pairs`` (default false) — the inputs
are sentence pairs, so a model with token types needs ``token_type_ids`` in every example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import SequenceClassifierOutput

from padfree_plugins.builtin.tasks.collators import ExampleCollator, packing_for
from padfree_plugins.config.task_options import read_options
from padfree_plugins.contract.declarations import Task
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BatchError
from padfree_plugins.modeling.heads import call_model, check_sequence_head, sequence_logits

TASK = "seq_cls"
OPTIONS = {"pairs": False}


@dataclass(frozen=True)
class SequenceClassificationForward:
    """``(model, packed batch) -> SequenceClassifierOutput(loss, logits [n, num_labels])``."""

    runs_inside_model_forward = True  # see heads.call_model
    #: Under sequence parallelism: ``hidden(inner)`` gives this rank's own batch's last hidden states
    #: (:meth:`~padfree_plugins.modeling.sequence_parallel.SequenceParallelForward.pooled`).
    pools_examples = True

    def check_model(self, model: Any) -> None:
        """At assembly: the model has a head this task can run per example."""
        check_sequence_head(model, TASK)

    def __call__(self, model: Any, batch: Mapping, hidden: Callable | None = None,
                 **loss_kwargs: Any) -> SequenceClassifierOutput:
        return call_model(model, lambda inner: self.compute(inner, batch, None if hidden is None else hidden(inner)))

    def compute(self, model: Any, batch: Mapping, hidden: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = sequence_logits(model, batch, hidden)
        labels, loss = batch.get("labels"), None
        own_loss = OWN_LOSSES.get(model.config.model_type) if model.config.problem_type is None else None
        if labels is not None and own_loss is not None:
            loss, logits = own_loss(model, logits, labels)
        elif labels is not None:
            check_label_shape(model.config, labels)
            loss = model.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=model.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def check_label_shape(model_config: Any, labels: torch.Tensor) -> None:
    """One float per example on a model of several classes: transformers would take them for multi-label targets
    (``problem_type`` multi_label_classification, one float per class) and fail on the shapes. Read from the
    labels' dtype and shape only: no host sync."""
    num_labels = model_config.num_labels
    if num_labels > 1 and labels.is_floating_point() and labels.ndim == 1:
        raise BatchError(
            f"the labels are floats, one per example, but the model has num_labels={num_labels}: classification "
            f"needs integer class labels (0 to {num_labels - 1}; cast the column, e.g. dataset = "
            "dataset.cast_column('label', datasets.Value('int64'))), multi-label classification one float per "
            "class, and regression (one score per example) a model loaded with num_labels=1"
        )


def deberta_v2_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``DebertaV2ForSequenceClassification``'s own loss when ``config.problem_type`` is unset, which differs from
    transformers' shared one: one label is a regression that returns ``[n]`` logits; class labels below 0 are left
    out (a loss of 0 when none is left); labels ``[n, num_labels]`` are soft targets of a cross-entropy."""
    if model.num_labels == 1:
        logits = logits.view(-1).to(labels.dtype)
        return F.mse_loss(logits, labels.view(-1)), logits
    if labels.dim() == 1 or labels.size(-1) == 1:  # the mean over kept labels, 0 without any; no host read
        labels = labels.view(-1).long()
        kept = labels >= 0
        losses = F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none") * kept
        return losses.sum() / kept.sum().clamp(min=1), logits
    return -(F.log_softmax(logits, dim=-1) * labels).sum(-1).mean(), logits


#: ``config.model_type`` -> its classifier's own loss where it differs from transformers' shared
#: ``ForSequenceClassificationLoss`` (only when ``config.problem_type`` is unset).
OWN_LOSSES: Mapping[str, Callable] = MappingProxyType({"deberta-v2": deberta_v2_loss})


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
