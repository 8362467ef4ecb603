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
* :class:`Zigzag` — causal work balanced across the ranks (``sequence_parallel.balance``): the row cut into
  ``2N`` chunks (by its boundaries), rank ``r`` attends the queries of chunks ``r`` and
  ``2N-1-r`` (the pairing of ring-flash-attn's zigzag and Llama 3's context parallelism), exchanged by all-to-all
  before the attention and sent back after it, so the rest of the layer keeps its contiguous slices;
  :func:`causal_work` counts the (query, key) pairs of a set of queries;
* :class:`BalancePlan` — a row's balance decision, cuts and this rank's route, made by :func:`plan_balance` (the one
  read of the boundaries on the host) once per forward, before the first layer
  (:class:`~padfree_plugins.modeling.sequence_parallel.PlanBalance`), and handed to every layer in the attention
  kwargs (:data:`~padfree_plugins.modeling.attention.BALANCE_PLAN_KWARG`), so gradient checkpointing's recompute
  reuses it too;
* :func:`ulysses_share` — how many of a group's ranks ``sequence_parallel.attention`` splits by heads (Ulysses),
  the rest by all-gather, and why; :class:`AttentionLayout` — the process groups of that split (USP-style: Ulysses
  within blocks of consecutive ranks, all-gather across the blocks) and the attention function it runs.

A rank that attended to its own slice's keys alone, or whose queries were placed one token off, whose balanced
queries were masked as if they were one contiguous run, or whose outputs went back to the wrong rank, would be
silently wrong: the faults of :mod:`padfree_plugins.testing.faults` show the tests catch each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from padfree_plugins.errors import BoundaryError
from padfree_plugins.modeling.attention import BALANCE_PLAN_KWARG, BLOCKS_KWARG, GATHERED_KEYS
from padfree_plugins.modeling.attention.ulysses import SequenceGroup, UlyssesAttention, gather_sequence
from padfree_plugins.packing.batch import SHARED_PREFIXES_KEY
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_FEATURE

#: ``sequence_parallel.balance: auto`` exchanges a row's queries only where its contiguous slices are this unbalanced:
#: the largest slice's causal work above this many times the ranks' mean.
PAYS_ABOVE = 1.1

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


def balance_choice(requested: str, share: int, size: int) -> tuple[bool, str]:
    """Whether a group of ``size`` ranks with Ulysses over ``share`` of them (:func:`ulysses_share`) balances its
    causal attention work (``sequence_parallel.balance``), and the choice in words. ``auto`` and ``zigzag``: wherever
    attention runs all-gather (``share < size``); Ulysses alone has nothing to balance (every rank attends every
    query of its heads)."""
    if share == size:
        why = ("nothing to balance: attention runs Ulysses alone, every rank attends every query of its heads"
               + (" (sequence_parallel.balance: zigzag has no effect)" if requested == "zigzag" else ""))
        return False, why
    ranks = size // share
    if requested == "off":
        return False, (f"off: each of the {ranks} all-gather ranks attends its own slice's queries (the one holding "
                       "the end of a long example does the most causal work)")
    where = ("" if requested == "zigzag" else f", for rows whose contiguous slices would be unbalanced (the largest "
             f"slice's causal work above {PAYS_ABOVE} x the mean)")
    return True, (f"zigzag over the {ranks} all-gather ranks (sequence_parallel.balance: {requested}): the row cut "
                  f"into {2 * ranks} chunks, rank r attends the queries of chunks r and {2 * ranks - 1}-r{where}")


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


