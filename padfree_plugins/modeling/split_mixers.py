"""Sequence mixers split across the ranks of a sequence-parallel group by passing state.

Under sequence parallelism each rank holds a contiguous slice of the group's packed row. A :class:`SplitMixer` runs
a sequence mixer (gated delta rule, KDA, Mamba2, short conv: a :class:`~padfree_plugins.modeling.mixers.PackedMixer`)
on this rank's slice only. Every example inside the slice restarts as without sequence parallelism; an example that
crosses the cut from rank ``r-1`` continues, on rank ``r``, from the final mixer state of its piece on rank ``r-1``:
its recurrent state and its conv taps, handed to the mixer's own forward through the cache interface
(:class:`~padfree_plugins.modeling.mixers.MixerState`), exactly as a completion continues its prompt
(:func:`~padfree_plugins.modeling.mixers.run_ready`). An example spanning more than two ranks passes through each.

In a row with shared prefixes (:mod:`padfree_plugins.packing.prefixes`) each segment starts from its parent's final
state (:func:`~padfree_plugins.modeling.mixers.state_sources`; its conv taps reach into the grandparent where the
parent is shorter than the kernel, through the parent's final taps). A parent lies earlier in the row, so on this
rank or an earlier one: where it ended on an earlier rank, its final state is handed on from rank to rank, with the
state of the piece cut by each boundary, until the last rank that holds one of its children (:func:`slice_plan`).
A piece of one token that continues a state and whose state is read hands on its start state and its token instead,
which the reader runs ahead of its own (:func:`~padfree_plugins.modeling.mixers.run_ready`).

Order on every rank: the pieces that do not depend on the previous rank run first (and the states handed on to rank
``r+1`` are sent as soon as they are known: at once where none is relayed); then the incoming states are received
and the pieces that start from them run. The exchange is point to point between neighbours in the sequence group
(one small header and the state tensors per cut), in autograd Functions: the backward sends each state's gradient
back to rank ``r-1`` (a relayed state's gradient is relayed back). Both sides of a cut know which states cross it
from the row's global boundaries and structure, so every send has its receive.

Under gradient checkpointing the recomputed layer reuses the state it received in the forward (kept per forward in
:attr:`PackedRow.received`) and sends nothing, so a recompute never waits for another rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from padfree_plugins.errors import BoundaryError, ConfigError
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.modeling.mixers import CACHE_NAMES, PACKED_ROW, ROW_KEYS, MixerState, PackedRow, \
    partitioned_by_zero3, run_ready, state_sources
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY

#: The key of the state a slice's first piece continues when its segment goes on from the previous rank.
PREVIOUS_RANK = -2
#: dtypes a state may have on the wire (their index is sent in the header).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_DIMS = 4
#: Per handed-on state: its tensors (conv taps, recurrent state, lead tokens: see MixerState), each with a header of
#: present, dtype, ndim, dims.
TENSORS = 3
ENTRY = 3 + MAX_DIMS


@dataclass(frozen=True)
class SlicePlan:
    """What a rank's slice of a packed row runs and hands on (see the module docstring).

    ``bounds``: its pieces (local, ``0 … length``), the row's segments cut to the slice; ``sources``: per piece, the
    states it starts from (recurrent, conv): ``-1`` (zeros), another piece of the slice, :data:`PREVIOUS_RANK` (its
    segment's piece on the previous rank) or ``("segment", s)`` (the final state of segment ``s``, which ended on an
    earlier rank); ``read``: the pieces whose final state is kept; ``incoming``: the keys of the states received from
    the previous rank, in order; ``outgoing``: per state sent to the next rank, its key there and where it is here
    (a piece, or a received key, relayed)."""

    bounds: tuple[int, ...]
    sources: tuple[tuple[Hashable, Hashable], ...]
    read: frozenset[int]
    incoming: tuple[Hashable, ...]
    outgoing: tuple[tuple[Hashable, Hashable], ...]


def slice_plan(cu_seq_lens: Sequence[int], start: int, length: int,
               sources: Sequence[tuple[int, int]] | None = None) -> SlicePlan:
    """The plan of the slice ``[start, start + length)`` of a row of equal slices with boundaries ``cu_seq_lens``;
    ``sources``: per segment of the row, the segments it continues (recurrent, conv), as
    :func:`~padfree_plugins.modeling.mixers.state_sources` gives them for a row with shared prefixes (``None``: every
    segment starts from zeros)."""
    count = len(cu_seq_lens) - 1
    sources = [(-1, -1)] * count if sources is None else [tuple(pair) for pair in sources]
    if len(sources) != count:
        raise BoundaryError(f"the shared prefixes name {len(sources)} segments, the boundaries {count}")
    first = [begin // length for begin in cu_seq_lens[:-1]]
    last = [(end - 1) // length for end in cu_seq_lens[1:]]
    readers: dict[int, list[int]] = {}
    for segment, pair in enumerate(sources):
        for source in set(pair):
            if source >= segment:
                raise BoundaryError(f"segment {segment} continues segment {source}, which is not an earlier one")
            if source >= 0:
                readers.setdefault(source, []).append(segment)
    rank, ranks = start // length, -(-cu_seq_lens[-1] // length)

    def crossing(cut: int) -> list[tuple[Hashable, int]]:
        """The states handed from rank ``cut - 1`` to rank ``cut``, each with the segment it belongs to."""
        keys: list[tuple[Hashable, int]] = [(PREVIOUS_RANK, s) for s in range(count) if first[s] < cut <= last[s]]
        return keys + [(("segment", s), s) for s in sorted(readers) if last[s] < cut <= max(
            first[reader] for reader in readers[s])]

    here = [s for s in range(count) if first[s] <= rank <= last[s]]
    local = {segment: index for index, segment in enumerate(here)}
    bounds = (0, *(min(cu_seq_lens[s + 1], start + length) - start for s in here))

    def source_of(segment: int, source: int) -> Hashable:
        if first[segment] < rank:
            return PREVIOUS_RANK
        if source < 0:
            return -1
        return local[source] if last[source] == rank else ("segment", source)

    pieces = tuple(tuple(source_of(s, source) for source in sources[s]) for s in here)
    read = frozenset(local[s] for s in here if last[s] > rank or (last[s] == rank and s in readers))
    incoming = tuple(key for key, _ in crossing(rank)) if rank > 0 else ()
    outgoing = tuple((key, local[s] if key == PREVIOUS_RANK or last[s] == rank else key)
                     for key, s in crossing(rank + 1)) if rank + 1 < ranks else ()
    return SlicePlan(bounds, pieces, read, incoming, outgoing)


def continuation(received: MixerState, own: MixerState | None) -> MixerState:
    """The state the continuing piece starts from (``final_conv``, ``final_recurrent``): the one received from the
    previous rank. ``own``: this slice's last final state where it is kept (for the deliberate faults of
    :mod:`padfree_plugins.testing.faults`)."""
    return received


def ended_earlier(received: dict[Hashable, MixerState], key: Hashable) -> MixerState:
    """The state a segment starts from whose source (``key``: ``("segment", s)``) ended on an earlier rank: the one
    received under ``key`` (``received``: this slice's received states, in the order they came; for the deliberate
    faults of :mod:`padfree_plugins.testing.faults`)."""
    return received[key]


def _global_rank(group: SequenceGroup, rank: int) -> int:
    return rank if group.group is None else dist.get_global_rank(group.group, rank)


def _header(states: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    values = []
    for state in states:
        if state is None:
            values += [0] * ENTRY
            continue
        if state.ndim > MAX_DIMS or state.dtype not in DTYPES:
            raise BoundaryError(f"a sequence mixer's state of shape {tuple(state.shape)} and {state.dtype} cannot be "
                                "passed between ranks; set sequence_parallel.mixers: gather")
        values += [1, DTYPES.index(state.dtype), state.ndim, *state.shape, *[0] * (MAX_DIMS - state.ndim)]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _empty_states(header: torch.Tensor, device: torch.device) -> list[torch.Tensor | None]:
    states, values = [], header.tolist()
    for index in range(len(values) // ENTRY):
        present, dtype, ndim, *dims = values[index * ENTRY:(index + 1) * ENTRY]
        states.append(torch.empty(dims[:ndim], dtype=DTYPES[dtype], device=device) if present else None)
    return states


def _flat(states: Sequence[MixerState]) -> list[torch.Tensor | None]:
    return [tensor for state in states for tensor in (state.final_conv, state.final_recurrent, state.lead)]


class _SendState(torch.autograd.Function):
    """Forward: the state sent to the next rank (unless ``replay``); returns a 0-dim zero of ``dtype`` to be added
    to the mixer's output, so that the backward runs: it receives the state's gradient from the next rank."""

    @staticmethod
    def forward(ctx, group: SequenceGroup, dtype: torch.dtype, replay: bool, anchor: torch.Tensor,
                *states: torch.Tensor | None) -> torch.Tensor:
        ctx.group, ctx.states = group, [(s.shape, s.dtype, s.device) if s is not None else None for s in states]
        if not replay:
            destination = _global_rank(group, group.rank + 1)
            dist.send(_header(states, anchor.device), destination, group=group.group)
            for state in states:
                if state is not None:
                    dist.send(state.detach().contiguous(), destination, group=group.group)
        return torch.zeros((), dtype=dtype, device=anchor.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        source = _global_rank(ctx.group, ctx.group.rank + 1)
        grads = []
        for spec in ctx.states:
            if spec is None:
                grads.append(None)
                continue
            received = torch.empty(spec[0], dtype=spec[1], device=spec[2])
            dist.recv(received, source, group=ctx.group.group)
            grads.append(received)
        return None, None, None, None, *grads


class _ReceivedState(torch.autograd.Function):
    """The state received from the previous rank (``states``, received outside) put into the graph; the backward
    sends its gradient back to the previous rank."""

    @staticmethod
    def forward(ctx, group: SequenceGroup, anchor: torch.Tensor, *states: torch.Tensor | None):
        ctx.group, ctx.states = group, [(s.shape, s.dtype, s.device) if s is not None else None for s in states]
        return tuple(s.clone() if s is not None else None for s in states)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        destination = _global_rank(ctx.group, ctx.group.rank - 1)
        for spec, grad in zip(ctx.states, grads):
            if spec is not None:
                grad = torch.zeros(spec[0], dtype=spec[1], device=spec[2]) if grad is None else grad
                dist.send(grad.contiguous(), destination, group=ctx.group.group)
        return None, None, *[None] * len(ctx.states)


def _anchor(hidden: torch.Tensor) -> torch.Tensor:
    """What ties an exchange into the graph whenever gradients are on (the same rule on every rank)."""
    if hidden.requires_grad:
        return hidden
    return torch.zeros((), device=hidden.device, requires_grad=torch.is_grad_enabled())


def send_states(states: Sequence[MixerState], group: SequenceGroup, hidden: torch.Tensor,
                replay: bool) -> torch.Tensor:
    """``states`` sent to the next rank (see the module docstring); a 0-dim zero to add to the mixer's output (it
    carries the backward, which receives the states' gradients)."""
    return _SendState.apply(group, hidden.dtype, replay, _anchor(hidden), *_flat(states))


