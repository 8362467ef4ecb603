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
* :func:`choose_scheme` — which scheme a group runs (``sequence_parallel.attention``), and why.

A rank that attended to its own slice's keys alone, or whose queries were placed one token off, would be silently
wrong: the faults of :mod:`padfree_plugins.testing.faults` show the tests catch both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.errors import BoundaryError
from padfree_plugins.modeling.attention import BLOCKS_KWARG, GATHERED_KEYS
from padfree_plugins.modeling.attention.ulysses import SequenceGroup, gather_sequence
from padfree_plugins.packing.batch import SHARED_PREFIXES_KEY
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_FEATURE

#: ``sequence_parallel.attention`` values: ``auto`` runs Ulysses where the group divides the attention heads, else
#: all-gather.
SCHEMES = ("auto", "ulysses", "allgather")
#: The backend feature all-gather needs: queries aligned to the end of their keys within an example (the backends
#: that take shared prefixes have it: ``exact``, ``flash_attn``).
ALIGNED_FEATURE = SHARED_PREFIXES_FEATURE


def choose_scheme(requested: str, heads: int | None, size: int) -> tuple[str, str | None]:
    """The scheme a group of ``size`` ranks runs for a model of ``heads`` attention heads, and, when ``auto`` chose
    all-gather, the note that says why (``None`` otherwise). A forced ``ulysses`` is returned as asked: the caller
    refuses heads it cannot split."""
    if requested != "auto":
        return requested, None
    if not isinstance(heads, int) or heads % size == 0:
        return "ulysses", None
    return "allgather", (
        f"sequence_parallel.size: {size} does not divide the {heads} attention heads, so Ulysses (which gives each "
        f"rank heads/size of them) cannot run: attention runs all-gather context parallelism instead (each rank "
        "gathers the row's keys and values and attends its own slice of queries to them; exact, costs the row's "
        "keys and values on every rank). Set sequence_parallel.attention: allgather to choose it explicitly")


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
        for unsupported, what in ((BLOCKS_KWARG, "bidirectional blocks (image tokens)"),
                                  (SHARED_PREFIXES_KEY, "shared prefixes")):
            if kwargs.get(unsupported) is not None:
                raise NotImplementedError(f"{name}: {what} are not supported under all-gather sequence parallelism")
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
        (causal: those up to the slice's end only, the later ones never seen)."""
        local = query.shape[2]
        start = self.group.rank * local
        cu_q, cu_k, keys = slice_boundaries(kwargs["cu_seq_lens_q"], start, local, causal)
        if keys is not None:
            key, value = key[:, :, :keys], value[:, :, :keys]
        longest = kwargs.get("max_length_q")
        kwargs.update(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, **{GATHERED_KEYS: True})
        if longest is not None:
            kwargs.update(max_length_q=min(int(longest), local), max_length_k=kwargs.get("max_length_k", longest))
        return self.inner(module, query, key, value, attention_mask, **kwargs)
