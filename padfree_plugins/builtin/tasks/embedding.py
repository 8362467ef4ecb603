"""Task ``embedding``: train text-embedding models padding-free with sentence-transformers' losses.

Rows carry several text columns — ``anchor_input_ids``, ``positive_input_ids``, ``negative_input_ids`` … (the
names sentence-transformers gives them) — and optionally a row label (``label`` / ``labels`` / ``score``, for
CoSENT, contrastive and similar losses). Every text of every column is packed into **one** row, column-major, with
explicit group (row) and column ids (:class:`~padfree_plugins.builtin.tasks.collators.ColumnsCollator`); one
forward embeds them all; the pooler reduces every text to a vector over ``cu_seq_lens``; the vectors, split back
into columns, go to the loss's own ``compute_loss_from_embeddings``.

``task_options``:

* ``loss``: a loss class of ``sentence_transformers.sentence_transformer.losses`` by name (e.g.
  ``MultipleNegativesRankingLoss`` — InfoNCE with in-batch negatives —, ``CoSENTLoss``, ``ContrastiveLoss``,
  ``TripletLoss``), or, from Python, a loss object with ``compute_loss_from_embeddings``; ``null``: no loss
  (inference).
* ``loss_kwargs``: arguments of the loss (``similarity_fct`` by name from ``sentence_transformers.util``).
* ``normalize``: L2-normalise the embeddings (as a ``Normalize`` module would).
* ``include_prompt``: false leaves each text's ``<column>_prompt_length`` first tokens out of the pooling.
* ``columns``: the column names in order (default: those of the first row).

The pooling mode is ``pooling:`` (default: the architecture's — CLS for encoders, last token for decoders).
With HF ``Trainer``, ``remove_unused_columns`` can stay at its default: the collator names the dataset columns it
reads (``dataset_columns``), and :func:`padfree_plugins.accelerate` keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from padfree_plugins.builtin.tasks.collators import ColumnsCollator, packing_for
from padfree_plugins.config.task_options import read_options
from padfree_plugins.contract.declarations import Task
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BatchError, ConfigError, did_you_mean
from padfree_plugins.modeling.heads import call_model, run_base

TASK = "embedding"
OPTIONS = {"loss": None, "loss_kwargs": {}, "normalize": False, "include_prompt": True, "columns": []}


@dataclass
class EmbeddingOutput(ModelOutput):
    """``embeddings`` ``[n_texts, H]`` in packed (column-major) order; ``column_embeddings`` one ``[rows, H]``
    tensor per column."""

    loss: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    column_embeddings: tuple[torch.Tensor, ...] | None = None


def sentence_transformers_loss(loss: Any, loss_kwargs: Mapping[str, Any]) -> Any:
    """A sentence-transformers loss object from its class name (or the object itself)."""
    if loss is None or hasattr(loss, "compute_loss_from_embeddings"):
        return loss
    if not isinstance(loss, str):
        raise ConfigError(f"task_options: loss must be a sentence-transformers loss name or object, got {loss!r}")
    try:
        from sentence_transformers import util
        try:
            from sentence_transformers.sentence_transformer import losses
        except ImportError:  # sentence-transformers < 6.2
            from sentence_transformers import losses
    except ImportError:
        raise ConfigError(f"task_options: loss {loss!r} needs sentence-transformers: pip install "
                          "'padfree-plugins[train]'") from None
    names = [name for name in dir(losses) if hasattr(getattr(losses, name), "compute_loss_from_embeddings")]
    if loss not in names:
        raise ConfigError(
            f"task_options: loss {loss!r} is not a sentence-transformers loss that works from embeddings."
            f"{did_you_mean(loss, names)} Available: {', '.join(sorted(names))}."
        )
    kwargs = dict(loss_kwargs)
    if isinstance(kwargs.get("similarity_fct"), str):
        name = kwargs["similarity_fct"]
        if not callable(getattr(util, name, None)):
            raise ConfigError(f"task_options: similarity_fct {name!r} is not a function of sentence_transformers.util "
                              "(e.g. cos_sim, dot_score, pairwise_cos_sim)")
        kwargs["similarity_fct"] = getattr(util, name)
    try:
        return getattr(losses, loss)(model=None, **kwargs)
    except (TypeError, AttributeError, ValueError) as error:
        raise ConfigError(f"task_options: cannot build {loss} with loss_kwargs {dict(loss_kwargs)}: {error}") from None


@dataclass(frozen=True)
class EmbeddingForward:
    """``(model, packed batch) -> EmbeddingOutput(loss, embeddings, column_embeddings)``."""

    runs_inside_model_forward = True  # see heads.call_model
    uses_assembly_pooler = True  # assembly hands it the pooler of the pool hook (a plugin's mode included)
    loss_is_scaled_for_ga = False  # a loss over the batch: the trainer averages it over accumulation steps
    #: Under sequence parallelism: ``hidden(inner)`` gives this rank's own batch's last hidden states
    #: (:meth:`~padfree_plugins.modeling.sequence_parallel.SequenceParallelForward.pooled`); the loss (in-batch
    #: negatives included) is over the rank's own micro-batch, as under data parallelism.
    pools_examples = True

    pooler: Any = None
    loss: Any = None
    normalize: bool = False

    def embed(self, model: Any, batch: Mapping, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One vector per packed text ``[n_texts, H]``; ``hidden``: the batch's last hidden states ``[1, T, H]`` where
        computed elsewhere (under sequence parallelism), else the base's on ``batch``."""
        embeddings = self.pooler(run_base(model, batch) if hidden is None else hidden, batch)
        return F.normalize(embeddings, p=2, dim=-1) if self.normalize else embeddings

    def __call__(self, model: Any, batch: Mapping, hidden: Callable | None = None,
                 **loss_kwargs: Any) -> EmbeddingOutput:
        return call_model(model, lambda inner: self.compute(inner, batch, None if hidden is None else hidden(inner)))

    def for_metrics(self, outputs: EmbeddingOutput, batch: Mapping) -> tuple[tuple[torch.Tensor, ...], Any]:
        """What ``evaluate`` / ``predict`` hand ``compute_metrics``, one entry per dataset row: every column's
        embeddings ``[rows, H]`` (a tuple, in column order) and the row labels."""
        return outputs.column_embeddings, batch.get("labels")

    def compute(self, model: Any, batch: Mapping, hidden: torch.Tensor | None = None) -> EmbeddingOutput:
        embeddings = self.embed(model, batch, hidden)
        rows, columns = batch.get("num_rows", embeddings.shape[0]), batch.get("num_columns", 1)
        if rows * columns != embeddings.shape[0]:
            raise BatchError(
                f"the batch says {rows} rows x {columns} columns but packs {embeddings.shape[0]} texts: build "
                "embedding batches with the embedding collator (assembly.collator)"
            )
        per_column = tuple(embeddings.view(columns, rows, -1).unbind(0))
        loss = None if self.loss is None else self.loss_of(per_column, batch.get("labels"))
        return EmbeddingOutput(loss=loss, embeddings=embeddings, column_embeddings=per_column)

    def loss_of(self, per_column: tuple[torch.Tensor, ...], labels: torch.Tensor | None) -> torch.Tensor | None:
        """The loss of the columns' embeddings; ``None`` for a loss that needs labels on rows without any (the
        embeddings of an unlabelled set: a trainer then says the loss is missing, instead of the loss's own
        ``'NoneType' object has no attribute 'numel'``). A loss that fails on one column (rows of plain
        ``input_ids``) is told which columns the task needs."""
        try:
            return self.loss.compute_loss_from_embeddings(list(per_column), labels)
        except (AttributeError, TypeError):
            if labels is None:
                return None
            if len(per_column) == 1:
                raise one_column_error(self.loss) from None
            raise
        except (ValueError, IndexError, AssertionError):
            if len(per_column) == 1:
                raise one_column_error(self.loss) from None
            raise


