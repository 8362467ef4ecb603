"""Boundary-aware sequence mixers: the layers other than attention that carry taps or state along the sequence,
restarted at every example of a packed row.

A causal convolution over a packed row would reach from each example's first tokens into the previous example; a
state-space scan or a linear-attention recurrence would carry the previous example's state. Here each mixer reads
the collator's boundaries (``cu_seq_lens_q``, computed once) and computes exactly what every example computes
alone, on real tokens only:

* :func:`boundary_causal_conv1d` — a depthwise causal conv1d whose taps are masked where they would cross an
  example's start (vectorised: one shifted multiply-add per tap, no per-example loop), so that a token ``j``
  places into its example sees zeros before its start, as at the start of a row.

* :class:`PackedMixer` — any mixer module's own forward (a gated delta rule, a Mamba1 / Mamba2 scan, KDA) run on
  every example alone, the examples of equal length stacked into one batch (``exact``: transformers' own code,
  on real tokens only); or, on a GPU with the packages that take boundaries natively, the packed row through the
  module's own forward with ``cu_seq_lens_q`` and ``seq_idx``, which transformers routes to
  flash-linear-attention, causal-conv1d and mamba-ssm (``kernels``). ``auto`` takes ``kernels`` only where the
  family has such a route, the tensors are on CUDA and every package is installed; otherwise ``exact``. Neither
  ever runs a mixer across a boundary: a packed call without boundaries, or with a cache, is an error.

In a row with shared prefixes (:mod:`padfree_plugins.packing.prefixes`: a prompt once, then its completions), each
completion's mixers instead start from its prompt's final state, exactly what the completion computes in its padded
row (:func:`state_sources`): :func:`run_shared` hands the mixer's own forward a :class:`MixerState` — the cache
interface through which transformers' hybrid mixers continue a state (the recurrent state, the conv taps) — built
from the prompt's run, so the prompt runs once and every completion's gradient reaches it through that state;
:func:`boundary_causal_conv1d` lets a completion's taps read its prompt's last inputs. That is the torch code
(``exact``); the kernels route does not carry a prompt's state yet. A family whose mixers cannot continue a state
(Mamba1: transformers' scan takes no initial state) declares why (``no_prompt_state``) and refuses such a row.

Under DeepSpeed ZeRO-3 a mixer's weights are gathered by a collective at each of its calls (and again in the
backward), and the number of calls above depends on the row (its groups of lengths, its prefix tree). Where ZeRO-3
partitions a mixer, the ranks agree once per row on as many calls as any of them needs (:func:`agreed_calls`) and a
rank that needs fewer makes the rest on a row of zeros, their outputs tied into the graph with weight 0
(:func:`equal_calls`), so that every rank gathers as often in the forward and the backward; the results are unchanged.

An architecture plugin routes a model's mixer modules here for packed calls (see ``builtin/architectures/lfm2.py``
and ``modeling/hybrids.py``) and leaves padded calls and ``generate()`` to the model's own code.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache, partial
from itertools import groupby
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from padfree_plugins.errors import BackendUnavailableError, BoundaryError
from padfree_plugins.modeling.attention import PACKED_CALL, ThreadValue
from padfree_plugins.modeling.patching import own_attribute, restore_attributes, without_cache
from padfree_plugins.packing.batch import BOUNDARY_KEYS, token_examples
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, SharedPrefixes

#: The sequence-mixer backends a config may name (``mixers:``).
MIXER_BACKENDS = ("auto", "exact", "kernels")
#: Keys a mixer's own forward is never handed when it runs one example (or one group of equal lengths) alone.
ROW_KEYS = (*BOUNDARY_KEYS, "seq_idx", "position_ids", "attention_mask", SHARED_PREFIXES_KEY)
#: The names under which transformers' hybrid mixers take their cache (the state they continue from).
CACHE_NAMES = ("cache_params", "past_key_values")


def positions_in_examples(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """Every packed token's position inside its example (int64 ``[T]``), from the boundaries; no host sync."""
    example = token_examples(cu_seq_lens, total)
    return torch.arange(total, device=cu_seq_lens.device) - cu_seq_lens.long()[example]


def state_sources(shared: SharedPrefixes) -> tuple[tuple[int, int], ...]:
    """For every segment of a row with shared prefixes, the segment its sequence mixers continue: ``(recurrent,
    conv)`` — the segment whose final recurrent state (a gated delta rule's, a Mamba2 scan's) it starts from, and
    the segment whose last inputs its conv taps read. A completion continues its prompt in both (exactly what its
    padded row computes, the prompt's tokens before it); a segment without a parent starts from zeros (``-1``), as
    at the start of a row."""
    return tuple((parent, parent) for parent in shared.parents)


