"""All-gather context parallelism for packed attention (the scheme Llama 3 trained its long context with): each rank
keeps the queries of its own contiguous slice of the group's row, all-gathers the keys and values of the whole row
(differentiably: the backward sums every rank's key / value gradient into the slice that owns it, a reduce-scatter
built on all-to-all, which gloo has), and attends its queries to the row's keys with the row's boundaries.

Unlike Ulysses (:mod:`~padfree_plugins.modeling.attention.ulysses`), nothing is split by heads, so any group size
works, whatever the number of attention or key / value heads; the price is the row's keys and values on every rank
(``2 x T x H_kv x D`` per layer, small for GQA models, the ones Ulysses cannot split).

* :func:`slice_boundaries` — the boundaries of one rank's queries and of the keys they see, from the row's: a query at
  row position ``p`` of an example sees the keys of its example up to ``p`` (causal; the backend aligns an example's
  queries to the end of its keys), or all of them (bidirectional). Tensor ops only: nothing read on the host;
* :func:`gather_row` — the row's keys or values on every rank, differentiable;
* :class:`AllGatherAttention` — a registered padding-free attention function run this way;
* :func:`ulysses_share` — how many of a group's ranks ``sequence_parallel.attention`` splits by heads (Ulysses),
  the rest by all-gather, and why; :class:`AttentionLayout` — the process groups of that split (USP-style: Ulysses
  within blocks of consecutive ranks, all-gather across the blocks) and the attention function it runs.

A rank that attended to its own slice's keys alone, or whose queries were placed one token off, would be silently
wrong: the faults of :mod:`padfree_plugins.testing.faults` show the tests catch both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from padfree_plugins.errors import BoundaryError
from padfree_plugins.modeling.attention import BLOCKS_KWARG, GATHERED_KEYS
from padfree_plugins.modeling.attention.ulysses import SequenceGroup, UlyssesAttention, gather_sequence
from padfree_plugins.packing.batch import SHARED_PREFIXES_KEY
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_FEATURE

#: The backend feature all-gather needs: queries aligned to the end of their keys within an example (the backends
#: that take shared prefixes have it: ``exact``, ``flash_attn``).
ALIGNED_FEATURE = SHARED_PREFIXES_FEATURE


def ulysses_share(requested: str, heads: int | None, size: int) -> tuple[int, str | None]:
    """How many of a group's ``size`` ranks split a model of ``heads`` attention heads by heads (Ulysses), the other
    factor of ``size`` splitting the row by all-gather: ``size`` for ``ulysses`` (the caller refuses heads it cannot
    split), 1 for ``allgather``; ``auto``: the largest divisor of ``size`` that divides the heads. With the note that
    says why, when ``auto`` chose anything but Ulysses alone (``None`` otherwise)."""
    if requested == "allgather":
        return 1, None
    if requested == "ulysses" or not isinstance(heads, int):
        return size, None
    share = max(n for n in range(1, size + 1) if size % n == 0 and heads % n == 0)
    if share == size:
        return size, None
    why = (f"sequence_parallel.size: {size} does not divide the {heads} attention heads, so Ulysses (which gives "
           "each rank heads/size of them) cannot run alone: ")
    if share == 1:
        return 1, why + (
            "attention runs all-gather context parallelism (each rank gathers the row's keys and values and attends "
            "its own slice of queries to them; exact, costs the row's keys and values on every rank). Set "
            "sequence_parallel.attention: allgather to choose it explicitly")
    return share, why + (
        f"attention runs Ulysses within blocks of {share} consecutive ranks ({heads // share} heads each) and "
        f"all-gather context parallelism across the {size // share} blocks (each gathers the row's keys and values "
        "of its heads; exact). Set sequence_parallel.attention: allgather for all-gather alone")


def slice_boundaries(cu_seq_lens: torch.Tensor, start: int, local: int, causal: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """``(cu_seq_lens_q, cu_seq_lens_k, keys)`` of the queries ``[start, start + local)`` of a row of boundaries
    ``cu_seq_lens`` (the row's) against the row's first ``keys`` keys (``None``: all): example ``i`` has its queries
    of the slice and, causal, its keys up to the slice's end (the example's queries are then aligned to the end of its
    keys, so the query at row position ``p`` sees keys ``<= p``; later keys are never read), bidirectional, all its
    keys. Examples with no query in the slice keep zero queries (the backends skip them)."""
    queries = (cu_seq_lens - start).clamp(0, local)
    if not causal:
        return queries, cu_seq_lens, None
    return queries, cu_seq_lens.clamp(max=start + local), start + local


def gather_row(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """Keys or values ``[1, H, T/N, D]`` of every rank joined into the row's ``[1, H, T, D]``; the backward sums the
    ranks' gradients of each slice into its owner."""
    return gather_sequence(x.transpose(1, 2), group).transpose(1, 2)


