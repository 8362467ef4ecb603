"""Check a whole dataset against a packing collator before training starts.

The collator refuses bad examples anyway, but only when a batch reaches it, possibly hours into a run. This
check finds the same problems up front: empty examples, examples longer than the collator accepts (the model's
``max_position_embeddings`` or the config's ``max_length``; in rows of several examples, TRL's ``packing=True``
with a ``seq_lengths`` column, each example by its own length), and per-token keys (``labels``) whose length differs
from ``input_ids`` — for the embedding task, in every ``<column>_input_ids`` column — token ids below 0 or not in
the model's input embeddings (the collator's ``vocab_size``), per-token labels other than -100 outside the
vocabulary, per-example class labels outside ``num_labels`` (or multi-label targets of another width), an
``attention_mask`` with zeros (a padded example), ``position_ids`` / ``cache_position`` other than the collator's
own (one per token, restarting at every example: it never replaces them), and images or video (the
:data:`~padfree_plugins.packing.batch.MEDIA_KEYS` columns) for a model whose plugin packs text only: a trainer's
column removal would drop them silently, their placeholder tokens left in the text. Every error names the example by
its index in the dataset. With ``on_overlong: truncate`` it also reports the rows whose every label truncation
erases (:func:`inspect_dataset`), which the trainers drop with a warning. It reads lengths and the least and
greatest value of each column's chunk: a vectorised pass over Arrow columns for a ``datasets.Dataset`` (the values
are copied out only to find a bad row, to compare a positions column, or to find truncated rows' labels), a Python
pass for an in-memory list; streaming datasets, on-the-fly transforms and rows without ``input_ids`` (TRL's vision
rows: messages and images, processed at collate time) are left to the collator.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree_plugins.errors import BatchError
from padfree_plugins.packing.batch import MEDIA_KEYS
from padfree_plugins.packing.collator import (
    BUILT_POSITION_KEYS,
    label_outside_vocabulary_message,
    outside_vocabulary_message,
    padded_message,
    positions_message,
)

#: Plain Python datasets longer than this are left to the collator (a Python pass would take too long).
MAX_PYTHON_ROWS = 200_000
#: The column of a row that holds several examples (TRL's ``packing=True``): their lengths, which the collator splits
#: the row by.
PACKED_LENGTHS_KEY = "seq_lengths"
#: The per-token mask a plain example may carry: checked for length and for zeros (padding), as the collator does.
MASK_KEY = "attention_mask"


def _packing(collator: Any) -> Any:
    """The :class:`~padfree_plugins.packing.collator.PackingCollator` inside a task collator (or the collator
    itself)."""
    return getattr(collator, "packing", collator)


@dataclass
class _Values:
    """The values of one list column in one chunk of rows: ``flat`` (a numpy or pyarrow array of every value, row
    after row; a nested row's values flattened) and ``counts``, how many values each row has (0 for a missing one)."""

    flat: Any
    counts: np.ndarray

    def bounds(self) -> tuple[Any, Any] | None:
        """The least and the greatest value (``None`` for no values): one vectorised pass, nothing copied."""
        if not len(self.flat):
            return None
        if isinstance(self.flat, np.ndarray):
            return self.flat.min(), self.flat.max()
        import pyarrow.compute as pc

        found = pc.min_max(self.flat)
        return found["min"].as_py(), found["max"].as_py()

    def first(self, bad: Any) -> tuple[int, int, int]:
        """``(row, value, rows)``: the first row holding a value for which ``bad(values)`` holds, that value, and how
        many rows hold one."""
        flat = self.flat if isinstance(self.flat, np.ndarray) else self.flat.to_numpy(zero_copy_only=False)
        hits = np.flatnonzero(bad(flat))
        rows = np.searchsorted(np.cumsum(self.counts), hits, side="right")
        return int(rows[0]), int(flat[hits[0]]), int(np.unique(rows).size)


def _arrow_values(column: Any) -> _Values | None:
    """:class:`_Values` of an Arrow list column (of lists, for rows of several texts); ``None`` for a column whose
    values are not numbers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def is_list(kind: Any) -> bool:
        return pa.types.is_list(kind) or pa.types.is_large_list(kind)

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not is_list(column.type):
        return None
    counts = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(column)
    while is_list(flat.type):  # a row of several texts: count every text's values for its row
        owners = np.repeat(np.arange(counts.size), counts)
        inner = pc.list_value_length(flat).fill_null(0).to_numpy(zero_copy_only=False)
        counts = np.bincount(owners, weights=inner, minlength=counts.size).astype(np.int64)
        flat = pc.list_flatten(flat)
    if not (pa.types.is_integer(flat.type) or pa.types.is_boolean(flat.type)):
        return None
    return _Values(flat, counts)


def _arrow_chunks(dataset: Any, keys: list[str], value_keys: list[str]) -> Iterator[tuple[dict, dict]]:
    import pyarrow.compute as pc

    for table in dataset.select_columns(keys).with_format("arrow").iter(batch_size=50_000):
        lengths = {key: pc.list_value_length(table.column(key)).fill_null(-1).to_numpy(zero_copy_only=False)
                   for key in keys}
        values = {key: _arrow_values(table.column(key)) for key in value_keys if key in keys}
        yield lengths, {key: found for key, found in values.items() if found is not None}


def _python_values(rows: list[Mapping[str, Any]], key: str) -> _Values | None:
    """:class:`_Values` of ``key`` in Python rows (lists, arrays or tensors); ``None`` when they are not integers."""
    try:
        arrays = [np.asarray(row[key]).reshape(-1) if row.get(key) is not None else np.zeros(0, dtype=np.int64)
                  for row in rows]
    except (TypeError, ValueError, RuntimeError):  # ragged nested lists, a tensor on an accelerator …
        return None
    if any(not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool) for a in arrays if a.size):
        return None
    counts = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    return _Values(np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64), counts)


def _python_chunks(dataset: Sequence[Mapping[str, Any]], keys: list[str],
                   value_keys: list[str]) -> Iterator[tuple[dict, dict]]:
    def length(row: Mapping[str, Any], key: str) -> int:
        value = row.get(key)
        return -1 if value is None else len(value)

    rows = [dataset[i] for i in range(len(dataset))]
    lengths = {key: np.fromiter((length(row, key) for row in rows), dtype=np.int64, count=len(rows)) for key in keys}
    values = {key: _python_values(rows, key) for key in value_keys}
    yield lengths, {key: found for key, found in values.items() if found is not None}


def _chunks(dataset: Any, keys: list[str], value_keys: list[str]) -> Iterator[tuple[dict, dict]] | None:
    """Per chunk of rows: every key's length in every row (``keys[0]`` is the token ids; -1 where a row has none),
    and the values of ``value_keys`` (:class:`_Values`, where they are integers); ``None`` when they cannot be read
    cheaply and exactly."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the train extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        if dataset.format.get("type") == "custom" or keys[0] not in dataset.column_names:
            return None  # a transform builds the features on the fly: the collator checks them
        present = [key for key in keys if key in dataset.column_names]
        return _arrow_chunks(dataset, present, [key for key in value_keys if key in present])
    if isinstance(dataset, Sequence) and 0 < len(dataset) <= MAX_PYTHON_ROWS and isinstance(dataset[0], Mapping):
        return _python_chunks(dataset, keys, value_keys) if keys[0] in dataset[0] else None
    return None


def _column_names(dataset: Any) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is None and isinstance(dataset, Sequence) and len(dataset) and isinstance(dataset[0], Mapping):
        names = list(dataset[0])
    return list(names or [])


def _text_columns(dataset: Any, collator: Any) -> list[tuple[str, str]]:
    """``(token-id column, prefix of its per-token columns)`` for every text of a row: ``input_ids``; the embedding
    collator's ``<column>_input_ids`` texts; the columns a collator names in ``id_columns`` (``chosen_ids`` …)."""
    named = getattr(collator, "id_columns", None)
    if named is not None:
        return [(column, f"{column}_") for column in named]
    columns = getattr(collator, "columns", None)
    if columns is None:
        return [("input_ids", "")]
    columns = columns or [name[: -len("_input_ids")] for name in _column_names(dataset) if name.endswith("_input_ids")]
    prefixes = [f"{column}_" if column else "" for column in columns] or [""]
    return [(f"{prefix}input_ids", prefix) for prefix in prefixes]


@dataclass
class DatasetReport:
    """What :func:`inspect_dataset` found that is not an error: ``rows`` checked (``None``: the dataset cannot be
    checked up front), and the ``unlabelled`` rows, whose every label truncation to ``max_length`` erases
    (``on_overlong: truncate``)."""

    rows: int | None = None
    unlabelled: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def check_dataset(dataset: Any, collator: Any, name: str = "train") -> int | None:
    """Raise :class:`BatchError` for the first problem the collator would find in ``dataset``.

    Returns the number of rows checked, or ``None`` when the dataset cannot be checked up front.
    """
    return inspect_dataset(dataset, collator, name).rows


def inspect_dataset(dataset: Any, collator: Any, name: str = "train") -> DatasetReport:
    """:func:`check_dataset`, also reporting the rows truncation leaves without a label (:class:`DatasetReport`)."""
    _check_media(dataset, collator, name)
    _check_example_labels(dataset, collator, name)
    report = DatasetReport()
    for ids_key, prefix in _text_columns(dataset, collator):
        found = _check_texts(dataset, _packing(collator), ids_key, prefix, name)
        if found is not None:
            report = DatasetReport(found.rows, np.union1d(report.unlabelled, found.unlabelled))
    return report


#: Names a per-example label may have in a row (the task collators read the first present).
LABEL_COLUMNS = ("labels", "label", "score")


def _label_chunks(dataset: Any, key: str) -> Iterator[Any] | None:
    """``key`` of every row, a chunk at a time: Arrow arrays for a ``datasets.Dataset``, one list of Python values for
    a list of rows; ``None`` when not read cheaply."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the train extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        if dataset.format.get("type") == "custom":
            return None
        tables = dataset.select_columns([key]).with_format("arrow").iter(batch_size=50_000)
        return (table.column(key).combine_chunks() for table in tables)
    if isinstance(dataset, Sequence) and 0 < len(dataset) <= MAX_PYTHON_ROWS and isinstance(dataset[0], Mapping):
        return iter([[dataset[i].get(key) for i in range(len(dataset))]])
    return None


def _label_widths_and_classes(chunk: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(widths, classes)`` of a chunk of labels: how many values each list label holds, or the integer labels
    (``None`` for what the chunk does not hold: float scores, say)."""
    if isinstance(chunk, list):
        arrays = [np.asarray(value) for value in chunk]
        if all(a.ndim == 1 for a in arrays):
            return np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays)), None
        if all(a.ndim == 0 and np.issubdtype(a.dtype, np.integer) for a in arrays):
            return None, np.asarray([int(a) for a in arrays], dtype=np.int64)
        return None, None
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
        return pc.list_value_length(chunk).fill_null(-1).to_numpy(zero_copy_only=False), None
    if pa.types.is_integer(chunk.type):
        return None, chunk.fill_null(-100).to_numpy(zero_copy_only=False)
    return None, None


