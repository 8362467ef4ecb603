"""Task ``reranker``: score (query, document) inputs padding-free and train them pointwise or listwise.

Scores (``task_options.scorer``):

* ``head`` (default) — a ``*ForSequenceClassification`` model with ``num_labels=1`` (a cross-encoder, or a
  decoder with a ``score`` layer): its own head on every example's pooled token.
* ``yes_no`` — a ``*ForCausalLM`` model (generative rerankers such as Qwen3-Reranker): the logits of the
  ``yes_token_id`` and ``no_token_id`` tokens at every example's last token, computed from those two rows of
  the LM head only; the score is ``logit(yes) - logit(no)``, the log-odds of "yes" between the two.

Objectives (``task_options.objective``):

* ``pointwise`` (default) — binary cross-entropy on every score against its label (0 / 1, or a soft target).
* ``listwise`` — softmax cross-entropy over each query's group: every example carries ``group`` (its query id),
  a group is contiguous and has exactly one positive (label 1) and any number of negatives; groups may have
  different sizes. The collator checks all of it and records explicit group indices.

``pairs`` (default true): the inputs are (query, document) pairs, so a model with token types (BERT) needs
``token_type_ids`` in every example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from padfree_plugins.builtin.tasks.collators import ExampleCollator, packing_for
from padfree_plugins.config.task_options import read_options
from padfree_plugins.contract.declarations import Task
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BatchError, ConfigError, UnsupportedArchitectureError
from padfree_plugins.modeling.heads import call_model, check_lm_head, check_sequence_head, sequence_logits, token_logits
from padfree_plugins.modeling.patching import unwrap_model

TASK = "reranker"
OPTIONS = {"objective": "pointwise", "scorer": "head", "yes_token_id": None, "no_token_id": None, "pairs": True}
CHOICES = {"objective": ("pointwise", "listwise"), "scorer": ("head", "yes_no")}
#: Batch keys the listwise objective reads (written by the collator).
GROUP_KEYS = ("group_index", "group_position", "num_groups", "max_group_size")


@dataclass
class RerankerOutput(ModelOutput):
    """``scores`` ``[n]`` (higher is more relevant), ``logits`` ``[n, 1]`` (head) or ``[n, 2]`` (yes, no)."""

    loss: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def group_table(values: torch.Tensor, batch: Mapping, fill: float) -> torch.Tensor:
    """Per-example ``values`` laid out one query per row ``[groups, max_group_size]``; missing slots are ``fill``."""
    missing = [key for key in GROUP_KEYS if key not in batch]
    if missing:
        raise BatchError(
            f"listwise ranking needs the group keys {', '.join(map(repr, missing))} that the reranker collator "
            "writes (assembly.collator with objective: listwise): build batches with it"
        )
    index, position = batch["group_index"], batch["group_position"]
    if index.shape[0] != values.shape[0] or position.shape[0] != values.shape[0]:
        raise BatchError(
            f"the batch has group ids for {index.shape[0]} examples but {values.shape[0]} examples: group ids must "
            "come from the same collation as the examples (one group id per example)"
        )
    table = values.new_full((batch["num_groups"], batch["max_group_size"]), fill)
    return table.index_put((index.to(values.device), position.to(values.device)), values)


def grouped_logits(scores: torch.Tensor, batch: Mapping) -> torch.Tensor:
    """Scores laid out one query per row ``[groups, max_group_size]``; missing slots are the dtype's minimum."""
    return group_table(scores, batch, torch.finfo(scores.dtype).min)


def listwise_loss(scores: torch.Tensor, batch: Mapping) -> torch.Tensor:
    """Softmax cross-entropy over each query's group, averaged over queries."""
    table = grouped_logits(scores, batch)
    if "positive_position" not in batch:
        raise BatchError("listwise ranking needs 'positive_position' (which example of each group is the positive), "
                         "written by the reranker collator from the labels")
    target = batch["positive_position"].to(scores.device)
    if target.shape[0] != table.shape[0]:
        raise BatchError(f"the batch has {target.shape[0]} positives for {table.shape[0]} groups: one per group")
    return F.cross_entropy(table.float(), target)


