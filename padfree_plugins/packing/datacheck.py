"""Check a whole dataset against a packing collator before training starts.

The collator refuses bad examples anyway, but only when a batch reaches it, possibly hours into a run. This
check finds the same problems up front: empty examples, examples longer than the collator accepts (the model's
``max_position_embeddings`` or the config's ``max_length``; in rows of several examples, TRL's ``packing=True``
with a ``seq_lengths`` column, each example by its own length), and per-token keys (``labels``) whose length differs
from ``input_ids`` — for the embedding task, in every ``<column>_input_ids`` column — token ids below 0 or not in
the model's input embeddings (the collator's ``vocab_size``), an ``attention_mask`` with zeros (a padded example),
and images or video (the :data:`~padfree_plugins.packing.batch.MEDIA_KEYS` columns) for a model whose plugin packs
text only: a trainer's column removal would drop them silently, their placeholder tokens left in the text. Every
error names the example by its index in the dataset. It reads lengths and the least and greatest value of each
column's chunk: a vectorised pass over Arrow columns for a ``datasets.Dataset`` (the values are copied out only to
find a bad row), a Python pass for an in-memory list; streaming
datasets, on-the-fly transforms and rows without ``input_ids`` (TRL's vision rows: messages and images, processed
at collate time) are left to the collator.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree_plugins.errors import BatchError
from padfree_plugins.packing.batch import MEDIA_KEYS
from padfree_plugins.packing.collator import outside_vocabulary_message, padded_message

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


def check_dataset(dataset: Any, collator: Any, name: str = "train") -> int | None:
    """Raise :class:`BatchError` for the first problem the collator would find in ``dataset``.

    Returns the number of rows checked, or ``None`` when the dataset cannot be checked up front.
    """
    _check_media(dataset, collator, name)
    checked = None
    for ids_key, prefix in _text_columns(dataset, collator):
        rows = _check_texts(dataset, _packing(collator), ids_key, prefix, name)
        checked = rows if rows is not None else checked
    return checked


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


def _check_texts(dataset: Any, packing: Any, ids_key: str, prefix: str, name: str) -> int | None:
    """:func:`check_dataset` for the texts of one column (``ids_key``; ``prefix`` + ``labels`` … per token): lengths,
    token ids the model's embeddings have, and (for ``input_ids``) masks without zeros."""
    token_keys = [key for key in getattr(packing, "token_keys", ()) if key != "input_ids"]
    mask_key = MASK_KEY if ids_key == "input_ids" else None  # only the plain texts' own masks reach the collator
    token_keys += [MASK_KEY] if mask_key else []
    value_keys = [ids_key, mask_key] if mask_key else [ids_key]
    packed = ids_key == "input_ids" and PACKED_LENGTHS_KEY in _column_names(dataset)  # rows of several examples
    extra = [PACKED_LENGTHS_KEY] if packed else []
    batches = _chunks(dataset, [ids_key, *(prefix + key for key in token_keys), *extra], value_keys + extra)
    if batches is None:
        return None
    limit = getattr(packing, "max_length", None) if getattr(packing, "on_overlong", "error") == "error" else None
    offset = 0
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
        for key in token_keys:
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
        if mask_key in values:
            _check_unpadded(values[mask_key], offset, where)
        offset += ids.size
    return offset


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