def _check_example_labels(dataset: Any, collator: Any, name: str) -> None:
    """A per-example class label (a collator with ``num_labels``: ``seq_cls``) names one of the model's classes
    (or is -100, ignored); multi-label targets (a list per row) are ``num_labels`` wide."""
    num_labels = int(getattr(collator, "num_labels", 0) or 0)
    key = next((k for k in LABEL_COLUMNS if k in _column_names(dataset)), None)
    chunks = None if num_labels < 1 or getattr(collator, "float_labels", False) or key is None else \
        _label_chunks(dataset, key)
    offset = 0
    for chunk in chunks or ():
        widths, classes = _label_widths_and_classes(chunk)
        if widths is not None:
            bad = np.flatnonzero((widths >= 0) & (widths != num_labels))
            if bad.size:
                row = int(bad[0])
                raise BatchError(
                    f"example {offset + row} of the {name} dataset has {int(widths[row])} multi-label targets in "
                    f"{key!r}, but the model has num_labels={num_labels} ({bad.size} such example(s)): give one target "
                    f"per class, or load the model with num_labels={int(widths[row])}")
        if classes is not None and num_labels >= 2:
            bad = np.flatnonzero(((classes < 0) | (classes >= num_labels)) & (classes != -100))
            if bad.size:
                row = int(bad[0])
                raise BatchError(
                    f"example {offset + row} of the {name} dataset has label {int(classes[row])} ({key!r}), but the "
                    f"model has num_labels={num_labels} (classes 0 to {num_labels - 1}; -100 is ignored; {bad.size} "
                    "such example(s)): load the model with num_labels set to the number of classes, or fix the label")
        offset += len(chunk)