@dataclass(frozen=True)
class RerankerForward:
    """``(model, packed batch) -> RerankerOutput(loss, scores [n], logits)``."""

    runs_inside_model_forward = True  # see heads.call_model
    loss_is_scaled_for_ga = False  # a mean over the batch: the trainer averages it over accumulation steps
    #: Under sequence parallelism: ``hidden(inner)`` gives this rank's own batch's last hidden states
    #: (:meth:`~padfree_plugins.modeling.sequence_parallel.SequenceParallelForward.pooled`).
    pools_examples = True

    objective: str = "pointwise"
    scorer: str = "head"
    yes_token_id: int | None = None
    no_token_id: int | None = None

    def logits(self, model: Any, batch: Mapping, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, 1]`` (head) or ``[n, 2]`` (yes, no); ``hidden``: the batch's last hidden states where computed
        elsewhere (under sequence parallelism)."""
        if self.scorer == "yes_no":
            return token_logits(model, batch, (self.yes_token_id, self.no_token_id), hidden)
        num_labels = unwrap_model(model).config.num_labels
        if num_labels != 1:
            raise UnsupportedArchitectureError(
                f"a reranker head gives one relevance score, so the model needs num_labels=1; it has {num_labels}. "
                "Load it with num_labels=1, or use task seq_cls to classify"
            )
        return sequence_logits(model, batch, hidden)

    def check_model(self, model: Any) -> None:
        """At assembly: the head this scorer reads exists."""
        if self.scorer == "yes_no":
            check_lm_head(model, "reranker (scorer yes_no)")
        else:
            check_sequence_head(model, "reranker (scorer head)")

    def __call__(self, model: Any, batch: Mapping, hidden: Callable | None = None,
                 **loss_kwargs: Any) -> RerankerOutput:
        return call_model(model, lambda inner: self.compute(inner, batch, None if hidden is None else hidden(inner)))

    def for_metrics(self, outputs: RerankerOutput, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``evaluate`` / ``predict`` hand ``compute_metrics`` (predictions, labels), one entry per dataset row.
        Pointwise: the logits — ``[n, 1]`` as a padded cross-encoder gives them, ``[n, 2]`` (yes, no) — and the
        labels. Listwise (one row per query): scores and labels ``[queries, max_group_size]``, -100 in empty slots."""
        labels = batch.get("labels")
        if self.objective != "listwise":
            return outputs.logits, labels
        return (group_table(outputs.scores, batch, -100),
                None if labels is None else group_table(labels.to(outputs.scores.device), batch, -100))

    def compute(self, model: Any, batch: Mapping, hidden: torch.Tensor | None = None) -> RerankerOutput:
        logits = self.logits(model, batch, hidden)
        scores = logits[:, 0] - logits[:, 1] if self.scorer == "yes_no" else logits[:, 0]
        loss = None
        labels = batch.get("labels")
        if self.objective == "listwise":
            if labels is not None:
                loss = listwise_loss(scores, batch)
        elif labels is not None:
            loss = F.binary_cross_entropy_with_logits(scores.float(), labels.to(scores.device).float().view(-1))
        return RerankerOutput(loss=loss, scores=scores, logits=logits)


def _options(config) -> dict[str, Any]:
    options = read_options(TASK, config.task_options, OPTIONS, CHOICES)
    if options["scorer"] == "yes_no":
        for key in ("yes_token_id", "no_token_id"):
            if not isinstance(options[key], int) or isinstance(options[key], bool) or options[key] < 0:
                raise ConfigError(
                    f"task_options: scorer yes_no needs {key} (the vocabulary id of the answer token, e.g. "
                    f"tokenizer.convert_tokens_to_ids('yes')), got {options[key]!r}"
                )
    return options


@hookimpl
def register_tasks():
    return [Task(TASK, example_keys=("labels", "label", "group"), options=OPTIONS,
                 description="rerankers: cross-encoder head or generative yes/no scores, pointwise BCE or "
                 "listwise softmax over explicit query groups")]


# The assembly hooks below are plain, not trylast: the core plugin's defaults are trylast and answer every task,
# so this task's answers must come first. They return None for other tasks.
@hookimpl
def collate(task, architecture, model_config, config):
    if task.name != TASK:
        return None
    options = _options(config)
    return ExampleCollator(packing_for(task, architecture, model_config, config), pairs=bool(options["pairs"]),
                           type_vocab_size=int(getattr(model_config, "type_vocab_size", 0) or 0),
                           groups=options["objective"] == "listwise",
                           float_labels=options["objective"] == "pointwise")


@hookimpl
def task_forward(task, architecture, config):
    if task.name != TASK:
        return None
    options = _options(config)
    return RerankerForward(options["objective"], options["scorer"], options["yes_token_id"], options["no_token_id"])