def one_column_error(loss: Any) -> BatchError:
    """What to give a loss that compares texts (pairs, triplets) when each row holds one text."""
    return BatchError(
        f"{type(loss).__name__} compares the texts of a row (anchor with positive, …), but each row holds one "
        "text: plain 'input_ids' is one column. The embedding task reads one '<column>_input_ids' per text of a "
        "row, in order: anchor_input_ids, positive_input_ids (and negative_input_ids …), e.g. from "
        "sentence-transformers' anchor / positive text columns: dataset = dataset.map(lambda row: "
        "{f'{c}_input_ids': tokenizer(row[c])['input_ids'] for c in ('anchor', 'positive')}). Only the "
        "Batch*TripletLoss losses take one text per row, with a class label"
    )


def _options(config) -> dict[str, Any]:
    options = read_options(TASK, config.task_options, OPTIONS)
    if not isinstance(options["loss_kwargs"], Mapping):
        raise ConfigError(f"task_options: loss_kwargs must be a mapping, got {options['loss_kwargs']!r}")
    if not isinstance(options["columns"], (list, tuple)) or not all(isinstance(c, str) for c in options["columns"]):
        raise ConfigError(f"task_options: columns must be a list of column names, got {options['columns']!r}")
    return options


@hookimpl
def register_tasks():
    return [Task(TASK, example_keys=("labels", "label", "score"), needs_pooling=True, options=OPTIONS,
                 description="text embeddings: every column of every row packed into one row, pooled per text, "
                 "sentence-transformers losses (MultipleNegativesRanking/InfoNCE, CoSENT, Contrastive …)")]


# The assembly hooks below are plain, not trylast: the core plugin's defaults are trylast and answer every task,
# so this task's answers must come first. They return None for other tasks.
@hookimpl
def collate(task, architecture, model_config, config):
    if task.name != TASK:
        return None
    options = _options(config)
    return ColumnsCollator(packing_for(task, architecture, model_config, config), tuple(options["columns"]))


@hookimpl
def task_forward(task, architecture, config):
    if task.name != TASK:
        return None
    options = _options(config)
    return EmbeddingForward(loss=sentence_transformers_loss(options["loss"], options["loss_kwargs"]),
                            normalize=bool(options["normalize"]))