def _media_columns(dataset: Any) -> list[str]:
    """The :data:`MEDIA_KEYS` columns of ``dataset`` that hold a value in some row (``[]`` when not read cheaply)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the train extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        keys = [key for key in MEDIA_KEYS if key in dataset.column_names]
        if not keys or dataset.format.get("type") == "custom":
            return []
        tables = dataset.select_columns(keys).with_format("arrow").iter(batch_size=50_000)
        found = {key for table in tables for key in keys if table.column(key).null_count < table.num_rows}
        return [key for key in keys if key in found]
    if isinstance(dataset, Sequence) and 0 < len(dataset) <= MAX_PYTHON_ROWS and isinstance(dataset[0], Mapping):
        rows = [dataset[i] for i in range(len(dataset))]
        return [key for key in MEDIA_KEYS if any(row.get(key) is not None for row in rows)]
    return []


def _check_media(dataset: Any, collator: Any, name: str) -> None:
    """Images or video for a collator that packs text only (one without a vision-language family's
    ``media_keys``): the trainer would drop the columns (``remove_unused_columns``) or the collator refuse them."""
    if getattr(collator, "media_keys", None) is not None:
        return  # a vision-language family's collator packs them, checking each example against its tokens
    found = _media_columns(dataset)
    if found:
        raise BatchError(
            f"the {name} dataset holds {', '.join(map(repr, found))} (images or video), but this model's plugin packs "
            "text only: the trainer would drop these columns or the packed batch lose them, and the model train on "
            "the image tokens without their pixels. Vision-language families are packed by their own plugins "
            "(padfree-plugins list: qwen2_vl, qwen2_5_vl …); for a text-only model, remove the media columns (and "
            "the image tokens) from the dataset")


def _check_texts(dataset: Any, packing: Any, ids_key: str, prefix: str, name: str) -> DatasetReport | None:
    """:func:`check_dataset` for the texts of one column (``ids_key``; ``prefix`` + ``labels`` … per token): lengths,
    token ids the model's embeddings have, labels its LM head has, positions as the collator builds them, and (for
    ``input_ids``) masks without zeros; the rows whose labels truncation erases."""
    token_keys = [key for key in getattr(packing, "token_keys", ()) if key != "input_ids"]
    plain = ids_key == "input_ids"  # only the plain texts' own masks and positions reach the collator
    label_key = prefix + "labels" if "labels" in token_keys else None
    extra = [MASK_KEY, *BUILT_POSITION_KEYS] if plain else []
    token_keys += extra
    packed = plain and PACKED_LENGTHS_KEY in _column_names(dataset)  # rows of several examples (TRL packing=True)
    packed_keys = [PACKED_LENGTHS_KEY] if packed else []
    value_keys = [ids_key, *extra, *([label_key] if label_key else []), *packed_keys]
    batches = _chunks(dataset, [ids_key, *(prefix + key for key in dict.fromkeys(token_keys)), *packed_keys],
                      value_keys)
    if batches is None:
        return None
    max_length = getattr(packing, "max_length", None)
    truncates = getattr(packing, "on_overlong", "error") == "truncate" and max_length is not None
    limit = None if truncates else max_length
    offset, unlabelled = 0, []
    where = f" of the {name} dataset" + (f" ({ids_key})" if ids_key != "input_ids" else "")
    for lengths, values in batches:
        ids = lengths[ids_key]
        empty = np.flatnonzero(ids <= 0)
        if empty.size:
            raise BatchError(f"example {offset + int(empty[0])}{where} has no tokens ({empty.size} such example(s) "
                             "in this chunk); filter empty examples out of the dataset")
        if limit is not None and packed and PACKED_LENGTHS_KEY in values:
            _check_packed_lengths(values[PACKED_LENGTHS_KEY], packing, limit, offset, where)
        elif limit is not None:
            over = np.flatnonzero(ids > limit)
            if over.size:
                row = int(over[0])
                message = (packing.overlong_message(offset + row, int(ids[row]), where)
                           if hasattr(packing, "overlong_message") else
                           f"example {offset + row}{where} has {int(ids[row])} tokens, more than max_length={limit}")
                raise BatchError(f"{message} ({over.size} example(s) too long in this chunk)")
        for key in dict.fromkeys(token_keys):
            if prefix + key not in lengths:
                continue
            present = lengths[prefix + key] >= 0
            bad = np.flatnonzero(present & (lengths[prefix + key] != ids))
            if bad.size:
                row = int(bad[0])
                raise BatchError(
                    f"example {offset + row}{where}: {prefix + key!r} has {int(lengths[prefix + key][row])} values "
                    f"but {ids_key} has {int(ids[row])} tokens ({bad.size} such example(s)); they must be the same "
                    "length" + (" — give -100 for tokens without a label" if key == "labels" else "")
                )
        if ids_key in values:
            _check_token_ids(values[ids_key], getattr(packing, "vocab_size", None), offset, where)
        if plain and MASK_KEY in values:
            _check_unpadded(values[MASK_KEY], offset, where)
        for key, start in BUILT_POSITION_KEYS.items():
            if plain and key in values:
                _check_positions(values[key], key, getattr(packing, "position_start", 0) if start is None else start,
                                 offset, where)
        if label_key in values:
            ignore = getattr(packing, "ignore_index", -100)
            _check_label_ids(values[label_key], getattr(packing, "vocab_size", None), ignore, offset, where)
            if truncates and (ids > max_length).any():
                first = 1 if "labels" in getattr(packing, "masked_first_keys", ()) else 0
                erased = _erased_by_truncation(values[label_key], ids, max_length, first, ignore)
                unlabelled.append(offset + erased)
        offset += ids.size
    return DatasetReport(offset, np.concatenate(unlabelled) if unlabelled else np.zeros(0, dtype=np.int64))


def _flat_numpy(values: _Values) -> np.ndarray:
    return values.flat if isinstance(values.flat, np.ndarray) else values.flat.to_numpy(zero_copy_only=False)


def _erased_by_truncation(labels: _Values, ids: np.ndarray, max_length: int, first: int, ignore: int) -> np.ndarray:
    """The rows (of this chunk) longer than ``max_length`` with no label among their first ``max_length`` tokens
    (the first token's not counted when ``first`` is 1: the collator masks it)."""
    flat = _flat_numpy(labels)
    owners = np.repeat(np.arange(labels.counts.size), labels.counts)
    position = np.arange(flat.size) - np.repeat(np.cumsum(labels.counts) - labels.counts, labels.counts)
    kept = (flat != ignore) & (position >= first) & (position < max_length)
    labelled = np.bincount(owners[kept], minlength=labels.counts.size) > 0
    return np.flatnonzero((ids > max_length) & (labels.counts > 0) & ~labelled)


def _check_label_ids(values: _Values, vocab_size: int | None, ignore: int, offset: int, where: str) -> None:
    """Refuse per-token labels other than ``ignore`` below 0 or at or above ``vocab_size``."""
    bounds = values.bounds()
    if bounds is None or bounds[0] >= 0 and (vocab_size is None or bounds[1] < vocab_size):
        return

    def bad(labels: np.ndarray) -> np.ndarray:
        outside = (labels < 0) if vocab_size is None else (labels < 0) | (labels >= vocab_size)
        return outside & (labels != ignore)

    if not bad(_flat_numpy(values)).any():
        return
    row, label, count = values.first(bad)
    raise BatchError(f"{label_outside_vocabulary_message(f'example {offset + row}{where}', label, vocab_size, ignore)}"
                     f" ({count} such example(s) in this chunk)")


def _check_positions(values: _Values, key: str, start: int, offset: int, where: str) -> None:
    """Refuse ``position_ids`` / ``cache_position`` other than the collator's own: ``start, start + 1, …`` per row."""
    flat = _flat_numpy(values)
    expected = np.arange(flat.size) - np.repeat(np.cumsum(values.counts) - values.counts, values.counts) + start
    wrong = np.flatnonzero(flat != expected)
    if not wrong.size:
        return
    rows = np.searchsorted(np.cumsum(values.counts), wrong, side="right")
    row = int(rows[0])
    token = int(wrong[0] - (np.cumsum(values.counts)[row] - values.counts[row]))
    raise BatchError(f"{positions_message(f'example {offset + row}{where}', key, start, token, int(flat[wrong[0]]))}"
                     f" ({np.unique(rows).size} such example(s) in this chunk)")


def _check_packed_lengths(lengths: _Values, packing: Any, limit: int, offset: int, where: str) -> None:
    """Rows that hold several examples (TRL's ``packing=True``, a ``seq_lengths`` column): each example counted by its
    own length (the collator splits the rows first), the first one longer than ``limit`` refused."""
    bounds = lengths.bounds()
    if bounds is None or bounds[1] <= limit:
        return
    row, length, count = lengths.first(lambda n: n > limit)
    starts = np.concatenate([[0], np.cumsum(lengths.counts)])
    flat = lengths.flat if isinstance(lengths.flat, np.ndarray) else lengths.flat.to_numpy(zero_copy_only=False)
    index = f"{int(np.flatnonzero(flat[starts[row]:starts[row + 1]] > limit)[0])} of row {offset + row}"
    where = f"{where} (its rows hold several examples: {PACKED_LENGTHS_KEY})"
    message = (packing.overlong_message(index, length, where) if hasattr(packing, "overlong_message") else
               f"example {index}{where} has {length} tokens, more than max_length={limit}")
    raise BatchError(f"{message} ({count} row(s) with an example too long in this chunk)")


def _check_token_ids(values: _Values, vocab_size: int | None, offset: int, where: str) -> None:
    """Refuse token ids below 0 or at or above ``vocab_size`` (the rows of the model's input embeddings)."""
    bounds = values.bounds()
    if bounds is None or bounds[0] >= 0 and (vocab_size is None or bounds[1] < vocab_size):
        return
    row, token, count = values.first(lambda ids: (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size))
    raise BatchError(f"{outside_vocabulary_message(f'example {offset + row}{where}', token, vocab_size)} ({count} "
                     "such example(s) in this chunk)")


def _check_unpadded(values: _Values, offset: int, where: str) -> None:
    """Refuse an ``attention_mask`` with zeros: the collator packs unpadded examples."""
    bounds = values.bounds()
    if bounds is None or bounds[0] > 0 or bounds[1] < 0:
        return
    row, _, count = values.first(lambda mask: mask == 0)
    raise BatchError(f"{padded_message(f'example {offset + row}{where}')} ({count} such example(s) in this chunk)")
