"""Collators for the per-example tasks (``seq_cls``, ``reranker``, ``embedding``).

Each wraps the core :class:`~padfree_plugins.packing.collator.PackingCollator` (tokens, positions, boundaries) and adds
what its task needs, checked on the CPU at collation time so that the forward never has to sync to validate:

* :class:`ExampleCollator` — one output per example: ``labels``, sentence-pair ``token_type_ids``, and for
  listwise ranking the group of every example (``group``), turned into explicit group indices.
* :class:`ColumnsCollator` — embedding rows with several text columns (anchor, positive, negatives …): every
  text of every column packed into one row, column-major, with explicit group (row) and column ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from padfree_plugins.errors import BatchError
from padfree_plugins.modeling.pooling import PROMPT_LENGTH_KEY
from padfree_plugins.packing.batch import INDEX_KEY, PackedBatch
from padfree_plugins.packing.collator import (
    PackingCollator,
    WrapsPackingCollator,
    as_examples,
    holds_several_texts,
    packing_collator,
    stack_example_values,
)

#: Names a per-example label may have in a dataset row; the batch always calls it ``labels``.
LABEL_KEYS = ("labels", "label", "score")
GROUP_KEY = "group"


def packing_for(task: Any, architecture: Any, model_config: Any, config: Any) -> PackingCollator:
    """The core packing collator for a task whose per-example keys (``Task.example_keys``: labels, groups) are
    optional and handled by the collators here rather than required by the core one."""
    return dataclasses.replace(packing_collator(task, architecture, model_config, config), example_keys=())


def labels_of(rows: Sequence[Mapping[str, Any]], float_labels: bool = False) -> torch.Tensor | None:
    """The label of every row (key ``labels``, ``label`` or ``score``), or ``None`` when no row has one."""
    key = next((k for k in LABEL_KEYS if k in rows[0]), None)
    have = [key is not None and key in row for row in rows]
    if not any(have):
        if any(k in row for row in rows for k in LABEL_KEYS):
            raise BatchError("some examples have a label and example 0 has none: label every example or none")
        return None
    if not all(have):
        raise BatchError(f"{key!r} is present in some examples but not in example {have.index(False)}: "
                         "label every example or none")
    return stack_example_values([row[key] for row in rows], f"the label {key!r}", float_labels)


def _first_position(flags: np.ndarray) -> int:
    return int(np.flatnonzero(flags)[0])


@dataclass
class ExampleCollator(WrapsPackingCollator):
    """Packs examples that each get one output (a class, a score).

    Args:
        packing: the core packing collator (positions start, max_length, token keys).
        pairs: the inputs are sentence pairs. With a model that has token types (``type_vocab_size > 1``,
            e.g. BERT) every example must then carry ``token_type_ids`` marking its second text.
        type_vocab_size: the model's ``type_vocab_size`` (0 when it has none).
        groups: listwise ranking: every example carries ``group`` (its query's id); a query's examples are
            contiguous and, when labelled, exactly one of them is the positive (label 1).
        float_labels: labels become float32 (BCE targets) whatever their type in the dataset.
        num_labels: the model's classes: integer labels must be one of them (or -100, ignored); 0: unchecked.
    """

    packing: PackingCollator
    pairs: bool = False
    type_vocab_size: int = 0
    groups: bool = False
    float_labels: bool = False
    num_labels: int = 0

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        examples = as_examples(examples)
        first = examples[0] if examples else None
        if self.groups and isinstance(first, Mapping) and holds_several_texts(first.get("input_ids")):
            examples = expand_group_rows(examples)
        batch = self.packing(examples)
        labels = labels_of(examples, self.float_labels)
        if labels is not None:
            self._check_classes(labels)
            batch["labels"] = labels
        if self.pairs and self.type_vocab_size > 1:
            self._check_pairs(batch)
        if self.groups:
            batch.update(self._groups(examples, labels))
        return batch

    def check_trainer_dataset(self, dataset: Any) -> None:
        """Listwise ranking through a trainer needs one row per query: candidates given one per row would be
        split over batches (shuffled in training, cut at batch boundaries in evaluation), splitting queries' groups."""
        if not self.groups or not hasattr(dataset, "__getitem__") or not len(dataset):
            return
        first = dataset[0]
        if isinstance(first, Mapping) and GROUP_KEY in first and not holds_several_texts(first.get("input_ids")):
            raise BatchError(
                f"listwise ranking gets one candidate per row (with {GROUP_KEY!r} ids), but the trainer batches rows "
                "(and shuffles them for training), which would split queries' candidates over batches: give one row "
                "per query (train and eval datasets), with input_ids a list of its candidates' token ids and labels "
                "one 0 / 1 per candidate"
            )

    def _check_classes(self, labels: torch.Tensor) -> None:
        """Class-index labels (integers, one per example) must name one of the model's classes; multi-label targets
        (a list per example) must be ``num_labels`` wide."""
        if labels.ndim == 2 and self.num_labels >= 1 and not self.float_labels and labels.shape[1] != self.num_labels:
            raise BatchError(
                f"example 0 has {labels.shape[1]} multi-label targets, but the model has num_labels={self.num_labels}: "
                f"give one target per class, or load the model with num_labels={labels.shape[1]}")
        if self.num_labels < 2 or labels.ndim != 1 or labels.is_floating_point():
            return
        bad = ((labels < 0) | (labels >= self.num_labels)) & (labels != -100)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise BatchError(
                f"example {i} has label {int(labels[i])}, but the model has num_labels={self.num_labels} (classes 0 "
                f"to {self.num_labels - 1}): load the model with num_labels set to the number of classes"
            )

    def _check_pairs(self, batch: PackedBatch) -> None:
        if "token_type_ids" not in batch:
            raise BatchError(
                f"the inputs are sentence pairs (task_options pairs: true) and the model has token types "
                f"(type_vocab_size={self.type_vocab_size}), but example 0 has no 'token_type_ids': without them "
                "both texts would be read as the first segment. Tokenize pairs with tokenizer(text, text_pair) "
                "(which returns token_type_ids) and keep that column, or set pairs: false for single texts."
            )
        n = batch.num_examples
        second = torch.zeros(n, dtype=torch.long).scatter_reduce(
            0, batch["seq_idx"][0].long(), batch["token_type_ids"][0], reduce="amax", include_self=False)
        single = (second == 0).numpy()
        if single.any():
            raise BatchError(
                f"example {_first_position(single)} is marked as a sentence pair (task_options pairs: true) but its "
                f"token_type_ids are all 0, i.e. one segment ({int(single.sum())} such example(s)): tokenize pairs "
                "with tokenizer(text, text_pair), not as one joined string"
            )

    def _groups(self, examples: Sequence[Mapping[str, Any]], labels: torch.Tensor | None) -> dict[str, Any]:
        missing = [i for i, ex in enumerate(examples) if GROUP_KEY not in ex]
        if missing:
            raise BatchError(
                f"listwise ranking needs {GROUP_KEY!r} (the id of the query an example belongs to) in every example; "
                f"example {missing[0]} has none"
            )
        ids = stack_example_values([ex[GROUP_KEY] for ex in examples], f"{GROUP_KEY!r}").numpy()
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise BatchError(f"{GROUP_KEY!r} must be one integer per example (a query id), got dtype {ids.dtype} "
                             f"and shape {ids.shape}")
        n = ids.size
        new_run = np.r_[True, ids[1:] != ids[:-1]]
        starts = np.flatnonzero(new_run)
        run_ids = ids[starts]
        unique, counts = np.unique(run_ids, return_counts=True)
        if (counts > 1).any():
            bad = unique[counts > 1][0]
            where = np.flatnonzero(ids == bad)
            raise BatchError(
                f"group {int(bad)} is not contiguous: its examples are at positions {where.tolist()[:8]}. Put all the "
                "examples of a query next to each other (positive and negatives), one query after the other"
            )
        group_index = np.cumsum(new_run) - 1
        position = np.arange(n) - starts[group_index]
        sizes = np.diff(np.r_[starts, n])
        out = {
            "group_ids": torch.from_numpy(ids.astype(np.int64)),
            "group_index": torch.from_numpy(group_index.astype(np.int64)),
            "group_position": torch.from_numpy(position.astype(np.int64)),
            "num_groups": int(starts.size),
            "max_group_size": int(sizes.max()),
        }
        if labels is not None:
            out["positive_position"] = self._positives(labels, ids, starts, group_index, position)
        return out

    @staticmethod
    def _positives(labels: torch.Tensor, ids: np.ndarray, starts: np.ndarray, group_index: np.ndarray,
                   position: np.ndarray) -> torch.Tensor:
        values = labels.numpy()
        if values.ndim != 1 or not np.isin(values, (0, 1)).all():
            raise BatchError("listwise ranking labels must be 1 (the positive) or 0 (a negative), one per example; "
                             f"got {np.unique(values).tolist()[:6]}")
        positive = values == 1
        per_group = np.add.reduceat(positive.astype(np.int64), starts)
        for problem, flags in (("no positive (no example with label 1)", per_group == 0),
                               ("more than one positive", per_group > 1)):
            if flags.any():
                g = _first_position(flags)
                raise BatchError(
                    f"group {int(ids[starts[g]])} has {problem}: listwise ranking needs exactly one positive and "
                    f"k negatives per query ({int(flags.sum())} such group(s) in this batch; with one row per query "
                    "the group is the row's position in the batch)"
                )
        result = np.empty(starts.size, dtype=np.int64)
        result[group_index[positive]] = position[positive]
        return torch.from_numpy(result)


def expand_group_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Listwise rows that each hold one query's candidates — ``input_ids`` (and ``token_type_ids``) a list of
    sequences, ``labels`` one 0 / 1 per candidate — as one example per candidate with ``group`` = the row.

    With rows like these, any sampler (HF Trainer shuffles rows) keeps every query's group together."""
    examples = []
    for r, row in enumerate(rows):
        candidates = list(row["input_ids"])
        key = next((k for k in LABEL_KEYS if k in row), None)
        for name, values in (("token_type_ids", row.get("token_type_ids")), (key, row.get(key) if key else None)):
            if values is not None and len(values) != len(candidates):
                raise BatchError(f"row {r} has {len(candidates)} candidates in input_ids but {len(values)} {name}: "
                                 "give one per candidate")
        for j, ids in enumerate(candidates):
            example = {"input_ids": ids, GROUP_KEY: r, **({INDEX_KEY: row[INDEX_KEY]} if INDEX_KEY in row else {})}
            if row.get("token_type_ids") is not None:
                example["token_type_ids"] = row["token_type_ids"][j]
            if key is not None:
                example["labels"] = row[key][j]
            examples.append(example)
    return examples


def column_key(column: str, key: str) -> str:
    """The row key of ``key`` in ``column`` (``anchor_input_ids``); a nameless column is the row itself."""
    return f"{column}_{key}" if column else key


def columns_of(row: Mapping[str, Any]) -> tuple[str, ...]:
    """The text columns of a row, in order: every ``<column>_input_ids`` key, else the row's own ``input_ids``."""
    columns = tuple(key[: -len("_input_ids")] for key in row if key.endswith("_input_ids"))
    if columns:
        return columns
    if "input_ids" in row:
        return ("",)
    raise BatchError(f"an embedding row needs '<column>_input_ids' keys (e.g. anchor_input_ids, positive_input_ids) "
                     f"or 'input_ids'; it has {', '.join(map(repr, row)) or 'no keys'}")


@dataclass
class ColumnsCollator(WrapsPackingCollator):
    """Packs every text of every row into one row, column-major (all anchors, then all positives, …).

    Rows carry ``<column>_input_ids`` (and optionally ``<column>_token_type_ids``, ``<column>_prompt_length``)
    plus an optional row label (``labels`` / ``label`` / ``score``). The batch adds ``group_ids`` (the row of
    every text), ``column_ids`` (its column), ``num_rows`` and ``num_columns`` (python ints), ``labels`` and
    ``prompt_length`` (one per text, 0 where a column has no prompt).

    Args:
        packing: the core packing collator.
        columns: the column names, in order; empty: those of the first row.
    """

    packing: PackingCollator
    columns: tuple[str, ...] = ()

    def _check_text_length(self, row: int, key: str, ids: Any) -> None:
        """Name the row and the column of an empty or over-long text (packing only knows the text's position)."""
        length = len(ids) if hasattr(ids, "__len__") else -1
        packing = self.packing
        if length == 0:
            raise BatchError(f"row {row}: {key!r} has no tokens; filter empty texts out of the dataset")
        if packing.max_length is not None and packing.on_overlong == "error" and length > packing.max_length:
            raise BatchError(packing.overlong_message(row, length, f" ({key})"))

    @staticmethod
    def _checked_prompt(row: int, key: str, values: Mapping[str, Any]) -> Any:
        """A text's prompt length, if it has one: a whole number of tokens, 0 or more (a text that is all prompt
        pools as sentence-transformers pools it)."""
        prompt = values.get(key)
        if prompt is None:
            return None
        prompt = int(prompt) if isinstance(prompt, (torch.Tensor, np.integer)) and prompt.ndim == 0 else prompt
        if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
            raise BatchError(f"row {row}: {key!r} is {prompt!r}; a prompt length is a number of tokens, 0 or more")
        return prompt

    def dataset_columns(self, names: Sequence[str]) -> list[str]:
        """Which of a dataset's column ``names`` this collator reads (so a trainer keeps them)."""
        suffixes = ("_input_ids", "_token_type_ids", f"_{PROMPT_LENGTH_KEY}")
        return [name for name in names if name in LABEL_KEYS or name.endswith(suffixes)]

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> PackedBatch:
        rows = as_examples(rows)
        if not len(rows):
            raise BatchError("the embedding collator takes a non-empty list of rows (one dict per row)")
        columns = self.columns or columns_of(rows[0])
        texts, prompts = [], []
        for column in columns:
            ids_key = column_key(column, "input_ids")
            for i, row in enumerate(rows):
                if ids_key not in row:
                    raise BatchError(f"row {i} has no {ids_key!r} (columns: {', '.join(map(repr, columns))}); "
                                     "every row needs every column")
                self._check_text_length(i, ids_key, row[ids_key])
                text = {"input_ids": row[ids_key], **({INDEX_KEY: row[INDEX_KEY]} if INDEX_KEY in row else {})}
                token_types = row.get(column_key(column, "token_type_ids"))
                if token_types is not None:
                    text["token_type_ids"] = token_types
                texts.append(text)
                prompts.append(self._checked_prompt(i, column_key(column, PROMPT_LENGTH_KEY), row))
        batch = self.packing(texts)
        n_rows, n_columns = len(rows), len(columns)
        batch["group_ids"] = torch.arange(n_rows).repeat(n_columns)
        batch["column_ids"] = torch.arange(n_columns).repeat_interleave(n_rows)
        batch["num_rows"], batch["num_columns"] = n_rows, n_columns
        labels = labels_of(rows)
        if labels is not None:
            batch["labels"] = labels
        if any(p is not None for p in prompts):
            prompt_lengths = [0 if p is None else p for p in prompts]
            batch[PROMPT_LENGTH_KEY] = stack_example_values(prompt_lengths, f"{PROMPT_LENGTH_KEY!r}")
        return batch
