"""Check a whole dataset against a packing collator before training starts.

The collator refuses bad examples anyway, but only when a batch reaches it, possibly hours into a run. This
check finds the same problems up front: empty examples, examples longer than the collator accepts (the model's
``max_position_embeddings`` or the config's ``max_length``), and per-token keys (``labels``) whose length differs
from ``input_ids``. It reads lengths only: a vectorised pass over Arrow columns for a ``datasets.Dataset``, a
Python pass for an in-memory list; streaming datasets and on-the-fly transforms are left to the collator.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import BatchError

#: Plain Python datasets longer than this are left to the collator (a Python pass would take too long).
MAX_PYTHON_ROWS = 200_000


def _packing(collator: Any) -> Any:
    return getattr(collator, "packing", collator)


def _arrow_lengths(dataset: Any, keys: list[str]) -> Iterator[dict[str, np.ndarray]]:
    import pyarrow.compute as pc

    for table in dataset.select_columns(keys).with_format("arrow").iter(batch_size=50_000):
        yield {key: pc.list_value_length(table.column(key)).fill_null(-1).to_numpy(zero_copy_only=False)
               for key in keys}


def _python_lengths(dataset: Sequence[Mapping[str, Any]], keys: list[str]) -> Iterator[dict[str, np.ndarray]]:
    def length(row: Mapping[str, Any], key: str) -> int:
        value = row.get(key)
        return -1 if value is None else len(value)

    rows = [dataset[i] for i in range(len(dataset))]
    yield {key: np.fromiter((length(row, key) for row in rows), dtype=np.int64, count=len(rows)) for key in keys}


def _length_batches(dataset: Any, keys: list[str]) -> Iterator[dict[str, np.ndarray]] | None:
    """Per-key lengths of every row, in chunks; ``None`` when they cannot be read cheaply and exactly."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the train extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        if dataset.format.get("type") == "custom" or "input_ids" not in dataset.column_names:
            return None  # a transform builds the features on the fly: the collator checks them
        return _arrow_lengths(dataset, [key for key in keys if key in dataset.column_names])
    if isinstance(dataset, Sequence) and 0 < len(dataset) <= MAX_PYTHON_ROWS and isinstance(dataset[0], Mapping):
        return _python_lengths(dataset, keys) if "input_ids" in dataset[0] else None
    return None


def check_dataset(dataset: Any, collator: Any, name: str = "train") -> int | None:
    """Raise :class:`BatchError` for the first problem the collator would find in ``dataset``.

    Returns the number of rows checked, or ``None`` when the dataset cannot be checked up front.
    """
    packing = _packing(collator)
    token_keys = [key for key in getattr(packing, "token_keys", ()) if key != "input_ids"]
    batches = _length_batches(dataset, ["input_ids", *token_keys])
    if batches is None:
        return None
    limit = getattr(collator, "max_length", None) if getattr(collator, "on_overlong", "error") == "error" else None
    offset = 0
    where = f" of the {name} dataset"
    for lengths in batches:
        ids = lengths["input_ids"]
        empty = np.flatnonzero(ids <= 0)
        if empty.size:
            raise BatchError(f"example {offset + int(empty[0])}{where} has no tokens ({empty.size} such example(s) "
                             "in this chunk); filter empty examples out of the dataset")
        if limit is not None:
            over = np.flatnonzero(ids > limit)
            if over.size:
                row = int(over[0])
                message = (packing.overlong_message(offset + row, int(ids[row]), where)
                           if hasattr(packing, "overlong_message") else
                           f"example {offset + row}{where} has {int(ids[row])} tokens, more than max_length={limit}")
                raise BatchError(f"{message} ({over.size} example(s) too long in this chunk)")
        for key in token_keys:
            if key not in lengths:
                continue
            present = lengths[key] >= 0
            bad = np.flatnonzero(present & (lengths[key] != ids))
            if bad.size:
                row = int(bad[0])
                raise BatchError(
                    f"example {offset + row}{where}: {key!r} has {int(lengths[key][row])} values but input_ids has "
                    f"{int(ids[row])} tokens ({bad.size} such example(s)); they must be the same length — give "
                    f"-100 for tokens without a label"
                )
        offset += ids.size
    return offset
