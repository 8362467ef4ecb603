"""Token-budget planning: which examples go into which micro-batch of which rank, for one epoch.

Pure functions of example lengths and a random generator (no torch, no I/O), so every rank computes the same plan
from the same seed and no communication is needed. A plan is a list of micro-batches (lists of item ids) in
step-major order: step ``s`` is ``batches[s * N : (s + 1) * N]`` and rank ``r`` trains ``batches[s * N + r]``.

How an epoch is planned:

1. Shuffle the items; cut the order into windows of ``window`` items (at least 4 steps' worth of tokens).
2. In each window, **best-fit decreasing** packs the items into micro-batches of at most ``capacity`` tokens.
   Micro-batches that are full (free space below 1% of the budget, or below the shortest item in the window) are
   sorted by token count and grouped ``N`` at a time into steps, so the ``N`` ranks of a step get nearly the same
   number of tokens. The others (partly filled; and the fewer-than-``N`` left over) carry their items to the next
   window.
3. The last window and what was carried into it (the tail) are spread with **LPT** (longest item first, into the
   least-loaded micro-batch) over as few steps as fit, which balances the ranks of those last steps too.
4. Steps are shuffled within each window, so long and short examples alternate over the epoch.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np

#: A micro-batch counts as full when its free space is below this fraction of the budget.
FULL_SLACK = 0.01
#: A window holds at least this many steps' worth of tokens (for all ranks), whatever ``window`` says.
MIN_WINDOW_STEPS = 4


def best_fit_decreasing(items: list[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack ``items`` (ids into ``lengths``) into bins of at most ``capacity`` tokens, longest first, each into
    the fullest bin it still fits in. Every length must be <= ``capacity``."""
    order = sorted(items, key=lambda i: -lengths[i])  # stable: ties keep the shuffled order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin id), sorted
    for item in order:
        size = lengths[item]
        at = bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([item])
            insort(free, (capacity - size, len(bins) - 1))
        else:
            room, b = free.pop(at)
            bins[b].append(item)
            insort(free, (room - size, b))
    return bins


def balanced_partition(items: list[int], lengths: Sequence[int], parts: int, capacity: int) -> list[list[int]] | None:
    """LPT: split ``items`` into ``parts`` bins, longest first into the least-loaded bin; ``None`` if one bin would
    exceed ``capacity``. With at least ``parts`` items, no bin is empty."""
    heap = [(0, b) for b in range(parts)]
    bins: list[list[int]] = [[] for _ in range(parts)]
    for item in sorted(items, key=lambda i: -lengths[i]):
        load, b = heapq.heappop(heap)
        load += lengths[item]
        if load > capacity:
            return None
        bins[b].append(item)
        heapq.heappush(heap, (load, b))
    return bins


def _tokens(batch: list[int], lengths: Sequence[int]) -> int:
    return sum(lengths[i] for i in batch)


def _group(bins: list[list[int]], lengths: Sequence[int], num_replicas: int) -> list[list[list[int]]]:
    """Bins sorted by token count, ``num_replicas`` neighbours per step (similar counts in every step)."""
    bins = sorted(bins, key=lambda b: -_tokens(b, lengths))
    return [bins[i : i + num_replicas] for i in range(0, len(bins), num_replicas)]


def _tail_steps(items: list[int], lengths: Sequence[int], capacity: int, num_replicas: int,
                at_least: int = 1) -> list[list[list[int]]] | None:
    """The fewest balanced steps (but at least ``at_least``) that hold ``items`` with no micro-batch empty;
    ``None`` if there are too few items for that."""
    steps = max(at_least, 1, math.ceil(_tokens(items, lengths) / (capacity * num_replicas)))
    while steps * num_replicas <= len(items):
        bins = balanced_partition(items, lengths, steps * num_replicas, capacity)
        if bins is not None:
            return _group(bins, lengths, num_replicas)
        steps += 1
    return None