def boundary_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           cu_seq_lens: torch.Tensor, shared: SharedPrefixes | None = None) -> torch.Tensor:
    """A depthwise causal conv1d of a packed row ``x`` ``[1, C, T]`` with ``weight`` ``[C, K]`` (and ``bias``
    ``[C]``), restarted at every example boundary of ``cu_seq_lens``: equal to ``F.conv1d(x, weight[:, None],
    bias, padding=K - 1, groups=C)[..., :T]`` run on each example alone.

    Tap ``j`` (looking ``j`` tokens back) is multiplied in only where the token is at least ``j`` into its example.
    With ``shared`` prefixes, a tap that reaches back past a segment's start reads its parent's last tokens, and its
    grandparent's where the parent is shorter (:func:`state_sources`), as in the completion's padded row.
    """
    if x.ndim != 3 or x.shape[0] != 1:
        raise ValueError(f"a packed row is [1, C, T]; got {tuple(x.shape)}")
    total, kernel = x.shape[-1], weight.shape[-1]
    cu_seq_lens = cu_seq_lens.to(x.device)
    position = positions_in_examples(cu_seq_lens, total)
    x = x.to(weight.dtype)
    out = x * weight[:, kernel - 1, None]
    context = _conv_context(shared, cu_seq_lens, kernel - 1) if shared is not None else None
    segment = token_examples(cu_seq_lens, total) if shared is not None else None
    for back in range(1, min(kernel, total) if context is None else kernel):
        if context is None:
            shifted = F.pad(x, (back, 0))[..., :total] * (position >= back).to(x.dtype)
        else:
            shifted = _tap(x, back, position, segment, context)
        out = out + shifted * weight[:, kernel - 1 - back, None]
    if bias is not None:
        out = out + bias[:, None]
    return out


def _conv_context(shared: SharedPrefixes, cu_seq_lens: torch.Tensor, reach: int) -> torch.Tensor:
    """Per segment (int64 ``[S, reach]``): the packed indices of the ``reach`` inputs before its first token that its
    conv taps read, oldest first — its conv source's last tokens, then (where that segment is shorter) its source's
    source's, up the prefix tree (:func:`state_sources`); ``-1`` where the chain runs out (zeros, as at a row's
    start)."""
    bounds = cu_seq_lens.long().tolist()
    sources = [conv for _, conv in state_sources(shared)]
    if len(sources) != len(bounds) - 1:
        raise BoundaryError(f"the shared prefixes name {len(sources)} segments, the boundaries {len(bounds) - 1}")
    context = []
    for segment in range(len(sources)):
        before, source = [], sources[segment]
        while len(before) < reach and source >= 0:
            before.extend(range(bounds[source + 1] - 1, bounds[source] - 1, -1)[:reach - len(before)])
            source = sources[source]
        context.append([-1] * (reach - len(before)) + before[::-1])
    return torch.tensor(context, dtype=torch.long, device=cu_seq_lens.device).reshape(len(sources), reach)


def _tap(x: torch.Tensor, back: int, position: torch.Tensor, segment: torch.Tensor,
         context: torch.Tensor) -> torch.Tensor:
    """Every token's input ``back`` tokens before it: its own segment's, else its segment's conv context
    (:func:`_conv_context`), else 0."""
    own = position >= back
    reach = context.shape[1]
    before = context[segment, (reach - back + position).clamp(min=0, max=reach - 1)]
    here = torch.arange(x.shape[-1], device=x.device)
    index = torch.where(own, here - back, before.clamp(min=0))
    return x.index_select(-1, index) * (own | (before >= 0)).to(x.dtype)


@dataclass
class PackedRow:
    """The boundaries of the packed row a forward is running, and what mixers derive from them, once per forward."""

    cu_seq_lens: torch.Tensor
    #: The row's shared prefixes, where it has them: a completion's mixers continue its prompt's state.
    shared: SharedPrefixes | None = None
    #: Plans derived from the boundaries, computed once per forward (mixer batches; tiles' and ranks' slices).
    _groups: dict = field(default_factory=dict, repr=False)
    #: Per split mixer (:mod:`padfree_plugins.modeling.split_mixers`): the state it received in this forward, reused
    #: (not received again) when gradient checkpointing recomputes its layer.
    received: dict = field(default_factory=dict, repr=False)
    _seq_idx: torch.Tensor | None = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return int(self.cu_seq_lens[-1])

    def batches(self, chunk: int, device: torch.device) -> tuple[list[tuple[torch.Tensor, int, int]], torch.Tensor]:
        """:func:`batch_plan` of the row, its indices on ``device`` (computed once per chunk and device)."""
        key = ("batches", chunk, device)
        if key not in self._groups:
            batches, keep = batch_plan(self.cu_seq_lens, chunk)
            self._groups[key] = (
                [(torch.tensor(index, dtype=torch.long, device=device), count, width)
                 for index, count, width in batches], torch.tensor(keep, dtype=torch.long, device=device))
        return self._groups[key]

    def seq_idx(self, device: torch.device) -> torch.Tensor:
        """The example of every token, int32 ``[1, T]``, as causal-conv1d and mamba-ssm take it."""
        if self._seq_idx is None or self._seq_idx.device != device:
            cu = self.cu_seq_lens.to(device)
            self._seq_idx = token_examples(cu, self.total).to(torch.int32)[None]
        return self._seq_idx