def receive_states(count: int, group: SequenceGroup, hidden: torch.Tensor, row: PackedRow | None,
                   key: int) -> list[MixerState]:
    """The ``count`` states the previous rank hands on, in its order (received once per forward: a recompute reuses
    them)."""
    kept = row.received.get(key) if row is not None else None
    if kept is None:
        source = _global_rank(group, group.rank - 1)
        header = torch.empty(count * TENSORS * ENTRY, dtype=torch.int64, device=hidden.device)
        dist.recv(header, source, group=group.group)
        kept = _empty_states(header, hidden.device)
        for state in kept:
            if state is not None:
                dist.recv(state, source, group=group.group)
        if row is not None:
            row.received[key] = kept
    tensors = _ReceivedState.apply(group, _anchor(hidden), *kept)
    return [MixerState(final_conv=conv, final_recurrent=recurrent, lead=lead)
            for conv, recurrent, lead in zip(*[iter(tensors)] * TENSORS)]


def run_split(forward: Any, hidden: torch.Tensor, row: PackedRow, group: SequenceGroup, chunk: int,
              cache_name: str, key: int, **kwargs: Any) -> torch.Tensor:
    """``forward`` (a mixer's own, continuing a cache given as ``cache_name``) on this rank's slice ``hidden``
    ``[1, L, H]`` of ``row`` (global boundaries, shared prefixes where the row has them), the states passed across
    the cuts (see the module docstring)."""
    length = hidden.shape[1]
    plan = row._groups.get(("slice", group.rank, length))
    if plan is None:
        sources = state_sources(row.shared) if row.shared is not None else None
        plan = row._groups[("slice", group.rank, length)] = slice_plan(
            row.cu_seq_lens.long().tolist(), group.rank * length, length, sources)
    replay = key in row.received
    bounds, count = list(plan.bounds), len(plan.bounds) - 1
    outputs: list = [None] * count
    finals: dict = {}
    tokens, sent = hidden[0], None
    run_ready(forward, tokens, bounds, plan.sources, plan.read, outputs, finals, chunk, cache_name, **kwargs)
    if plan.outgoing and all(here in finals for _, here in plan.outgoing):
        sent = send_states([finals[here] for _, here in plan.outgoing], group, hidden, replay)
    if plan.incoming:
        received = dict(zip(plan.incoming, receive_states(len(plan.incoming), group, hidden, row, key)))
        for name in plan.incoming:
            finals[name] = ended_earlier(received, name) if name != PREVIOUS_RANK else continuation(
                received[name], finals.get(count - 1))
        if run_ready(forward, tokens, bounds, plan.sources, plan.read, outputs, finals, chunk, cache_name, **kwargs):
            raise BoundaryError(f"the slice's pieces {plan.sources} wait on states nobody hands on")
    else:
        row.received.setdefault(key, [])  # a recompute sends nothing either
    if plan.outgoing and sent is None:
        sent = send_states([finals[here] for _, here in plan.outgoing], group, hidden, replay)
    output = torch.cat(outputs)[None]
    return output if sent is None else output + sent


