"""What the plugins of this package read from a packed row when a layer is handed nothing but its tensors.

Token-level computations that depend on the whole example (ESM-2's token dropout counts an example's masks, X-MOD's
language adapters need every token's language) find the examples where the position ids restart — the one input
every call path hands the embeddings and the base model, sentence-transformers' direct forward included; the guard
checks that these restarts are exactly ``cu_seq_lens_q``. Everything stays on the device: no read back to the host.
"""

from __future__ import annotations

import torch


def example_of_token(position_ids: torch.Tensor) -> torch.Tensor:
    """The example index of every token of a row ``[1, T]`` whose position ids restart at every example (int64
    ``[T]``, on their device)."""
    positions = position_ids[0]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    return starts.long().cumsum(0) - 1


def is_packed_row(position_ids, *tensors) -> bool:
    """Whether a call without a mask is one row ``[1, T]`` with its position ids (a packed row, or one example with
    explicit positions: both are computed per example)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or position_ids.shape[0] != 1:
        return False
    return all(t is None or tuple(t.shape[:2]) == tuple(position_ids.shape) for t in tensors)
