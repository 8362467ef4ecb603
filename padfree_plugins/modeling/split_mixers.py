"""Sequence mixers split across the ranks of a sequence-parallel group by passing state.

Under sequence parallelism each rank holds a contiguous slice of the group's packed row. A :class:`SplitMixer` runs
a sequence mixer (gated delta rule, KDA, Mamba2, short conv: a :class:`~padfree_plugins.modeling.mixers.PackedMixer`)
on this rank's slice only. Every example inside the slice restarts as without sequence parallelism; an example that
crosses the cut from rank ``r-1`` continues, on rank ``r``, from the final mixer state of its piece on rank ``r-1``:
its recurrent state and its conv taps, handed to the mixer's own forward through the cache interface
(:class:`~padfree_plugins.modeling.mixers.MixerState`), exactly as a completion continues its prompt
(:func:`~padfree_plugins.modeling.mixers.run_ready`). An example spanning more than two ranks passes through each.

Order on every rank: the segments that do not depend on the previous rank run first (and the last segment's final
state is sent on to rank ``r+1`` as soon as it is known); then the one incoming state is received and the piece
continuing it runs. The exchange is point to point over the sequence group (one small header and the state tensors
per cut), in autograd Functions: the backward sends the state's gradient back to rank ``r-1``. Both sides of a cut
know it is there from the row's global boundaries, so every send has its receive.

Under gradient checkpointing the recomputed layer reuses the state it received in the forward (kept per forward in
:attr:`PackedRow.received`) and sends nothing, so a recompute never waits for another rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from padfree_plugins.errors import BoundaryError, ConfigError
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.modeling.mixers import CACHE_NAMES, PACKED_ROW, ROW_KEYS, MixerState, PackedRow, run_ready
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY

#: The state source of a slice's first segment when it continues an example from the previous rank.
PREVIOUS_RANK = -2
#: dtypes a state may have on the wire (their index is sent in the header).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_DIMS = 4
#: Per state (conv, recurrent): present, dtype, ndim, dims.
HEADER = 2 * (3 + MAX_DIMS)


@dataclass(frozen=True)
class SliceSegments:
    """A rank's slice of a packed row cut at the row's example boundaries: ``bounds`` (local, ``0 … length``);
    ``continues``: its first segment continues an example from the previous rank; ``continued``: its last
    segment's example goes on on the next rank."""

    bounds: tuple[int, ...]
    continues: bool
    continued: bool


def slice_segments(cu_seq_lens: list[int], start: int, length: int) -> SliceSegments:
    """The segments of the slice ``[start, start + length)`` of a row with boundaries ``cu_seq_lens``."""
    end, cuts = start + length, set(cu_seq_lens)
    inside = tuple(c - start for c in cu_seq_lens if start < c < end)
    return SliceSegments((0, *inside, length), start > 0 and start not in cuts,
                         end < cu_seq_lens[-1] and end not in cuts)


def recorded(segments: SliceSegments) -> set[int]:
    """The segments whose final state is kept: the last one, where its example goes on on the next rank."""
    return {len(segments.bounds) - 2} if segments.continued else set()


def continuation(received: MixerState, own: MixerState | None) -> MixerState:
    """The state the continuing piece starts from (``final_conv``, ``final_recurrent``): the one received from the
    previous rank. ``own``: this slice's last final state where it is kept (for the deliberate faults of
    :mod:`padfree_plugins.testing.faults`)."""
    return received


def _global_rank(group: SequenceGroup, rank: int) -> int:
    return rank if group.group is None else dist.get_global_rank(group.group, rank)


def _header(states: tuple[torch.Tensor | None, ...], device: torch.device) -> torch.Tensor:
    values = []
    for state in states:
        if state is None:
            values += [0] * (3 + MAX_DIMS)
            continue
        if state.ndim > MAX_DIMS or state.dtype not in DTYPES:
            raise BoundaryError(f"a sequence mixer's state of shape {tuple(state.shape)} and {state.dtype} cannot be "
                                "passed between ranks; set sequence_parallel.mixers: gather")
        values += [1, DTYPES.index(state.dtype), state.ndim, *state.shape, *[0] * (MAX_DIMS - state.ndim)]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _empty_states(header: torch.Tensor, device: torch.device) -> list[torch.Tensor | None]:
    states, values = [], header.tolist()
    for index in range(2):
        present, dtype, ndim, *dims = values[index * (3 + MAX_DIMS):(index + 1) * (3 + MAX_DIMS)]
        states.append(torch.empty(dims[:ndim], dtype=DTYPES[dtype], device=device) if present else None)
    return states


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