def zero3_refusal(names: str) -> str:
    """Why split mixers ``names`` cannot run under DeepSpeed ZeRO-3, and what to set instead."""
    return (f"sequence_parallel.mixers: split under DeepSpeed ZeRO-3 ({names}): ZeRO-3 gathers a mixer's weights by a "
            "collective at every call, and the ranks on the two sides of a cut call it a different number of times, so "
            "they would wait for each other forever. Set sequence_parallel.mixers: gather (every rank runs the mixers "
            "on the whole row; exact under ZeRO-3), or shard with FSDP2 (fully_shard per decoder layer), where split "
            "mixers train exactly")


@dataclass
class SplitMixer:
    """A sequence mixer's packed forward (``mixer``: a :class:`~padfree_plugins.modeling.mixers.PackedMixer`, or
    another plugin's packed forward whose ``original``, the module's own forward, continues a cache: LFM2's short
    conv) run on this rank's slice only, the state passed between the ranks of ``group`` (see the module
    docstring); other calls go to ``mixer`` unchanged."""

    mixer: Any
    group: SequenceGroup
    packed_sequence_mixer: ClassVar[bool] = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seq_lens_q") is None and PACKED_ROW.get() is None:
            return self.mixer(*args, **kwargs)  # an ordinary call: padded, generate()
        return _run_split_eagerly(self, args, kwargs)

    def run(self, args: tuple, kwargs: dict) -> torch.Tensor:
        mixer, name = self.mixer, type(self.mixer.module).__name__
        if partitioned_by_zero3(mixer.module):  # wrapped after assembly: refused on every rank before any exchange
            raise ConfigError(zero3_refusal(name))
        inputs = inspect.signature(mixer.original).bind(*args, **kwargs).arguments
        inputs.update(inputs.pop("kwargs", {}))
        row, cu = PACKED_ROW.get(), inputs.get("cu_seq_lens_q")
        if row is None or (cu is not None and cu is not row.cu_seq_lens):
            row = PackedRow(cu, inputs.get(SHARED_PREFIXES_KEY))
        hidden = inputs.pop("hidden_states", None)
        if hidden is None or hidden.ndim != 3 or hidden.shape[0] != 1:
            raise BoundaryError(f"{name} got a packed call without a [1, T, H] hidden_states")
        if hidden.shape[1] * self.group.size != row.total:
            raise BoundaryError(f"{name}: {hidden.shape[1]} tokens on each of {self.group.size} ranks, but the "
                                f"boundaries describe a row of {row.total}")
        if any(inputs.get(cache) is not None for cache in CACHE_NAMES):
            raise BoundaryError("a packed row with a cache: a sequence mixer's state would span examples; run "
                                "packed rows without a cache (use_cache=False)")
        alone = {key: value for key, value in inputs.items() if key not in ROW_KEYS and key not in CACHE_NAMES}
        return run_split(mixer.original, hidden, row, self.group, getattr(mixer, "chunk", 1), cache_name(mixer),
                         id(self), **alone)


@torch.compiler.disable
def _run_split_eagerly(mixer: SplitMixer, args: tuple, kwargs: dict) -> torch.Tensor:
    """:meth:`SplitMixer.run` outside a compiled graph (it reads the slice's segments on the host and communicates)."""
    return mixer.run(args, kwargs)


def cache_name(mixer: Any) -> str | None:
    """The name under which the module's own forward (``mixer.original``) takes a cache, or ``None``."""
    original = getattr(mixer, "original", None)
    if original is None:
        return None
    parameters = inspect.signature(original).parameters
    return next((name for name in CACHE_NAMES if name in parameters), None)


def why_not_split(mixer: Any) -> str:
    """Why a sequence mixer (a plugin's packed forward: a :class:`PackedMixer`, LFM2's short conv) cannot run split
    across ranks ("" where it can): its module's own forward must start from a state given through a cache."""
    if reason := getattr(mixer, "no_prompt_state", ""):
        return reason
    if cache_name(mixer) is None:
        return f"its forward takes no cache ({' or '.join(CACHE_NAMES)}) to start from a state"
    if getattr(mixer, "backend", None) == "kernels":
        return "mixers: kernels does not start a mixer from a given state"
    return ""