#: The packed row of the forward being run (set by :class:`MixerPatch` on the base model), for mixers whose model
#: hands them no boundaries (Jamba, Mamba); ``None`` outside packed forwards.
PACKED_ROW = ThreadValue(None)


def run_per_example(forward: Any, hidden_states: torch.Tensor, row: PackedRow, chunk: int = 1,
                    **kwargs: Any) -> torch.Tensor:
    """``forward`` (a mixer's own, ``[B, L, H] -> [B, L, H']``) on every example of the packed ``hidden_states``
    ``[1, T, H]`` alone, the outputs put back in packed order. Exact for any causal mixer that treats the rows of a
    batch independently.

    The examples that span the same number of ``chunk``-token chunks run as one batch, each right-padded with
    zeros to the longest of them: a causal mixer's real tokens never see what follows them, and a chunked scan
    (the gated delta rule's 64, Mamba2's ``chunk_size``) pads every call to whole chunks anyway, so this costs no
    more scan work than one call per example and makes far fewer calls. ``chunk=1`` batches equal lengths only
    (a sequential scan, whose work grows with every pad). Each batch is gathered with one index (its pads read a
    zero row) and the outputs put back with one: no per-example slice, whose backward would fill a zero gradient
    of the whole row for every example.
    """
    batches, keep = row.batches(chunk, hidden_states.device)
    tokens = F.pad(hidden_states[0], (0, 0, 0, 1))  # the zero row every pad reads
    outputs = []
    for index, count, width in batches:
        output = forward(tokens.index_select(0, index).view(count, width, -1), **kwargs)
        if not isinstance(output, torch.Tensor):
            raise BoundaryError(f"a sequence mixer returned {type(output).__name__}, not a tensor: padfree_plugins "
                                "cannot put its examples back into the packed row")
        outputs.append(output.reshape(count * width, -1))
    return torch.cat(outputs).index_select(0, keep)[None]