def _full_steps(pool: list[int], lengths: Sequence[int], capacity: int, num_replicas: int,
                window: int) -> tuple[list[list[list[int]]], list[int]]:
    """Best-fit-decreasing on ``pool``: steps of full micro-batches, and the items to carry to the next window."""
    bins = best_fit_decreasing(pool, lengths, capacity)
    slack = max(FULL_SLACK * capacity, min(lengths[i] for i in pool))
    full = [b for b in bins if capacity - _tokens(b, lengths) < slack]
    partial = [b for b in bins if capacity - _tokens(b, lengths) >= slack]
    steps = _group(full, lengths, num_replicas)
    if steps and len(steps[-1]) < num_replicas:
        partial += steps.pop()
    carry = [item for b in partial for item in b]
    if len(carry) > window:  # bins that do not fill (items long next to the budget): spread them now
        more = _tail_steps(carry, lengths, capacity, num_replicas)
        if more is not None:
            steps, carry = steps + more, []
    return steps, carry


def plan_epoch(lengths: Sequence[int] | np.ndarray, capacity: int, *, order: Sequence[int],
               rng: np.random.Generator, num_replicas: int = 1, window: int = 1024, drop_last: bool = False,
               num_steps: int | None = None) -> list[list[int]]:
    """One epoch's micro-batches in step-major order (see the module docstring); ``len`` is a multiple of
    ``num_replicas``. ``order`` is the epoch's shuffled order of the items, ``rng`` shuffles the steps.

    Every item is used exactly once, except with ``drop_last``: then only steps of full micro-batches are kept and
    the few items left over sit out this epoch. ``num_steps`` asks for that many steps: the tail is spread over
    more (lighter, still balanced) steps if needed, or the plan is cut to it with ``drop_last``; when impossible
    the plan has its natural length. ``ValueError`` if an item is longer than ``capacity`` or the items cannot
    give every rank something in every step."""
    lengths = np.asarray(lengths, dtype=np.int64).tolist()
    if lengths and max(lengths) > capacity:
        raise ValueError(f"an item has {max(lengths)} tokens, more than the budget of {capacity}")
    if len(lengths) < num_replicas:
        raise ValueError(f"{len(lengths)} item(s) cannot give each of {num_replicas} ranks a micro-batch")
    window = max(window, math.ceil(MIN_WINDOW_STEPS * num_replicas * capacity * len(lengths) / sum(lengths)))
    order = [int(i) for i in order]
    windows = [order[i : i + window] for i in range(0, len(order), window)]
    steps: list[list[list[int]]] = []
    carry: list[int] = []
    for chunk in windows[:-1]:
        grouped, carry = _full_steps(carry + chunk, lengths, capacity, num_replicas, window)
        rng.shuffle(grouped)
        steps += grouped
    tail = carry + windows[-1]
    if drop_last:
        grouped, _ = _full_steps(tail, lengths, capacity, num_replicas, len(tail))
        rng.shuffle(grouped)
        steps += grouped
        return [batch for step in steps[:num_steps] for batch in step]
    grouped = None
    if num_steps is not None and num_steps > len(steps):
        grouped = _tail_steps(tail, lengths, capacity, num_replicas, num_steps - len(steps))
    if grouped is None:  # no step count asked for, or it cannot be met: as few steps as fit
        grouped = _tail_steps(tail, lengths, capacity, num_replicas)
    while grouped is None:  # too few tail items for the ranks: take back the last steps and spread them again
        if not steps:
            raise ValueError(f"{len(lengths)} item(s) cannot be spread over {num_replicas} ranks without leaving a "
                             "rank with nothing in some step; use fewer ranks or set drop_last")
        tail += [item for b in steps.pop() for item in b]
        grouped = _tail_steps(tail, lengths, capacity, num_replicas)
    rng.shuffle(grouped)
    return [batch for step in steps + grouped for batch in step]