@dataclass
class AllGatherAttention:
    """A padding-free attention function (``inner``, one :class:`~padfree_plugins.modeling.attention.
    PadfreeAttention`) run on a sequence-parallel group's row by all-gather: packed calls get this rank's slice of
    the tokens with every head; the keys and values of the row are gathered, the queries of the slice attend to them
    with :func:`slice_boundaries`; ordinary calls (padded, ``generate()``) go to ``inner`` unchanged."""

    inner: Any
    group: SequenceGroup

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens is None:
            return self.inner(module, query, key, value, attention_mask, **kwargs)
        group, local, name = self.group, query.shape[2], type(module).__name__
        if cu_seq_lens.device.type == "cpu" and local * group.size != int(cu_seq_lens[-1]):  # no sync
            raise BoundaryError(
                f"{name}: {local} local tokens x {group.size} ranks, but the boundaries describe "
                f"{int(cu_seq_lens[-1])} tokens: a sequence-parallel forward takes each rank's slice of the group's "
                "row (assembly.forward slices it)")
        if kwargs.get(BLOCKS_KWARG) is not None:
            raise NotImplementedError(f"{name}: bidirectional blocks (image tokens) are not supported under all-gather "
                                      "sequence parallelism")
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", self.inner.default_causal) if causal is None else causal)
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
        if not causal and window is not None:
            raise NotImplementedError(
                f"{name}: a bidirectional sliding window (local attention) under all-gather sequence parallelism; "
                "use sequence_parallel.attention: ulysses with a size that divides the attention heads")
        return self.attend(module, query, gather_row(key, group), gather_row(value, group), attention_mask,
                           causal, **kwargs)

    def attend(self, module, query, key, value, attention_mask, causal: bool, **kwargs):
        """This rank's queries ``[1, H, T/N, D]`` attended to the row's keys and values ``[1, H_kv, T, D]``
        (causal: those up to the slice's end only, the later ones never seen). A row with shared prefixes: each
        segment's queries against its ancestors' keys, then its own up to the slice's end
        (:meth:`~padfree_plugins.packing.prefixes.SharedPrefixes.slice_keys`), wherever in the row they lie."""
        local = query.shape[2]
        start = self.group.rank * local
        cu_q, cu_k, keys = slice_boundaries(kwargs["cu_seq_lens_q"], start, local, causal)
        if keys is not None:
            key, value = key[:, :, :keys], value[:, :, :keys]
        longest = kwargs.get("max_length_q")
        longest_k = kwargs.get("max_length_k", longest)
        shared = kwargs.get(SHARED_PREFIXES_KEY)
        if shared is not None and causal:  # each segment's keys: its ancestors', then its own up to the slice's end
            index, cu_k, longest_k = shared.slice_keys(start, start + local)
            index = index.to(key.device)
            key, value = key.index_select(2, index), value.index_select(2, index)
            cu_k = cu_k.to(cu_q.device)
        kwargs.update(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, **{GATHERED_KEYS: True})
        if longest is not None:
            kwargs.update(max_length_q=min(int(longest), local), max_length_k=longest_k)
        return self.inner(module, query, key, value, attention_mask, **kwargs)


@dataclass(frozen=True)
class AttentionLayout:
    """How a sequence-parallel group's attention sees its row of ``size`` slices: Ulysses within ``ulysses`` (a block
    of consecutive ranks, ``None``: none), all-gather across ``gather`` (the ranks at this rank's place in every
    block, ``None``: none)."""

    size: int
    ulysses: SequenceGroup | None
    gather: SequenceGroup | None

    @classmethod
    def of(cls, group: SequenceGroup, share: int) -> AttentionLayout:
        """The layout of ``group`` with Ulysses over ``share`` ranks (:func:`ulysses_share`). Mixed, it creates the
        blocks' and the places' process groups: every rank of the default group must call it (``new_group`` is
        collective), as assembly does on every rank."""
        size = group.size
        if share == size:
            return cls(size, group, None)
        if share == 1:
            return cls(size, None, group)
        world, rank = dist.get_world_size(), dist.get_rank()
        ulysses = gather = None
        for start in range(0, world, size):  # every sequence-parallel group of the world, in the same order
            for block in range(size // share):
                ranks = list(range(start + block * share, start + (block + 1) * share))
                made = dist.new_group(ranks)
                if rank in ranks:
                    ulysses = SequenceGroup(made, ranks.index(rank), share)
            for place in range(share):
                ranks = list(range(start + place, start + size, share))
                made = dist.new_group(ranks)
                if rank in ranks:
                    gather = SequenceGroup(made, ranks.index(rank), size // share)
        return cls(size, ulysses, gather)

    @property
    def suffix(self) -> str:
        """The attention implementation's name suffix: ``_sp4`` (Ulysses), ``_sp4_allgather``, ``_sp4_ulysses2x2``."""
        if self.gather is None:
            return f"_sp{self.size}"
        if self.ulysses is None:
            return f"_sp{self.size}_allgather"
        return f"_sp{self.size}_ulysses{self.ulysses.size}x{self.gather.size}"

    def wrap(self, function: Any) -> Any:
        """``function`` (a :class:`~padfree_plugins.modeling.attention.PadfreeAttention`) run on the group's row."""
        if self.gather is not None:
            function = AllGatherAttention(function, self.gather)
        if self.ulysses is not None:
            function = UlyssesAttention(function, self.ulysses, row_size=self.size)
        return function
