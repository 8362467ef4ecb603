"""The packed-batch contract: what a padding-free collator produces and every later stage reads.

A batch of ``n`` examples of lengths ``L_1 … L_n`` (``T = sum L_i``) is one row::

    input_ids       int64 [1, T]     tokens of all examples, back to back, no padding
    position_ids    int64 [1, T]     restart at ``position_start`` for every example (2 for RoBERTa-family)
    cu_seq_lens_q   int32 [n + 1]    example boundaries: 0, L_1, L_1 + L_2, …, T
    cu_seq_lens_k   int32 [n + 1]    the same tensor (self-attention)
    max_length_q    int              max L_i, a python int so kernels need no GPU->CPU sync
    max_length_k    int              the same
    seq_idx         int32 [1, T]     example index of every token
    <token keys>    [1, T]           e.g. labels, token_type_ids — concatenated like input_ids
    <example keys>  [n] or [n, k]    e.g. a class label, a group id — one row per example

The boundaries are computed once, in the collator; nothing downstream re-derives them from ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: The keys that carry the boundaries into attention (``**kwargs`` of transformers models).
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: What a patched model is called with on every packed batch: the tokens, their positions and the boundaries.
MODEL_INPUT_KEYS = ("input_ids", "position_ids", *BOUNDARY_KEYS)


def packed_tokens(batch: Mapping) -> int | None:
    """``T``, the number of tokens of a packed batch, read from tensor shapes (no device sync); ``None`` if unknown."""
    for key in ("input_ids", "seq_idx", "position_ids"):
        if key in batch:
            return int(batch[key].shape[-1])
    return None


def token_examples(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """The example of every one of the ``total`` packed tokens (int64 ``[T]``, on ``cu_seq_lens``' device), from
    the boundaries ``0, L1, …, T``; sizes come from ``total``, so nothing is read back from the device."""
    lengths = cu_seq_lens.diff().long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seq_lens.device), lengths,
                                   output_size=total)


def restarts(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The boundaries ``0, L1, …, T`` (int64, on the host) of a row ``[1, T]`` whose position ids restart at every
    example, or ``None`` for a padded batch, a single example or no position ids.

    Only for models whose layers are handed nothing but what their embeddings get (MPNet, DeBERTa-v2: the
    boundaries cannot reach their attention, and sentence-transformers calls their forward past the hooks); the
    model's guard checks that the restarts are exactly ``cu_seq_lens_q``. One read from the device per forward.
    """
    if position_ids is None or position_ids.ndim != 2 or position_ids.shape[0] != 1:
        return None
    found = (position_ids[0, 1:] != position_ids[0, :-1] + 1).nonzero().flatten().cpu()
    if not len(found):
        return None
    return torch.cat([torch.zeros(1, dtype=torch.long), found + 1, torch.tensor([position_ids.shape[1]])])


def length_groups(cu_seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """A packed row's tokens grouped by example length, for code that runs the examples of equal length together.

    Returns ``order`` (int64 ``[T]``, on the host): the token indices with the examples sorted by length (stably),
    so that each length's examples are one contiguous block, viewable as ``[count, length, …]``; ``inverse``, which
    puts them back (``x[order][inverse] == x``); and each block's ``(length, count)``, shortest first. The
    boundaries are read on the host (one copy from an accelerator).
    """
    cu = cu_seq_lens.long().cpu()
    lengths = cu.diff()
    by_length = torch.sort(lengths, stable=True).indices
    sorted_lengths = lengths[by_length]
    total = int(sorted_lengths.sum())
    moved = cu[:-1][by_length] - (torch.cumsum(sorted_lengths, 0) - sorted_lengths)
    order = torch.repeat_interleave(moved, sorted_lengths, output_size=total) + torch.arange(total)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total)
    group_lengths, counts = torch.unique_consecutive(sorted_lengths, return_counts=True)
    return order, inverse, list(zip(group_lengths.tolist(), counts.tolist()))


class PackedBatch(dict):
    """A ``dict`` of tensors (and two ints) following the contract above.

    It stays a plain ``dict`` for ``Trainer`` (which rebuilds it with ``type(batch)(...)`` when moving it to a
    device) and for pickling; the properties only read it.
    """

    @property
    def num_examples(self) -> int:
        return int(self["cu_seq_lens_q"].numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self["input_ids"].shape[-1])

    @property
    def lengths(self) -> torch.Tensor:
        """Example lengths, int64 ``[n]``."""
        return self["cu_seq_lens_q"].diff().long()

    def model_inputs(self, *extra: str) -> dict:
        """``input_ids``, ``position_ids`` and the boundaries, plus the named ``extra`` keys that are present."""
        return {key: self[key] for key in (*MODEL_INPUT_KEYS, *extra) if key in self}

    def to(self, device: torch.device | str) -> "PackedBatch":
        """A copy with every tensor on ``device``."""
        return PackedBatch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})
