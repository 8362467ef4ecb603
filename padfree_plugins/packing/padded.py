"""The padded reference: examples as an ordinary ``[n, L_max]`` batch with an ``attention_mask``.

Padding-free outputs are checked against it (tests) and timed against it (benchmarks, demo).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

#: Fill values by key; other keys are filled with 0.
DEFAULT_FILL = {"labels": -100}


def pad_examples(examples: Sequence[Mapping[str, Any]], keys: Sequence[str] = ("input_ids",), *,
                 pad_token_id: int = 0, side: Literal["right", "left"] = "right",
                 fill: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """``keys`` of every example padded to the longest ``input_ids`` (int64 ``[n, L_max]``), plus
    ``attention_mask``. ``input_ids`` are filled with ``pad_token_id``, ``labels`` with -100, others with 0 (or
    as ``fill`` says). A key missing from ``examples`` but named ``labels`` is copied from ``input_ids``."""
    fills = {**DEFAULT_FILL, "input_ids": pad_token_id, **(fill or {})}
    lengths = [len(ex["input_ids"]) for ex in examples]
    longest = max(lengths)
    batch = {}
    for key in keys:
        values = torch.full((len(examples), longest), fills.get(key, 0), dtype=torch.long)
        for i, (ex, n) in enumerate(zip(examples, lengths)):
            row = ex[key] if key in ex or key != "labels" else ex["input_ids"]
            columns = slice(0, n) if side == "right" else slice(longest - n, longest)
            values[i, columns] = torch.as_tensor(row, dtype=torch.long)
        batch[key] = values
    positions = torch.arange(longest)[None]
    counts = torch.tensor(lengths)[:, None]
    real = positions < counts if side == "right" else positions >= longest - counts
    batch["attention_mask"] = real.long()
    return batch
