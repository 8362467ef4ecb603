"""A ``datasets.Dataset`` whose rows, as a ``DataLoader`` fetches them, carry their index in the dataset
(:data:`~padfree_plugins.packing.batch.INDEX_KEY`), so that the collator's errors name the example by it. Imported
only for a ``datasets.Dataset`` (``datasets`` is an optional dependency); see
:func:`padfree_plugins.batching.sampler.indexed_rows`."""

from __future__ import annotations

import copy
from typing import Any

import datasets
import numpy as np

from padfree_plugins.packing.batch import INDEX_KEY


class IndexedDataset(datasets.Dataset):
    """A ``datasets.Dataset`` (so trainers still remove its unused columns and read its length column) whose rows
    read by integer index carry that index. The same Arrow tables, nothing copied; a ``DataLoader`` only sees it."""

    @classmethod
    def of(cls, dataset: datasets.Dataset) -> IndexedDataset:
        view = copy.copy(dataset)  # shares the tables and the format
        view.__class__ = cls
        return view

    def __getitem__(self, key: Any) -> Any:
        row = super().__getitem__(key)
        if isinstance(key, (int, np.integer)) and isinstance(row, dict):
            row[INDEX_KEY] = int(key)
        return row

    def __getitems__(self, keys: list) -> list:
        rows = super().__getitems__(keys)
        for key, row in zip(keys, rows):
            row[INDEX_KEY] = int(key)
        return rows
