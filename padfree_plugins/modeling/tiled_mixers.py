"""Sequence mixers scanned in tiles of a packed row (``memory.tile_mixers``), recomputed tile by tile in the backward.

A gated delta rule's (or Mamba2's, KDA's) working set grows with the row: its projections, its conv, its chunked
scan's intermediates, for every token at once while gradient checkpointing recomputes its layer. A
:class:`TiledMixer` runs the mixer over tiles of the row in order, each tile starting from the recurrent state and
conv taps the previous tile handed on — exactly as a rank of a sequence-parallel group continues the previous rank's
slice (:func:`~padfree_plugins.modeling.split_mixers.slice_plan` and
:func:`~padfree_plugins.modeling.mixers.run_ready` plan and run a tile as they do a rank's slice; a row with shared
prefixes hands on its prompts' states the same way). The forward keeps only the mixer's input and the small states
at each cut; the backward recomputes the tiles last to first, each from its saved start state, and hands the
gradient of that state on to the tile before. So the mixer's activations are one tile's.

Exact: every example computes what it computes untiled; only where the scan's chunks cut moves (float rounding,
~1e-7 relative in fp32).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from padfree_plugins.errors import ConfigError, UnsupportedArchitectureError
from padfree_plugins.modeling.mixers import CACHE_NAMES, PACKED_ROW, ROW_KEYS, MixerState, PackedMixer, PackedRow, \
    run_ready, sequence_mixers, state_sources
from padfree_plugins.modeling.patching import own_attribute, restore_attributes
from padfree_plugins.modeling.split_mixers import PREVIOUS_RANK, SlicePlan, partitioned_by_zero3, slice_plan, \
    why_not_split
from padfree_plugins.modeling.tiling import _replayed_rng, _rng_states
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY

#: The tensors of a handed-on state, in order (see :class:`~padfree_plugins.modeling.mixers.MixerState`).
STATE_FIELDS = ("final_conv", "final_recurrent", "lead")


def tile_start(received: MixerState) -> MixerState:
    """The state a tile's first piece continues: the one the previous tile handed on (one place, replaced by a
    deliberate fault in the tests)."""
    return received


def tile_plans(row: PackedRow, tile: int) -> list[SlicePlan]:
    """The plan of every tile of ``row`` (kept on the row: the recompute reuses it)."""
    key = ("tiles", tile)
    if key not in row._groups:
        bounds = row.cu_seq_lens.long().tolist()
        sources = state_sources(row.shared) if row.shared is not None else None
        row._groups[key] = [slice_plan(bounds, start, tile, sources) for start in range(0, bounds[-1], tile)]
    return row._groups[key]


def run_one_tile(forward: Callable, tokens: torch.Tensor, plan: SlicePlan, received: Sequence[MixerState],
                 chunk: int, cache_name: str, kwargs: dict) -> tuple[torch.Tensor, list[MixerState]]:
    """One tile ``tokens`` ``[L, H]``: its output ``[L, H']`` and the states it hands on to the next tile, its
    pieces starting from ``received`` (the states the previous tile handed on, in ``plan.incoming``'s order)."""
    count = len(plan.bounds) - 1
    outputs: list = [None] * count
    finals: dict[Hashable, MixerState] = {}
    for name, state in zip(plan.incoming, received):
        finals[name] = tile_start(state) if name == PREVIOUS_RANK else state
    if run_ready(forward, tokens, list(plan.bounds), plan.sources, plan.read, outputs, finals, chunk, cache_name,
                 **kwargs):
        raise RuntimeError(f"padfree-plugins: a mixer tile's pieces {plan.sources} wait on states no tile hands on")
    return torch.cat(outputs), [finals[here] for _, here in plan.outgoing]


def _flat(states: Sequence[MixerState]) -> list[torch.Tensor | None]:
    return [getattr(state, name) for state in states for name in STATE_FIELDS]


def _states(tensors: Sequence[torch.Tensor | None]) -> list[MixerState]:
    return [MixerState(**dict(zip(STATE_FIELDS, tensors[i:i + len(STATE_FIELDS)])))
            for i in range(0, len(tensors), len(STATE_FIELDS))]


def _leaf(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return tensor.detach().requires_grad_(tensor.is_floating_point())


@dataclass
class _Scan:
    """What a :class:`TiledScan` runs: the mixer's own forward and its arguments, the row's tile plans."""

    forward: Callable
    plans: list[SlicePlan]
    tile: int
    chunk: int
    cache_name: str
    kwargs: dict

    def run(self, index: int, tokens: torch.Tensor, received: Sequence[MixerState]):
        start = index * self.tile
        return run_one_tile(self.forward, tokens[start:start + self.tile], self.plans[index], received, self.chunk,
                            self.cache_name, self.kwargs)


def fingerprint(hidden: torch.Tensor) -> torch.Tensor:
    """Two fixed projections of every token of ``hidden`` ``[T, H]`` (``[T, 2]``, fp32): a recompute's input
    equals a scan's if these are equal (the same for the same values; another row's differ)."""
    width = hidden.shape[-1]
    angles = torch.arange(width, device=hidden.device, dtype=torch.float32)
    weights = torch.stack([torch.cos(angles * 0.731 + 0.1), torch.sin(angles * 1.379 + 0.7)], dim=1)
    return hidden.detach().float() @ weights


def same_input(stash: "_Stash", plans: list[SlicePlan], printed: torch.Tensor) -> bool:
    """Whether a recompute with ``plans`` and input ``printed`` (its :func:`fingerprint`) may take ``stash`` (one
    place, replaced by a deliberate fault in the tests)."""
    return stash.plans == plans and stash.printed.shape == printed.shape and torch.equal(stash.printed, printed)


@dataclass(eq=False)
class _Stash:
    """A scan's output and what its backward needs from its forward, kept for the layer checkpoint's recompute."""

    plans: list[SlicePlan]
    printed: torch.Tensor
    output: torch.Tensor | None
    version: int
    kept: list[torch.Tensor]
    present: list[list[bool]]
    rng: list


@dataclass
class Stashes:
    """The stashes of one mixer's scans whose autograd nodes live (held weakly: a stash goes with its node)."""

    live: list = field(default_factory=list)

    def add(self, stash: _Stash) -> _Stash:
        self.live = [ref for ref in self.live if ref() is not None] + [weakref.ref(stash)]
        return stash

    def take(self, plans: list[SlicePlan], hidden: torch.Tensor) -> _Stash | None:
        """The stash of a scan of the same input with the same tiles (its output then given up), or ``None``."""
        stashes = [ref() for ref in self.live]
        stashes = [s for s in stashes if s is not None and s.output is not None and s.output._version == s.version]
        if not stashes:
            return None
        printed = fingerprint(hidden)
        for stash in stashes:
            if same_input(stash, plans, printed):
                self.live = [ref for ref in self.live if ref() is not None and ref() is not stash]
                return stash
        return None


class TiledScan(torch.autograd.Function):
    """A mixer over the tiles of ``hidden`` ``[T, H]`` (see the module docstring); ``params``: the tensors the mixer
    reads besides its input that need gradients; ``stashes``: the mixer's :class:`Stashes` (``None``: keep none).
    The forward saves the input and the states at every cut; where a stash of the same input lives (a checkpoint's
    recompute), it returns the stash's output and saves its states instead of scanning again."""

    @staticmethod
    def forward(ctx, scan: _Scan, stashes: Stashes | None, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.scan, ctx.params, ctx.stash = scan, params, None
        stash = stashes.take(scan.plans, hidden) if stashes is not None else None
        if stash is not None:
            output, stash.output = stash.output, None
            ctx.rng, ctx.present = stash.rng, stash.present
            ctx.save_for_backward(hidden, *stash.kept)
            return output
        outputs, cuts, ctx.rng, received = [], [], [], []
        for index in range(len(scan.plans)):
            ctx.rng.append(_rng_states(hidden.device))
            cuts.append(_flat(received))
            output, received = scan.run(index, hidden, received)
            outputs.append(output)
        ctx.present = [[tensor is not None for tensor in flat] for flat in cuts]
        kept = [tensor for flat in cuts for tensor in flat if tensor is not None]
        ctx.save_for_backward(hidden, *kept)
        output = torch.cat(outputs)
        if stashes is not None:
            ctx.stash = stashes.add(_Stash(scan.plans, fingerprint(hidden), output.detach(), output._version, kept,
                                           ctx.present, ctx.rng))
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        scan, params = ctx.scan, ctx.params
        hidden, *kept = ctx.saved_tensors
        ctx.stash = None  # the recompute took it, or none came
        kept = iter(kept)
        cuts = [[next(kept) if present else None for present in flat] for flat in ctx.present]
        trained = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[2] else None
        param_grads: list[Any] = [None] * len(trained)
        handed: list[torch.Tensor | None] = []  # the gradients of the states the current tile hands on
        for index in reversed(range(len(scan.plans))):
            start = index * scan.tile
            size = min(scan.tile, hidden.shape[0] - start)
            with _replayed_rng(ctx.rng[index], hidden.device), torch.enable_grad():
                piece = hidden.narrow(0, start, size).detach().requires_grad_(grad_hidden is not None)
                leaves = [_leaf(t) for t in cuts[index]]
                output, sent = run_one_tile(scan.forward, piece, scan.plans[index], _states(leaves), scan.chunk,
                                            scan.cache_name, scan.kwargs)
                outs, grads = [output], [grad_output.narrow(0, start, size)]
                leaf_grads: dict[int, torch.Tensor] = {}
                for tensor, grad in zip(_flat(sent), handed):
                    if tensor is None or grad is None:
                        continue
                    if any(tensor is leaf for leaf in leaves):  # a state relayed through the tile unchanged
                        position = next(i for i, leaf in enumerate(leaves) if leaf is tensor)
                        leaf_grads[position] = grad if position not in leaf_grads else leaf_grads[position] + grad
                    elif tensor.requires_grad:
                        outs.append(tensor)
                        grads.append(grad)
                wanted = [i for i, leaf in enumerate(leaves) if leaf is not None and leaf.requires_grad]
                targets = ([piece] if grad_hidden is not None else []) + [leaves[i] for i in wanted] + trained
                got = list(torch.autograd.grad(outs, targets, grads, allow_unused=True)) if targets else []
            if grad_hidden is not None:
                first = got.pop(0)
                if first is not None:
                    grad_hidden.narrow(0, start, size).copy_(first)
            state_grads: list[torch.Tensor | None] = [None] * len(leaves)
            for i in wanted:
                state_grads[i] = got.pop(0)
            for i, grad in leaf_grads.items():
                state_grads[i] = grad if state_grads[i] is None else state_grads[i] + grad
            for i, grad in enumerate(got):
                if grad is not None:
                    param_grads[i] = grad if param_grads[i] is None else param_grads[i] + grad
            handed = state_grads
        param_iter = iter(param_grads)
        return (None, None, grad_hidden, *[next(param_iter) if need else None for need in ctx.needs_input_grad[3:]])


def run_tiled(forward: Callable, module: torch.nn.Module, hidden: torch.Tensor, row: PackedRow, tile: int, chunk: int,
              cache_name: str, stashes: Stashes | None = None, **kwargs: Any) -> torch.Tensor:
    """``forward`` (a mixer's own, continuing a cache given as ``cache_name``) over tiles of ``tile`` tokens of the
    packed ``hidden`` ``[1, T, H]`` (see the module docstring); directly tile after tile where no gradient is
    needed; ``stashes``: where its scans keep their outputs for a checkpoint's recompute (``None``: nowhere)."""
    scan = _Scan(forward, tile_plans(row, tile), tile, chunk, cache_name, kwargs)
    params = [p for p in module.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (params or hidden.requires_grad):
        outputs, received = [], []
        for index in range(len(scan.plans)):
            output, received = scan.run(index, hidden[0], received)
            outputs.append(output)
        return torch.cat(outputs)[None]
    return TiledScan.apply(scan, stashes, hidden[0], *params)[None]


@dataclass
class TiledMixer:
    """A packed sequence mixer (``mixer``: a :class:`~padfree_plugins.modeling.mixers.PackedMixer`) run over tiles
    of ``tile`` tokens of a packed row longer than a tile; every other call is ``mixer``'s. Its other attributes are
    ``mixer``'s; ``stashes``: its scans' outputs kept for a checkpoint's recompute."""

    mixer: PackedMixer
    tile: int
    warned: dict = field(default_factory=dict, compare=False, repr=False)
    stashes: Stashes = field(default_factory=Stashes, compare=False, repr=False)
    packed_sequence_mixer: ClassVar[bool] = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("mixer", "tile", "warned", "stashes"):
            raise AttributeError(name)
        return getattr(self.mixer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        row, cu = PACKED_ROW.get(), kwargs.get("cu_seq_lens_q")
        if cu is None and row is None:
            return self.mixer(*args, **kwargs)
        return _run_tiled_eagerly(self, row, cu, args, kwargs)

    def run(self, row: PackedRow | None, cu: torch.Tensor | None, args: tuple, kwargs: dict) -> Any:
        mixer = self.mixer
        inputs = mixer._arguments(args, kwargs)
        hidden = inputs.get("hidden_states")
        if cu is not None and (row is None or cu is not row.cu_seq_lens):
            row = PackedRow(cu, inputs.get(SHARED_PREFIXES_KEY))
        if (hidden is None or hidden.ndim != 3 or hidden.shape[0] != 1 or row is None
                or hidden.shape[1] != row.total or hidden.shape[1] <= self.tile
                or any(inputs.get(name) is not None for name in CACHE_NAMES)):
            return mixer._run_packed(row, cu, args, kwargs)  # untiled: short rows; its own errors for bad calls
        if mixer.uses_kernels(hidden.device):
            if not self.warned:
                self.warned["kernels"] = True
                warnings.warn(f"{type(mixer.module).__name__}: memory.tile_mixers: the packed row runs through the "
                              "CUDA kernels (mixers: auto), which scan it whole, untiled; set mixers: exact to tile "
                              "it (slower), or memory.tile_mixers: false to silence this", stacklevel=3)
            return mixer._run_packed(row, cu, args, kwargs)
        if partitioned_by_zero3(mixer.module):  # partitioned after assembly: refused before any gather
            raise UnsupportedArchitectureError(zero3_refusal(type(mixer.module).__name__))
        alone = {key: value for key, value in inputs.items()
                 if key not in ROW_KEYS and key not in CACHE_NAMES and key != "hidden_states"}
        return run_tiled(mixer.original, mixer.module, hidden, row, self.tile, mixer.chunk, mixer.cache_name(),
                         self.stashes, **alone)


@torch.compiler.disable
def _run_tiled_eagerly(mixer: TiledMixer, row: PackedRow | None, cu: torch.Tensor | None, args: tuple,
                       kwargs: dict) -> Any:
    """:meth:`TiledMixer.run` outside a compiled graph (it plans the tiles from the row's boundaries on the host)."""
    return mixer.run(row, cu, args, kwargs)


def zero3_refusal(names: str) -> str:
    """Why tiled mixers ``names`` cannot run under DeepSpeed ZeRO-3, and what to set instead."""
    return (f"memory.tile_mixers under DeepSpeed ZeRO-3 ({names}): ZeRO-3 gathers a module's partitioned weights by a "
            "collective at each of its calls, and a tiled mixer calls its projections once per tile and per group of "
            "examples in it, a number that differs between ranks whose rows differ (they would wait on each other's "
            "gathers); its tiled recompute does not hold the weights gathered either. Set memory.tile_mixers: false "
            "(the MLP and the loss stay tiled under ZeRO-3), or shard with FSDP2")


def refuse_tiled_mixers_under_zero3(model: torch.nn.Module) -> None:
    """Refuse ``memory.tile_mixers`` on a model with mixers to tile that DeepSpeed ZeRO-3 shards (configured through
    transformers / accelerate, or its parameters already partitioned by ``zero.Init``): called by the assembly
    before the tiles are installed, which then undoes its patch. A model partitioned after assembly is refused at
    its first tiled call (:meth:`TiledMixer.run`)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    tiled = sorted({type(module).__name__ for module, mixer in sequence_mixers(model) if not why_not_tiled(mixer)})
    if tiled and (is_deepspeed_zero3_enabled() or partitioned_by_zero3(model)):
        raise ConfigError(zero3_refusal(", ".join(tiled)))


def why_not_tiled(mixer: Any) -> str:
    """Why a packed sequence mixer cannot be tiled ("" where it can): it must continue a state given through a cache
    (as :mod:`~padfree_plugins.modeling.split_mixers` needs) and run its torch code."""
    if not isinstance(mixer, PackedMixer):
        return f"its packed forward ({type(mixer).__name__}) is not one that tiles yet"
    return why_not_split(mixer)


@dataclass
class MixerTiling:
    """Tiled sequence mixers installed on a model (an instance ``forward`` per module); ``remove()`` undoes it.
    ``untiled``: the mixers left whole, each with the reason."""

    tile: int
    saved: list = field(default_factory=list)
    untiled: dict[str, str] = field(default_factory=dict)

    @classmethod
    def install(cls, model: torch.nn.Module, tile: int) -> "MixerTiling":
        """Tile every packed sequence mixer of ``model`` that can continue a state; say once why any other is not."""
        tiling = cls(tile)
        for module, mixer in sequence_mixers(model):
            if reason := why_not_tiled(mixer):
                tiling.untiled[type(module).__name__] = reason
                continue
            tiling.saved.append((module, own_attribute(module, "forward")))
            module.forward = TiledMixer(mixer, tile)
        for name, reason in tiling.untiled.items():
            warnings.warn(f"memory.tile_mixers: {name} runs untiled ({reason}); its working set grows with the row",
                          stacklevel=3)
        return tiling

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [module for module, _ in self.saved]

    def remove(self) -> None:
        for module, forward in reversed(self.saved):
            restore_attributes(module, {"forward": forward})
        self.saved.clear()


__all__: Sequence[str] = ("TiledMixer", "TiledScan", "MixerTiling", "run_tiled", "tile_plans", "tile_start",
                          "why_not_tiled", "refuse_tiled_mixers_under_zero3", "zero3_refusal")