def cumulative_work(cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """``[T + 1]`` (int64, on the host): the (query, key) pairs causal attention computes for the row's first ``p``
    queries, at every ``p``: a query ``i`` tokens into its example sees ``i + 1`` keys. Reads the boundaries on the
    host."""
    bounds = cu_seq_lens.long().cpu()
    total = int(bounds[-1])
    starts = bounds[:-1].repeat_interleave(bounds.diff())
    return torch.cat([torch.zeros(1, dtype=torch.long), (torch.arange(total) - starts + 1).cumsum(0)])


def unbalanced(cu_seq_lens: torch.Tensor, size: int) -> bool:
    """Whether ``size`` contiguous slices of a row of boundaries ``cu_seq_lens`` are unbalanced enough for
    ``balance: auto`` to exchange its queries: the largest slice's causal work above :data:`PAYS_ABOVE` x the mean."""
    return _unbalanced(cumulative_work(cu_seq_lens), size)


def _unbalanced(work: torch.Tensor, size: int) -> bool:
    """:func:`unbalanced` of a row's :func:`cumulative_work`."""
    local = (len(work) - 1) // size
    slices = work[local::local][:size] - work[:-1:local][:size]
    return float(slices.max()) > PAYS_ABOVE * float(work[-1]) / size


def causal_work(cu_seq_lens: torch.Tensor, spans) -> int:
    """The (query, key) pairs causal attention computes for the queries of ``spans`` (``(start, stop)`` row
    positions) of a row of boundaries ``cu_seq_lens``."""
    work = cumulative_work(cu_seq_lens)
    return sum(int(work[stop] - work[start]) for start, stop in spans)


def _nearest(work: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The row positions whose cumulative work (:func:`cumulative_work`) is nearest to each of ``targets``."""
    after = torch.searchsorted(work.double(), targets).clamp(max=len(work) - 1)
    before = (after - 1).clamp(min=0)
    nearer = (targets - work[before]).abs() <= (work[after] - targets).abs()
    return torch.where(nearer, before, after)


@dataclass(frozen=True)
class Zigzag:
    """The zigzag placement of a row's queries over ``size`` ranks that hold it in contiguous slices: the row cut at
    ``cuts`` into ``2 x size`` chunks (:meth:`of`), rank ``r`` attends the queries of chunks ``r`` and
    ``2 x size - 1 - r``: an early chunk's queries see few keys, a late one's many, so each pair holds the same
    causal work."""

    cuts: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, cu_seq_lens: torch.Tensor, size: int) -> Zigzag:
        """The placement of a row of boundaries ``cu_seq_lens`` that gives every rank the same causal work
        (:func:`cumulative_work`), up to a token's at its cuts: the first half of the row in ``size`` chunks of
        equal tokens, each rank's second chunk (from the row's end back) cut where its work reaches its share; where
        the first half's chunks hold more than a share of the work (a long example early, short ones late), all
        ``2 x size`` chunks cut at equal work instead. For one example spanning the row, chunks of equal tokens."""
        return cls.of_work(cumulative_work(cu_seq_lens), size)

    @classmethod
    def of_work(cls, work: torch.Tensor, size: int) -> Zigzag:
        """:meth:`of` a row's :func:`cumulative_work`."""
        total, chunks = len(work) - 1, 2 * size
        share = float(work[-1]) / size
        first = [j * total // chunks for j in range(size + 1)]
        targets = [float(work[-1]) - (r + 1) * share + float(work[first[r + 1]]) for r in range(size - 1)]
        second = [*_nearest(work, torch.tensor(targets, dtype=torch.float64)).flip(0).tolist(), total]
        cuts = first + second
        if all(a <= b for a, b in zip(cuts, cuts[1:])):
            return cls(tuple(cuts), size)
        targets = torch.arange(chunks + 1, dtype=torch.float64) * (float(work[-1]) / chunks)
        cuts = _nearest(work, targets).cummax(0).values.tolist()
        cuts[0], cuts[-1] = 0, total
        return cls(tuple(int(cut) for cut in cuts), size)

    @property
    def total(self) -> int:
        return self.cuts[-1]

    def spans(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The row positions ``[start, stop)`` of ``rank``'s two chunks of queries, in row order."""
        chunks, cut = 2 * self.size, self.cuts
        return (cut[rank], cut[rank + 1]), (cut[chunks - 1 - rank], cut[chunks - rank])

    def _pieces(self, source: int, destination: int) -> list[tuple[int, int]]:
        """The row positions of ``source``'s slice among ``destination``'s chunks."""
        local = self.total // self.size
        low, high = source * local, (source + 1) * local
        return [(max(a, low), min(b, high)) for a, b in self.spans(destination) if min(b, high) > max(a, low)]

    def route(self, rank: int, group: SequenceGroup, device: torch.device) -> Route:
        """The all-to-all that takes ``rank``'s slice of the row to the ranks attending its queries."""
        local = self.total // self.size
        order, send = [torch.zeros(0, dtype=torch.long)], []
        for destination in range(self.size):
            pieces = self._pieces(rank, destination)
            order.extend(torch.arange(a - rank * local, b - rank * local) for a, b in pieces)
            send.append(sum(b - a for a, b in pieces))
        receive = [sum(b - a for a, b in self._pieces(source, rank)) for source in range(self.size)]
        order = torch.cat(order).to(device)
        return Route(group, order, torch.argsort(order), send, receive)


@dataclass(frozen=True)
class BalancePlan:
    """How this rank's all-gather attention takes the causal calls of one row of ``tokens`` tokens held by ``size``
    ranks (``sequence_parallel.balance``): ``zigzag`` and this rank's ``route`` (:meth:`Zigzag.route`), or ``None``
    for both where ``auto`` found the row's contiguous slices balanced. Made once per forward (:func:`plan_balance`)
    and read by every layer: no layer reads the boundaries on the host."""

    tokens: int
    size: int
    zigzag: Zigzag | None = None
    route: Route | None = None

    def on(self, device: torch.device) -> BalancePlan:
        """The plan with its route on ``device`` (a model whose layers sit on several devices)."""
        if self.route is None or self.route.order.device == device:
            return self
        order = self.route.order.to(device)
        return replace(self, route=replace(self.route, order=order, inverse=self.route.inverse.to(device)))


def plan_balance(cu_seq_lens: torch.Tensor, group: SequenceGroup, balance: str,
                 device: torch.device | None = None) -> BalancePlan:
    """The :class:`BalancePlan` of a row of boundaries ``cu_seq_lens`` for ``group``'s rank under ``balance``
    (``auto`` or ``zigzag``), its route on ``device`` (by default the boundaries'): one read of the boundaries on the
    host (:func:`cumulative_work`), shared by the decision and the cuts."""
    work = cumulative_work(cu_seq_lens)
    tokens = len(work) - 1
    if balance == "auto" and not _unbalanced(work, group.size):
        return BalancePlan(tokens, group.size)
    zigzag = Zigzag.of_work(work, group.size)
    return BalancePlan(tokens, group.size, zigzag,
                       zigzag.route(group.rank, group, cu_seq_lens.device if device is None else device))


@dataclass(frozen=True)
class Route:
    """An all-to-all permutation of a row's tokens: this rank's tokens taken in ``order`` (``inverse``: its
    inverse), ``send[d]`` of them to rank ``d``, ``receive[s]`` from rank ``s``."""

    group: SequenceGroup
    order: torch.Tensor
    inverse: torch.Tensor
    send: list[int]
    receive: list[int]

    def run(self, x: torch.Tensor, dim: int, back: bool) -> torch.Tensor:
        """``x``'s tokens (along ``dim``) sent along the route (``back``: returned to where they came from)."""
        if not back:
            x = x.index_select(dim, self.order)
        moved = x.movedim(dim, 0).contiguous()
        send, receive = (self.receive, self.send) if back else (self.send, self.receive)
        out = moved.new_empty((sum(receive), *moved.shape[1:]))
        dist.all_to_all_single(out, moved, output_split_sizes=receive, input_split_sizes=send,
                               group=self.group.group)
        out = out.movedim(0, dim)
        return out.index_select(dim, self.inverse) if back else out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, route: Route, dim: int, back: bool) -> torch.Tensor:
        ctx.route, ctx.dim, ctx.back = route, dim, back
        return route.run(x, dim, back)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.route.run(grad, ctx.dim, not ctx.back), None, None, None


def exchange(x: torch.Tensor, route: Route, dim: int, back: bool = False) -> torch.Tensor:
    """``x``'s tokens along ``dim`` sent along ``route`` (``back``: returned), differentiable (the backward sends
    the gradient the other way)."""
    return _Exchange.apply(x, route, dim, back)


def return_outputs(out: torch.Tensor, route: Route) -> torch.Tensor:
    """The balanced queries' outputs ``[1, Q, H, D]`` sent back to the ranks that own their tokens."""
    return exchange(out, route, 1, back=True)


def gather_row(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """Keys or values ``[1, H, T/N, D]`` of every rank joined into the row's ``[1, H, T, D]``; the backward sums the
    ranks' gradients of each slice into its owner."""
    return gather_sequence(x.transpose(1, 2), group).transpose(1, 2)


@dataclass
class AllGatherAttention:
    """A padding-free attention function (``inner``, one :class:`~padfree_plugins.modeling.attention.
    PadfreeAttention`) run on a sequence-parallel group's row by all-gather: packed calls get this rank's slice of
    the tokens with every head; the keys and values of the row are gathered, the queries of the slice attend to them
    with :func:`slice_boundaries`; ordinary calls (padded, ``generate()``) go to ``inner`` unchanged. Balanced
    (``balance`` ``auto`` or ``zigzag``), a causal call follows the row's :class:`BalancePlan` from its kwargs
    (:data:`~padfree_plugins.modeling.attention.BALANCE_PLAN_KWARG`, made once per forward); a call that brings none
    (this function called outside a patched model's forward) plans its row itself."""

    inner: Any
    group: SequenceGroup
    balance: str = "off"  # sequence_parallel.balance as resolved: off, auto (where the row needs it), zigzag

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        plan = kwargs.pop(BALANCE_PLAN_KWARG, None)
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
        plan = self.plan_of(plan, cu_seq_lens, local, name) if causal and self.balance != "off" else None
        key, value = gather_row(key, group), gather_row(value, group)
        if plan is not None and plan.zigzag is not None:
            return self.attend_balanced(module, query, key, value, attention_mask, plan.on(query.device), **kwargs)
        return self.attend(module, query, key, value, attention_mask, causal, **kwargs)

    def plan_of(self, plan: BalancePlan | None, cu_seq_lens: torch.Tensor, local: int, name: str) -> BalancePlan:
        """The forward's ``plan`` of the row (checked to be this row's: no host read), or, without one, the row's
        planned here."""
        if plan is None:
            return plan_balance(cu_seq_lens, self.group, self.balance)
        if plan.size != self.group.size or plan.tokens != local * self.group.size:
            raise BoundaryError(
                f"{name}: the balance plan describes a row of {plan.tokens} tokens over {plan.size} ranks, but this "
                f"call holds {local} tokens on each of {self.group.size}: a plan is made for the row of its forward "
                "(the sequence-parallel patch makes it)")
        return plan

    def attend_balanced(self, module, query, key, value, attention_mask, plan: BalancePlan, **kwargs):
        """Causal attention with the work balanced (``plan``, this row's): this rank's slice of queries
        ``[1, H, T/N, D]`` exchanged for its :class:`Zigzag` chunks, each attended at its own row positions, the
        outputs sent back to their owners."""
        group, zigzag, route = self.group, plan.zigzag, plan.route
        query = exchange(query, route, 2)
        pieces, offset = [], 0
        for start, stop in zigzag.spans(group.rank):
            if stop > start:
                out, _ = self.attend(module, query[:, :, offset:offset + stop - start], key, value, attention_mask,
                                     True, start=start, **kwargs)
                pieces.append(out)
            offset += stop - start
        out = torch.cat(pieces, 1) if pieces else query.new_zeros(1, 0, query.shape[1], value.shape[-1])
        return return_outputs(out, route), None

    def attend(self, module, query, key, value, attention_mask, causal: bool, start: int | None = None, **kwargs):
        """This rank's queries ``[1, H, T/N, D]`` (``start``: the row position of the first; by default its slice's)
        attended to the row's keys and values ``[1, H_kv, T, D]``
        (causal: those up to the slice's end only, the later ones never seen). A row with shared prefixes: each
        segment's queries against its ancestors' keys, then its own up to the slice's end
        (:meth:`~padfree_plugins.packing.prefixes.SharedPrefixes.slice_keys`), wherever in the row they lie."""
        local = query.shape[2]
        start = self.group.rank * local if start is None else start
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
    balance: str = "off"

    @classmethod
    def of(cls, group: SequenceGroup, share: int, balance: str = "off") -> AttentionLayout:
        """The layout of ``group`` with Ulysses over ``share`` ranks (:func:`ulysses_share`); ``balance``: how the
        all-gather ranks' causal work is balanced (:class:`Zigzag`; ``auto``: for the rows that need it). Mixed, it
        creates the blocks' and the places' process groups: every rank of the default group must call it
        (``new_group`` is collective), as assembly does on every rank."""
        size = group.size
        if share == size:
            return cls(size, group, None)
        if share == 1:
            return cls(size, None, group, balance)
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
        return cls(size, ulysses, gather, balance)

    @property
    def balances(self) -> bool:
        """Whether the all-gather ranks balance their causal work (a :class:`BalancePlan` per row)."""
        return self.gather is not None and self.balance != "off"

    def plan(self, cu_seq_lens: torch.Tensor) -> BalancePlan:
        """The :class:`BalancePlan` of a row of boundaries ``cu_seq_lens`` for this rank's all-gather ranks (one
        read of the boundaries on the host)."""
        return plan_balance(cu_seq_lens, self.gather, self.balance)

    @property
    def suffix(self) -> str:
        """The attention implementation's name suffix: ``_sp4`` (Ulysses), ``_sp4_allgather``, ``_sp4_ulysses2x2``;
        ``_zigzag`` after it where the all-gather ranks balance their causal work."""
        if self.gather is None:
            return f"_sp{self.size}"
        balanced = "" if self.balance == "off" else "_zigzag"
        if self.ulysses is None:
            return f"_sp{self.size}_allgather{balanced}"
        return f"_sp{self.size}_ulysses{self.ulysses.size}x{self.gather.size}{balanced}"

    def wrap(self, function: Any) -> Any:
        """``function`` (a :class:`~padfree_plugins.modeling.attention.PadfreeAttention`) run on the group's row."""
        if self.gather is not None:
            function = AllGatherAttention(function, self.gather, self.balance)
        if self.ulysses is not None:
            function = UlyssesAttention(function, self.ulysses, row_size=self.size)
        return function
