"""Ulysses sequence parallelism for packed attention: each rank holds a contiguous slice of a packed row; an
all-to-all turns ``[T/N tokens, all heads]`` into ``[all T tokens, H/N heads]``, the backend attends over the whole
row inside every example (the boundaries are global), and a second all-to-all turns the output back.

* :class:`SequenceGroup` — the ranks that share a row (a ``torch.distributed`` group, this rank's place in it);
* :func:`sequence_to_heads` / :func:`heads_to_sequence` — the two all-to-alls, differentiable (the backward of
  each is the other's exchange), on any backend that has ``all_to_all_single`` (gloo, NCCL);
* :func:`gather_sequence` — the whole row on every rank (differentiable: the backward sums every rank's gradient
  of a slice into its owner, by an all-to-all), for the sequence mixers, which run the whole row;
* :class:`UlyssesAttention` — a registered padding-free attention function run on the whole row: key / value
  heads replicated when the group is larger than their number, attention sinks sliced to the rank's heads.

A rank that attended to its slice alone, or a mixer that scanned it alone, would be silently wrong: the tests
of ``tests/test_sequence_parallel.py`` show each would fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from padfree_plugins.errors import BoundaryError


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks that train one packed row together: ``group`` (``None``: the default group), this rank's
    ``rank`` in it and its ``size``."""

    group: Any
    rank: int
    size: int

    def slice_of(self, total: int) -> slice:
        """This rank's tokens of a (padded) row of ``total`` tokens."""
        local = total // self.size
        return slice(self.rank * local, (self.rank + 1) * local)


def _all_to_all(chunks: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``chunks`` ``[N, ...]``: chunk ``j`` sent to rank ``j``; returns ``[N, ...]``, chunk ``i`` from rank ``i``."""
    chunks = chunks.contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group.group)
    return received


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sequence_to_heads(grad, ctx.group), None


def _sequence_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``[1, H, T/N, D]`` (this rank's tokens, every head) -> ``[1, H/N, T, D]`` (every token, this rank's heads)."""
    _, heads, local, dim = x.shape
    n = group.size
    received = _all_to_all(x[0].reshape(n, heads // n, local, dim), group)  # [source rank, H/N, T/N, D]
    return received.transpose(0, 1).reshape(1, heads // n, n * local, dim)


def _heads_to_sequence(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``[1, H/N, T, D]`` -> ``[1, H, T/N, D]``: the inverse of :func:`_sequence_to_heads`."""
    _, heads, total, dim = x.shape
    n = group.size
    chunks = x[0].reshape(heads, n, total // n, dim).transpose(0, 1)  # [destination rank, H/N, T/N, D]
    return _all_to_all(chunks, group).reshape(1, heads * n, total // n, dim)


def sequence_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``[1, H, T/N, D]`` -> ``[1, H/N, T, D]``, differentiable; ``H`` must be a multiple of ``N``."""
    if x.shape[1] % group.size:
        raise BoundaryError(f"{x.shape[1]} heads cannot be split over a sequence-parallel group of {group.size}")
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``[1, H/N, T, D]`` -> ``[1, H, T/N, D]``, differentiable."""
    return _HeadsToSequence.apply(x, group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(group.size)]
        dist.all_gather(pieces, x.contiguous(), group=group.group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        chunks = torch.stack(grad.chunk(group.size, dim=1))  # [owner rank, 1, T/N, ...]
        return _all_to_all(chunks, group).sum(0), None


def gather_sequence(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """Every rank's slice ``[1, T/N, ...]`` joined into the whole row ``[1, T, ...]`` on every rank; the gradient
    of the whole row flows back summed over the ranks into each slice's owner."""
    return _GatherSequence.apply(x, group)


def kv_repeats(query_heads: int, kv_heads: int, size: int) -> int:
    """How many times each key / value head is repeated so that the group splits them evenly and every rank's query
    heads keep their own key / value head: 1 when ``size`` divides ``kv_heads``."""
    repeat = size // math.gcd(kv_heads, size)
    if (query_heads // kv_heads) % repeat:
        repeat = query_heads // kv_heads  # every query head its own copy
    return repeat


@dataclass
class UlyssesAttention:
    """A padding-free attention function (``inner``, one :class:`~padfree_plugins.modeling.attention.
    PadfreeAttention`) run on the whole packed row of a sequence-parallel group: packed calls get this rank's slice
    of the tokens with every head and exchange them for every token with ``H/N`` heads; ordinary calls (padded,
    ``generate()``) go to ``inner`` unchanged. ``row_size``: the ranks whose slices make the row the boundaries
    describe (``None``: the group's; more when the group is one block of a larger row, whose ``inner`` then gathers
    the other blocks' keys: :mod:`~padfree_plugins.modeling.attention.context_parallel`)."""

    inner: Any
    group: SequenceGroup
    row_size: int | None = None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens is None:
            return self.inner(module, query, key, value, attention_mask, **kwargs)
        group, heads = self.group, query.shape[1]
        if heads % group.size:
            raise BoundaryError(f"{type(module).__name__} has {heads} attention heads, which a sequence-parallel group "
                                f"of {group.size} cannot split; use a size that divides {heads}, or "
                                "sequence_parallel.attention: auto or allgather")
        ranks = self.row_size or group.size
        if cu_seq_lens.device.type == "cpu" and query.shape[2] * ranks != int(cu_seq_lens[-1]):  # no sync
            raise BoundaryError(
                f"{type(module).__name__}: {query.shape[2]} local tokens x {ranks} ranks, but the boundaries "
                f"describe {int(cu_seq_lens[-1])} tokens: a sequence-parallel forward takes each rank's slice of the "
                "group's row (assembly.forward slices it)")
        repeat = kv_repeats(heads, key.shape[1], group.size)
        if repeat > 1:
            key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
        for name in ("s_aux", "sinks"):
            sinks = kwargs.get(name)
            if sinks is not None:
                share = sinks.shape[0] // group.size
                kwargs[name] = sinks[group.rank * share:(group.rank + 1) * share]
        blocks = kwargs.get("block_sequence_ids")
        if blocks is not None and blocks.shape[-1] != query.shape[2] * ranks:
            raise BoundaryError(f"{type(module).__name__}: bidirectional blocks (image tokens) of {blocks.shape[-1]} "
                                f"tokens for a row of {query.shape[2] * ranks}: under sequence parallelism they "
                                "describe the group's whole row, which every rank holds for its heads")
        query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
        out, _ = self.inner(module, query, key, value, attention_mask, **kwargs)  # [1, T, H/N, D]
        return heads_to_sequence(out.transpose(1, 2), group).transpose(1, 2), None