def send_state(state: MixerState, group: SequenceGroup, hidden: torch.Tensor, replay: bool) -> torch.Tensor:
    """``state`` (the final one of this slice's last segment) sent to the next rank; a 0-dim zero to add to the
    mixer's output (it carries the backward, which receives the state's gradient)."""
    return _SendState.apply(group, hidden.dtype, replay, _anchor(hidden), state.final_conv, state.final_recurrent)


def receive_state(group: SequenceGroup, hidden: torch.Tensor, row: PackedRow | None, key: int) -> MixerState:
    """The final state of the previous rank's last segment, as the state this slice's first segment starts from
    (received once per forward: a recompute reuses it)."""
    kept = row.received.get(key) if row is not None else None
    if kept is None:
        source = _global_rank(group, group.rank - 1)
        header = torch.empty(HEADER, dtype=torch.int64, device=hidden.device)
        dist.recv(header, source, group=group.group)
        kept = _empty_states(header, hidden.device)
        for state in kept:
            if state is not None:
                dist.recv(state, source, group=group.group)
        if row is not None:
            row.received[key] = kept
    conv, recurrent = _ReceivedState.apply(group, _anchor(hidden), *kept)
    return MixerState(final_conv=conv, final_recurrent=recurrent)


def run_split(forward: Any, hidden: torch.Tensor, row: PackedRow, group: SequenceGroup, chunk: int,
              cache_name: str, key: int, **kwargs: Any) -> torch.Tensor:
    """``forward`` (a mixer's own, continuing a cache given as ``cache_name``) on this rank's slice ``hidden``
    ``[1, L, H]`` of ``row`` (global boundaries), the state passed across the cuts (see the module docstring)."""
    length = hidden.shape[1]
    segments = row._groups.get(("slice", group.rank, length))
    if segments is None:
        segments = row._groups[("slice", group.rank, length)] = slice_segments(
            row.cu_seq_lens.long().tolist(), group.rank * length, length)
    replay = key in row.received
    bounds, count = list(segments.bounds), len(segments.bounds) - 1
    sources = [(PREVIOUS_RANK, PREVIOUS_RANK) if s == 0 and segments.continues else (-1, -1) for s in range(count)]
    read, last = recorded(segments), count - 1
    outputs: list = [None] * count
    finals: dict = {}
    tokens, sent = hidden[0], None
    run_ready(forward, tokens, bounds, sources, read, outputs, finals, chunk, cache_name, **kwargs)
    if segments.continued and last in finals:
        sent = send_state(finals[last], group, hidden, replay)
    if segments.continues:
        finals[PREVIOUS_RANK] = continuation(receive_state(group, hidden, row, key), finals.get(last))
        run_ready(forward, tokens, bounds, sources, read, outputs, finals, chunk, cache_name, **kwargs)
    if segments.continued and sent is None:
        sent = send_state(finals[last], group, hidden, replay)
    if not segments.continues:
        row.received.setdefault(key, None)  # a recompute sends nothing either
    output = torch.cat(outputs)[None]
    return output if sent is None else output + sent


def zero3_refusal(names: str) -> str:
    """Why split mixers ``names`` cannot run under DeepSpeed ZeRO-3, and what to set instead."""
    return (f"sequence_parallel.mixers: split under DeepSpeed ZeRO-3 ({names}): ZeRO-3 gathers a mixer's weights by a "
            "collective at every call, and the ranks on the two sides of a cut call it a different number of times, so "
            "they would wait for each other forever. Set sequence_parallel.mixers: gather (every rank runs the mixers "
            "on the whole row; exact under ZeRO-3), or shard with FSDP2 (fully_shard per decoder layer), where split "
            "mixers train exactly")


def partitioned_by_zero3(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions ``module``'s parameters (they carry ``ds_id``)."""
    return any(hasattr(parameter, "ds_id") for parameter in module.parameters())


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
        if row.shared is not None:
            raise BoundaryError(f"{name}: a row with shared prefixes under sequence_parallel.mixers: split; a split "
                                "mixer cannot start a completion on one rank from its prompt's state on another. Set "
                                "sequence_parallel.mixers: gather (the shared row's mixers run whole on every rank) "
                                "or prefix_sharing: off")
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