def batch_plan(cu_seq_lens: torch.Tensor, chunk: int) -> tuple[list[tuple[list[int], int, int]], list[int]]:
    """:func:`run_per_example`'s batches on the host: per batch, the token index of each of its ``[count, width]``
    places (``T``, one past the row, for a pad), ``count`` and ``width``; and, per packed token, its place in the
    batches' outputs laid end to end. The examples sorted by length (stably), grouped by their number of ``chunk``-
    token chunks, each batch as wide as its longest."""
    bounds = cu_seq_lens.long().tolist()
    total = bounds[-1]
    examples = sorted(range(len(bounds) - 1), key=lambda e: bounds[e + 1] - bounds[e])
    batches: list[tuple[list[int], int, int]] = []
    keep = [0] * total
    placed = 0
    for _, members in groupby(examples, key=lambda e: -(-(bounds[e + 1] - bounds[e]) // chunk)):
        members = list(members)
        width = bounds[members[-1] + 1] - bounds[members[-1]]
        index = []
        for place, e in enumerate(members):
            start, end = bounds[e], bounds[e + 1]
            index.extend(range(start, end))
            index.extend([total] * (width - (end - start)))
            keep[start:end] = range(placed + place * width, placed + place * width + end - start)
        batches.append((index, len(members), width))
        placed += len(members) * width
    return batches, keep


def per_example_calls(row: PackedRow, chunk: int, device: torch.device) -> int:
    """How many calls :func:`run_per_example` makes of a mixer over ``row`` (on ``device``): one per number of
    ``chunk``-token chunks its examples span."""
    return len(row.batches(chunk, device)[0])


def partitioned_by_zero3(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions ``module``'s parameters (they carry ``ds_id``)."""
    return any(hasattr(parameter, "ds_id") for parameter in module.parameters())


def agreed_calls(row: PackedRow, chunk: int, calls: int, module: torch.nn.Module, device: torch.device) -> int | None:
    """Where DeepSpeed ZeRO-3 partitions ``module``: how many calls every rank that gathers its weights makes of a
    mixer (of ``chunk``) over its row, the most any needs (``calls``: this rank's, or a bound on them); ``None``
    elsewhere, with no collective. One all-reduce per row and chunk, at the first mixer: every later layer, and the
    recompute of a checkpointed one, reads it from the row."""
    group = next((getattr(p, "ds_process_group", None) for p in module.parameters() if hasattr(p, "ds_id")), False)
    if group is False:
        return None
    key = ("zero3 calls", chunk)
    if key not in row._groups:
        most = torch.tensor([calls], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        row._groups[key] = int(most.item())
    return row._groups[key]


def tie_in(output: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero that ties ``output`` (of a call on zeros, :func:`equal_calls`) into the graph, so that the
    backward runs through its call too."""
    return output.sum() * 0


def equal_calls(forward: Any, output: torch.Tensor, hidden_states: torch.Tensor, missing: int, width: int,
                **kwargs: Any) -> torch.Tensor:
    """``output`` (the mixer's packed output of ``hidden_states`` ``[1, T, H]``) after ``missing`` more calls of
    ``forward`` (a mixer's own) on one row of ``width`` zero tokens, their outputs added times 0: the calls another rank
    makes and this one did not (:func:`agreed_calls`), in the forward and the backward alike. Exact: each adds 0 (a
    row of zeros stays finite through a mixer). The zeros need a gradient where the row does: ZeRO-3 lets go of a
    module's weights after its backward only through its inputs' gradients."""
    if missing < 0:  # the ranks would stop pairing their gathers: fail here rather than hang
        raise RuntimeError(f"padfree-plugins: a sequence mixer made {-missing} more calls than its ranks agreed on "
                           "under DeepSpeed ZeRO-3; please report this with the row's example lengths")
    zeros = hidden_states.new_zeros((1, width, hidden_states.shape[-1])).requires_grad_(hidden_states.requires_grad)
    for _ in range(missing):
        output = output + tie_in(forward(zeros, **kwargs))
    return output


@dataclass
class MixerState:
    """The cache a mixer's own forward reads and writes on one call over a batch of segments: ``conv`` (``[B, C,
    K]``, the last inputs of each row's conv source) and ``recurrent`` (each row's source's final state), ``None``
    for a fresh start; the call leaves its own final ones in ``final_conv`` and ``final_recurrent``.

    transformers' hybrid mixers read and write their cache through these methods (prefilling from a state is how
    they continue a prompt in ``generate()``). Nothing here is written in place, so autograd carries every
    completion's gradient back into the state of its prompt, and on into the prompt's tokens."""

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None
    final_conv: torch.Tensor | None = None
    final_recurrent: torch.Tensor | None = None
    #: As a segment's handed-on state (:func:`run_ready`): input tokens ``[n, H]`` that a reader runs ahead of its
    #: own from ``final_conv`` / ``final_recurrent``, dropping their outputs. A one-token segment that continues a
    #: state hands on its start state and its token: its own one-token run would take the mixer's decoding step.
    lead: torch.Tensor | None = None
    #: The copies of ``conv`` and ``recurrent`` handed to the mixer: a one-token call of a mixer that steps its state
    #: in place (a decoding step: Kimi's conv, Mamba2's scan) leaves its final state there.
    _given: dict = field(default_factory=dict, repr=False)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._copy("conv")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._copy("recurrent")

    def _copy(self, name: str) -> torch.Tensor | None:
        if getattr(self, name) is not None and name not in self._given:
            self._given[name] = getattr(self, name).clone()
        return self._given.get(name)

    def settle(self) -> MixerState:
        """After the call: its final state, also where the mixer stepped the given one in place."""
        for name, given in self._given.items():
            if getattr(self, f"final_{name}") is None and given._version > 0:
                setattr(self, f"final_{name}", given)
        return self

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # the multi-token path (a conv over state + inputs), never the in-place one-token step

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """The inputs the conv runs over: the state's, then the call's; their last ``conv_kernel_size`` kept."""
        full = conv_states if self.conv is None else torch.cat([self.conv.to(conv_states.dtype), conv_states], -1)
        kernel = conv_kernel_size or full.shape[-1]
        self.final_conv = F.pad(full, (max(kernel - full.shape[-1], 0), 0))[..., -kernel:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int | None = None,
                               state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        self.final_recurrent = recurrent_states
        return recurrent_states


def run_shared(forward: Any, hidden_states: torch.Tensor, row: PackedRow, chunk: int, cache_name: str,
               **kwargs: Any) -> torch.Tensor:
    """``forward`` (a mixer's own, which continues the state of a cache given as ``cache_name``) on every segment of
    the packed ``hidden_states`` ``[1, T, H]`` of a row with shared prefixes (``row.shared``): each segment starts
    from its parent's final state and conv taps (:func:`state_sources`), every segment without one from zeros.

    Segments run once their sources have, down the prefix tree (:func:`run_ready`). A segment whose state others
    read runs unpadded, with segments of its length only (a pad would move its final state); the others, batched
    like :func:`run_per_example`, are right-padded to at least 2 tokens, so that no mixer takes its one-token
    decoding step (which updates the state in place, out of autograd's reach). A one-token prefix that continues a
    state (a tree's branch point) hands its token on to lead each of its children's runs. Each prefix runs once: its
    children's gradients sum into it through the state."""
    bounds = row.cu_seq_lens.long().tolist()
    sources = state_sources(row.shared)
    if len(sources) != len(bounds) - 1:
        raise BoundaryError(f"the shared prefixes name {len(sources)} segments, the boundaries {len(bounds) - 1}")
    read = {source for pair in sources for source in pair if source >= 0}
    outputs: list = [None] * len(sources)
    if run_ready(forward, hidden_states[0], bounds, sources, read, outputs, {}, chunk, cache_name, **kwargs):
        raise BoundaryError(f"the segments' state sources {sources} form a cycle")
    return torch.cat(outputs)[None]


def run_ready(forward: Any, tokens: torch.Tensor, bounds: list[int], sources: Sequence[tuple[Any, Any]],
              read: set[int], outputs: list, finals: dict, chunk: int, cache_name: str, **kwargs: Any) -> list[int]:
    """The segments of ``tokens`` ``[T, H]`` (``bounds``) not yet in ``outputs`` whose state sources have run (or are
    ``-1``, zeros; any other source is a key of ``finals``), run batched as in :func:`run_shared`, until none is
    ready; their outputs written into ``outputs``, the final states of those in ``read`` into ``finals``. Returns
    the segments left pending (their sources not in ``finals``).

    A segment in ``read`` of one token that continues a state is not run for its final state (its one-token run would
    take the mixer's decoding step, which steps the state in place, out of autograd's reach): its handed-on state is
    its start state with its token as ``lead`` (:class:`MixerState`), which each reader runs ahead of its own."""
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    pending = [s for s in range(len(lengths)) if outputs[s] is None]
    padded = None  # tokens and a zero row, gathered from once their first group needs them
    while pending:
        ready = [s for s in pending if all(source == -1 or source in finals for source in sources[s])]
        if not ready:
            return pending
        pending = [s for s in pending if s not in ready]
        groups: dict[tuple, list[int]] = {}
        starts: dict[int, MixerState] = {}
        for s in ready:  # read: one group per length; others: per number of chunks; and by the states they start from
            start = starts[s] = _start_state(finals, sources[s], s)
            ahead = 0 if start.lead is None else start.lead.shape[0]
            recorded = s in read
            if recorded and ahead + lengths[s] == 1 and tuple(sources[s]) != (-1, -1):
                finals[s] = replace(start, lead=tokens[bounds[s]:bounds[s + 1]])
                recorded = False
            size = ahead + lengths[s] if recorded else -(-(ahead + lengths[s]) // chunk)
            key = (recorded, size, start.final_recurrent is not None, start.final_conv is not None)
            groups.setdefault(key, []).append(s)
        for (recorded, _, recurrent, conv), members in sorted(groups.items()):
            runs = [lengths[s] if starts[s].lead is None else starts[s].lead.shape[0] + lengths[s] for s in members]
            width = max(2, *runs) if not recorded else runs[0]
            if all(starts[s].lead is None for s in members):  # one gather, its pads reading the zero row
                if padded is None:
                    padded = F.pad(tokens, (0, 0, 0, 1))
                places = [i for s in members for i in (*range(bounds[s], bounds[s + 1]),
                                                       *[len(tokens)] * (width - lengths[s]))]
                batch = padded.index_select(0, torch.tensor(places, device=tokens.device)).view(len(members), width,
                                                                                                 -1)
            else:
                batch = torch.stack([F.pad(run, (0, 0, 0, width - len(run))) for run in (
                    tokens[bounds[s]:bounds[s + 1]] if starts[s].lead is None else torch.cat([
                        starts[s].lead, tokens[bounds[s]:bounds[s + 1]]]) for s in members)])
            state = None
            if recorded or recurrent or conv:
                state = MixerState(conv=_stacked([starts[s].final_conv for s in members]) if conv else None,
                                   recurrent=_stacked([starts[s].final_recurrent for s in members]) if recurrent
                                   else None)
            output = forward(batch, **kwargs, **({cache_name: state} if state is not None else {}))
            if not isinstance(output, torch.Tensor):
                raise BoundaryError(f"a sequence mixer returned {type(output).__name__}, not a tensor: "
                                    "padfree_plugins cannot put its segments back into the packed row")
            if state is not None:
                state.settle()
            for index, (s, run) in enumerate(zip(members, runs)):
                outputs[s] = output[index, run - lengths[s]:run]
                if recorded:
                    finals[s] = MixerState(final_conv=_row_of(state.final_conv, index),
                                           final_recurrent=_row_of(state.final_recurrent, index))
    return []


def _start_state(finals: dict, sources: tuple[Any, Any], segment: int) -> MixerState:
    """The state a segment starts from: its recurrent source's final recurrent state, its conv source's final conv
    taps (``-1``: none), and the lead tokens of a source that hands on one (both sources must then be that one)."""
    recurrent, conv = (finals[source] if source != -1 else MixerState() for source in sources)
    lead = recurrent.lead if recurrent.lead is not None else conv.lead
    if lead is not None and sources[0] != sources[1]:
        raise BoundaryError(f"segment {segment} continues a one-token segment's state in part only (its sources "
                            f"{tuple(sources)}): the one token cannot lead its run")
    return MixerState(final_conv=conv.final_conv, final_recurrent=recurrent.final_recurrent, lead=lead)


def _stacked(states: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The sources' states as a batch; ``None`` where a mixer keeps no such state (LFM2: conv taps only)."""
    return None if any(state is None for state in states) else torch.stack(states)


def _row_of(state: torch.Tensor | None, index: int) -> torch.Tensor | None:
    return None if state is None else state[index]


@cache
def missing_packages(packages: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``packages`` (import names) that are not installed."""
    return tuple(name for name in packages if importlib.util.find_spec(name) is None)


def check_mixer_backend(requested: str, family: str, kernels: tuple[str, ...]) -> None:
    """Refuse, when the model is patched, a ``mixers: kernels`` this family or machine cannot honour."""
    if requested not in MIXER_BACKENDS:
        raise BackendUnavailableError(f"unknown mixer backend {requested!r}; use one of {', '.join(MIXER_BACKENDS)}")
    if requested != "kernels":
        return
    if not kernels:
        raise BackendUnavailableError(
            f"{family}: its sequence mixers have no boundary-aware kernel route (no installed package takes the "
            "example boundaries for them), so mixers: kernels cannot keep examples apart; use mixers: exact or auto")
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"mixers: kernels runs {family}'s mixers through CUDA kernels ({', '.join(kernels)}), and this machine "
            "has no CUDA device; use mixers: exact (or auto) on a CPU")
    if missing := missing_packages(kernels):
        raise BackendUnavailableError(
            f"mixers: kernels for {family} needs {', '.join(missing)} installed (pip names: "
            f"{', '.join(PIP_NAMES.get(name, name) for name in missing)}); or use mixers: exact")


def note_unused_mixer_backend(requested: str, family: str, patch: Any) -> None:
    """Warn that a ``mixers:`` other than ``auto`` does nothing where the model's patch routes no sequence mixer
    through :class:`MixerPatch` (a model of attention alone, such as Llama, or a family that keeps its mixers apart
    its own way)."""
    if requested == "auto" or any(isinstance(handle, MixerPatch) for handle in getattr(patch, "handles", ())):
        return
    warnings.warn(f"mixers: {requested} has no effect on {family}: its plugin runs no sequence mixer through a mixer "
                  "backend (only the hybrid families' gated delta rule, KDA and Mamba mixers); remove mixers from the "
                  "config", stacklevel=3)


#: Import name -> the distribution to install.
PIP_NAMES = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}


def sequence_mixers(model: Any) -> list[tuple[Any, Any]]:
    """``(module, forward)`` of every sequence mixer a plugin patched into ``model``: the packed forwards, set on the
    instance, that are marked ``packed_sequence_mixer`` (gated delta rule, Mamba, short convolution)."""
    found = []
    for module in model.modules():
        method = module.__dict__.get("forward")  # the module's own forward, not a hook's answer
        if getattr(method, "packed_sequence_mixer", False):
            found.append((module, method))
    return found


@dataclass
class PackedMixer:
    """A sequence mixer's forward: packed calls restart it at every example (see the module docstring); other calls
    run the module's own forward. A plain object, so that the model still pickles."""

    module: Any
    original: Any
    backend: str
    kernels: tuple[str, ...]
    chunk: int = 1  # the chunk the mixer's torch code pads every call to (see run_per_example)
    #: Why the mixer cannot start a completion from its prompt's state ("" where it can: see run_shared).
    no_prompt_state: str = ""
    #: Runs along the sequence: under sequence parallelism it gets the whole row (modeling.sequence_parallel).
    packed_sequence_mixer: ClassVar[bool] = True

    def _arguments(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name, ``**kwargs`` merged in (the signature read once, not pickled)."""
        signature = self.__dict__.get("_signature")
        if signature is None:
            signature = self.__dict__["_signature"] = inspect.signature(self.original)
        inputs = signature.bind(*args, **kwargs).arguments
        inputs.update(inputs.pop("kwargs", {}))
        return inputs

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_signature"}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        row = PACKED_ROW.get()
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None and row is None:
            if PACKED_CALL.get():
                raise BoundaryError(f"{type(self.module).__name__} was called without the example boundaries during "
                                    "a packed forward: it would run across examples")
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():  # one graph break per mixer call: its examples' lengths steer the run
            return _run_packed_eagerly(self, row, cu, args, kwargs)
        return self._run_packed(row, cu, args, kwargs)

    def _run_packed(self, row: PackedRow | None, cu: torch.Tensor | None, args: tuple, kwargs: dict) -> Any:
        inputs = self._arguments(args, kwargs)
        if row is None or (cu is not None and cu is not row.cu_seq_lens):
            row = PackedRow(cu, inputs.get(SHARED_PREFIXES_KEY))
        hidden_states = inputs.pop("hidden_states", None)
        if hidden_states is None or hidden_states.ndim != 3 or hidden_states.shape[0] != 1:
            raise BoundaryError(f"{type(self.module).__name__} got a packed call without a [1, T, H] hidden_states")
        if hidden_states.shape[1] != row.total:
            raise BoundaryError(f"{type(self.module).__name__}: {hidden_states.shape[1]} tokens, but the boundaries "
                                f"describe {row.total}")
        for name in ("cache_params", "past_key_values"):
            if inputs.get(name) is not None:
                raise BoundaryError("a packed row with a cache: a sequence mixer's state would span examples; run "
                                    "packed rows without a cache (use_cache=False)")
        if row.shared is not None:
            return self._run_shared(hidden_states, row, inputs)
        device, alone = hidden_states.device, {name: value for name, value in inputs.items() if name not in ROW_KEYS}
        kernels = self.uses_kernels(device)
        calls = 1 if kernels else per_example_calls(row, self.chunk, device)
        # On every route: another rank's row may take another (a shared row runs exact).
        most = agreed_calls(row, self.chunk, calls, self.module, device)
        if kernels:
            output = self.original(hidden_states, **{**inputs, "cu_seq_lens_q": row.cu_seq_lens.to(device),
                                                     "seq_idx": row.seq_idx(device)})
        else:
            output = run_per_example(self.original, hidden_states, row, self.chunk, **alone)
        return output if most is None else equal_calls(self.original, output, hidden_states, most - calls,
                                                       self.chunk, **alone)

    def _run_shared(self, hidden_states: torch.Tensor, row: PackedRow, inputs: dict) -> torch.Tensor:
        """A row with shared prefixes: every completion continues its prompt's state (:func:`run_shared`), in the
        mixer's torch code (the kernels route does not carry a prompt's state yet)."""
        name = type(self.module).__name__
        if self.no_prompt_state:
            raise BoundaryError(f"{name} cannot start a completion from its prompt's state ({self.no_prompt_state}): "
                                "set prefix_sharing: off for this model")
        if self.backend == "kernels":
            raise BoundaryError(f"{name}: mixers: kernels does not yet start a completion from its prompt's state; "
                                "use mixers: auto or exact with shared prefixes (or prefix_sharing: off)")
        if self.uses_kernels(hidden_states.device):
            warnings.warn(f"{name}: rows with shared prefixes run their sequence mixers exact (torch code), not "
                          "through the CUDA kernels, which do not yet start a completion from its prompt's state",
                          stacklevel=2)
        cache_name = self.cache_name()
        if cache_name is None:
            raise BoundaryError(f"{name}'s forward takes no cache ({' or '.join(CACHE_NAMES)}), so it cannot start "
                                "from a prompt's state: set prefix_sharing: off for this model")
        alone = {key: value for key, value in inputs.items() if key not in ROW_KEYS and key not in CACHE_NAMES}
        # At most one call per segment (each call runs one or more): what the ranks agree on under ZeRO-3.
        most = agreed_calls(row, self.chunk, len(row.cu_seq_lens) - 1, self.module, hidden_states.device)
        if most is None:
            return run_shared(self.original, hidden_states, row, self.chunk, cache_name, **alone)
        calls = []
        output = run_shared(partial(_counted, self.original, calls), hidden_states, row, self.chunk, cache_name,
                            **alone)
        return equal_calls(self.original, output, hidden_states, most - len(calls), self.chunk, **alone)

    def cache_name(self) -> str | None:
        """The name under which the mixer's own forward takes a cache (the state it continues), or ``None``."""
        parameters = inspect.signature(self.original).parameters
        return next((name for name in CACHE_NAMES if name in parameters), None)

    def uses_kernels(self, device: torch.device) -> bool:
        """Whether this call runs the packed row through the boundary-aware kernels (see the module docstring)."""
        if self.backend == "exact":
            return False
        if self.backend == "kernels":
            if device.type != "cuda":
                raise BackendUnavailableError(f"mixers: kernels is CUDA-only; {type(self.module).__name__} runs on "
                                              f"{device.type}. Use mixers: exact (or auto) there")
            return True
        return bool(self.kernels) and device.type == "cuda" and not missing_packages(self.kernels)


def _counted(forward: Any, calls: list, *args: Any, **kwargs: Any) -> Any:
    calls.append(None)
    return forward(*args, **kwargs)


@torch.compiler.disable
def _run_packed_eagerly(mixer: PackedMixer, row: PackedRow | None, cu: torch.Tensor | None, args: tuple,
                        kwargs: dict) -> Any:
    """:meth:`PackedMixer._run_packed` outside the compiled graph: the per-example run reads the examples' lengths on
    the host, and the kernels are custom ops; the graph breaks once here, and the eager call takes every length
    without a recompile."""
    return mixer._run_packed(row, cu, args, kwargs)


def why_no_prompt_state(model: Any, backend: str = "auto") -> str | None:
    """Why a completion's sequence mixers in ``model`` cannot start from its prompt's state (so that prompts cannot be
    shared), or ``None`` (also for a model without sequence mixers). ``backend``: the config's ``mixers``."""
    for module, mixer in sequence_mixers(model):
        if reason := getattr(mixer, "no_prompt_state", ""):
            return f"its {type(module).__name__} cannot start a completion from its prompt's state ({reason})"
        if backend == "kernels" and isinstance(mixer, PackedMixer):
            return ("mixers: kernels does not yet start a completion's sequence mixers from its prompt's state "
                    "(use mixers: auto or exact)")
    return None


def mixer_chunk(model: Any) -> int:
    """The chunk ``model``'s sequence mixers pad every run of a shared row to (the largest; 1 without mixers): what a
    prefix must save to be shared (:func:`~padfree_plugins.packing.prefixes.prefix_tree`)."""
    return max((getattr(mixer, "chunk", 1) for _, mixer in sequence_mixers(model)), default=1)


def run_in_row(row: PackedRow, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with ``row`` published in :data:`PACKED_ROW`."""
    token = PACKED_ROW.set(row)
    try:
        return function(*args, **kwargs)
    finally:
        PACKED_ROW.reset(token)


@dataclass
class RowCheckpoint:
    """A layer's gradient-checkpointing function for one packed forward: the layer runs with the packed row
    published both in the forward and when the backward pass recomputes it (outside the forward), so that mixers
    that get no boundaries from their layer (Jamba, Mamba) still restart at every example."""

    checkpoint: Any
    row: PackedRow

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint(partial(run_in_row, self.row, function), *args, **kwargs)


@dataclass
class MixerPatch:
    """Sequence mixers' forwards replaced on their instances and the packed row published to them; in
    ``patch.handles``: ``remove()`` restores everything."""

    model: Any
    saved: list = field(default_factory=list)
    hooks: list = field(default_factory=list)
    calls: list = field(default_factory=list, repr=False)  # per forward: its context token, the layers it wrapped
    #: the modules that can checkpoint (transformers sets ``gradient_checkpointing`` on them), found once
    checkpointed: list = field(default_factory=list, repr=False)

    @classmethod
    def install(cls, model: Any, mixers: list[Any], backend: str, kernels: tuple[str, ...],
                chunk: Any = lambda module: 1, no_prompt_state: str = "") -> MixerPatch:
        """``chunk(module)``: the chunk each mixer's torch code pads its calls to; ``no_prompt_state``: why the
        mixers cannot start from a prompt's state ("" where they can)."""
        checkpointed = [layer for layer in model.modules() if hasattr(layer, "gradient_checkpointing")]
        patch = cls(model, checkpointed=checkpointed)
        for module in mixers:
            patch.saved.append((module, own_attribute(module, "forward")))
            module.forward = PackedMixer(module, module.forward, backend, kernels, chunk(module), no_prompt_state)
        for module in dict.fromkeys((model, getattr(model, "base_model", model))):  # Mamba's head keeps the boundaries
            patch.hooks.append(module.register_forward_pre_hook(patch._publish_row, with_kwargs=True))
            patch.hooks.append(module.register_forward_hook(patch._withdraw_row, with_kwargs=True, always_call=True))
        return patch

    def _publish_row(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A forward given boundaries publishes its packed row, to its layers' recomputation too, and runs without
        a cache; one given none keeps the row of the forward around it (a task's computation calling the base
        model)."""
        cu = kwargs.get("cu_seq_lens_q")
        row = PACKED_ROW.get()
        if cu is not None and (row is None or row.cu_seq_lens is not cu):  # the base model's call reuses the head's
            row = PackedRow(cu, kwargs.get(SHARED_PREFIXES_KEY))
        wrapped = self._checkpoint_in_row(row) if row is not None else []
        self.calls.append((PACKED_ROW.set(row), wrapped))  # taken back by _withdraw_row, on an error too
        return without_cache(module, args, kwargs) if cu is not None else None

    def _checkpoint_in_row(self, row: PackedRow) -> list:
        wrapped = []
        for layer in self.checkpointed:
            function = layer.__dict__.get("_gradient_checkpointing_func")
            if getattr(layer, "gradient_checkpointing", False) is True and function is not None and not isinstance(
                    function, RowCheckpoint):
                wrapped.append((layer, own_attribute(layer, "_gradient_checkpointing_func")))
                layer._gradient_checkpointing_func = RowCheckpoint(function, row)
        return wrapped

    def _withdraw_row(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self.calls:
            token, wrapped = self.calls.pop()
            PACKED_ROW.reset(token)
            for layer, function in reversed(wrapped):
                restore_attributes(layer, {"_gradient_checkpointing_func": function})

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for module, forward in reversed(self.saved):
            restore_attributes(module, {"forward": forward})
        self.saved.clear()
        self.hooks.clear()
