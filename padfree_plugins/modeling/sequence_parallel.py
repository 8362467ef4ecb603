"""Sequence parallelism (Ulysses) on an assembled model: the ranks of a group train one packed row, each computing
its own contiguous slice of the tokens.

* :func:`sequence_group` — the default process group cut into groups of ``size`` consecutive ranks (DP × SP:
  ranks ``0 … size-1`` share a row, then the next ``size``);
* :class:`SequenceParallelPatch` — on a patched model: attention through
  :class:`~padfree_plugins.modeling.attention.ulysses.UlyssesAttention` (all-to-all, sequence -> heads and back),
  every sequence mixer of the model's plugin (gated delta rule, Mamba, short convolution: the forwards marked
  ``packed_sequence_mixer``) run on this rank's slice with the state passed between ranks
  (:class:`~padfree_plugins.modeling.split_mixers.SplitMixer`, ``sequence_parallel.mixers: split``) or on the whole
  row (:class:`WholeRowMixer`: ``gather``, and Mamba1, which cannot start from a state), and the guard checking each
  rank's slice; ``remove()`` (in ``patch.handles``) undoes it;
* :class:`PlanBalance` — under balanced all-gather attention, a forward pre-hook on the base model that plans the
  row's balanced causal work once per forward, for every layer;
* :class:`SliceRow` — for a vision-language model, a forward pre-hook on its language model: the model gets the
  group's whole image-text row (every rank embeds it and merges the whole row's image features, each rank's vision
  tower having encoded only its own micro-batch's media: :mod:`~padfree_plugins.modeling.tower_share`), and its
  language model takes this rank's slice of the merged embeddings and positions;
* :class:`SequenceParallelForward` — the assembly's forward under sequence parallelism: the group's micro-batches
  exchanged into one row (:func:`gather_rows`, an image-text row's media with it), shifted, padded and sliced
  (:mod:`padfree_plugins.packing.sequence_parallel`), this rank's slice through the model; for evaluation's
  metrics, :meth:`SequenceParallelForward.own_tokens` gathers the group's output slices back into the row and cuts
  out this rank's own micro-batch; a task that pools whole examples (``seq_cls``, ``embedding``, ``reranker``, on
  encoders and decoders) goes through :meth:`SequenceParallelForward.pooled`: the base on the slice (an encoder's
  attention is bidirectional over each whole example: Ulysses gives every rank all the row's tokens for its heads),
  this rank's own micro-batch's last hidden states brought from the slices that computed them (one all-to-all,
  differentiable: :func:`own_rows`), the task's pooling, head and loss on them (each rank's loss is its own
  examples', as under data parallelism; the exchange's backward sends each token's gradient to the slice that
  computed it).

The loss: each rank's loss is the sum over its slice's tokens divided by ``num_items_in_batch``. A caller that
counts the labels of every rank's micro-batch and sums them over all ranks (HF ``Trainer`` with
``average_tokens_across_devices``, the plain loop of ``examples/accelerate_loop.py``) and multiplies the loss by the
number of processes before ``backward`` (DDP averages gradients) trains exactly as one process on the global
batch: every token is in one slice, so the DP all-reduce sums the slices' gradients. Without a count the
forward divides by its group's label count and multiplies by the group size, which is the per-replica mean.

The MoE load-balancing loss (``output_router_logits``) follows the same convention: the model's ``aux_loss`` (its
slice's) is replaced by this rank's share of the group row's (:mod:`padfree_plugins.modeling.router_aux`), in
``aux_loss`` and in the loss; the shares sum over the group to one process's value and gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.modeling import attention
from padfree_plugins.modeling.attention import BALANCE_PLAN_KWARG
from padfree_plugins.modeling.attention.ulysses import SequenceGroup, gather_sequence
from padfree_plugins.modeling.heads import FAMILY_INPUT_KEYS, run_base
from padfree_plugins.modeling.mixers import PACKED_ROW, sequence_mixers
from padfree_plugins.modeling.patching import ModelPatch, own_attribute, restore_attributes, unwrap_model
from padfree_plugins.modeling.router_aux import RouterAux
from padfree_plugins.modeling.split_mixers import SplitMixer, partitioned_by_zero3, why_not_split, zero3_refusal
from padfree_plugins.modeling.tower_share import install_tower_share, kept_media, media_counts, media_shares
from padfree_plugins.packing.batch import PackedBatch, packed_tokens
from padfree_plugins.packing.sequence_parallel import CU_KEYS, DROPPED_KEYS, MAX_KEYS, is_rotary_rows, is_token_key, \
    join_rows, padded_length, slice_row

#: How sequence mixers run under sequence parallelism (``sequence_parallel.mixers``).
MIXER_MODES = ("split", "gather")

__all__ = ["MIXER_MODES", "PlanBalance", "SequenceGroup", "SequenceParallelForward", "SequenceParallelPatch",
           "SliceRow", "SplitMixer", "WholeRowMixer", "gather_rows", "language_model", "sequence_group"]


def sequence_group(size: int) -> SequenceGroup:
    """This rank's sequence-parallel group of ``size`` consecutive ranks. Every rank must call it (``new_group`` is
    collective), as ``assemble`` does on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"sequence_parallel.size: {size} needs torch.distributed initialised: launch with torchrun "
                          "or accelerate launch, and assemble after the process group exists (after TrainingArguments "
                          "or Accelerator())")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ConfigError(f"sequence_parallel.size: {size} does not divide the {world} processes: each group of "
                          f"{size} ranks shares one row, so the number of processes must be a multiple of {size}")
    if size == world:
        return SequenceGroup(None, rank, size)
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return SequenceGroup(mine, rank % size, size)


@dataclass
class WholeRowMixer:
    """A sequence mixer's packed forward run on the whole row of the group: the ranks' slices of its input gathered,
    the mixer's own packed forward on them (every example restarted, as without sequence parallelism), this rank's
    slice of the output kept. Exact; each rank computes the mixer on the whole row (the attention layers are the
    ones split)."""

    forward: Any
    group: SequenceGroup
    packed_sequence_mixer: ClassVar[bool] = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seq_lens_q") is None and PACKED_ROW.get() is None:
            return self.forward(*args, **kwargs)  # an ordinary call: padded, generate()
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        output = self.forward(gather_sequence(hidden, self.group), *args, **kwargs)
        if isinstance(output, tuple):
            return (self._local(output[0]), *output[1:])
        return self._local(output)

    def _local(self, output: torch.Tensor) -> torch.Tensor:
        return output[:, self.group.slice_of(output.shape[1])]


#: Keys a language model takes that describe the whole row (never sliced): the boundaries, Gemma 3's image blocks.
ROW_STRUCTURE_KEYS = (*CU_KEYS, *MAX_KEYS, "block_sequence_ids")


@dataclass
class SliceRow:
    """Forward pre-hook of a vision-language model's language model under sequence parallelism: a packed call (its
    boundaries given) arrives with the whole row's merged embeddings — the model embedded the group's whole row and
    filled the placeholders with every rank's image features (:class:`~padfree_plugins.modeling.tower_share.
    TowerShare`) — and goes on with this rank's slice of them:
    ``inputs_embeds``, ``position_ids`` (Qwen's ``[R, 1, T]`` rows along their last axis) and every other per-token
    input ``[1, T, ...]`` cut to :meth:`SequenceGroup.slice_of`, the row's structure (boundaries, image blocks) kept
    whole, as attention reads it after its all-to-all. The backward of the cut sends each rank's slice's gradient to
    the merged embeddings alone, so each rank's embedding gradients are its slice's share, which the data-parallel
    all-reduce sums over the group (as for a text row's embeddings); the image features' gradient is summed over the
    group by their gather. Qwen3-VL's deepstack features (one per
    visual token, added at ``visual_pos_masks``) keep the slice's visual tokens."""

    group: SequenceGroup

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        embeds = kwargs.get("inputs_embeds")
        if kwargs.get("cu_seq_lens_q") is None or embeds is None:
            return None  # an ordinary call (padded, generate()): as before
        if args:
            raise PadfreeError(f"{type(module).__name__} was called with positional arguments under sequence "
                               "parallelism; the slice of its row is cut from keyword arguments only")
        total = embeds.shape[1]
        cut = self.group.slice_of(total)
        sliced = dict(kwargs)
        for key, value in kwargs.items():
            if key in ROW_STRUCTURE_KEYS or not isinstance(value, torch.Tensor):
                continue
            if is_token_key(value, total):
                sliced[key] = value[:, cut]
            elif is_rotary_rows(key, value, total):
                sliced[key] = value[..., cut]
        masks, deepstack = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
        if deepstack is not None and masks is not None:
            visual = torch.cumsum(masks.reshape(-1).long(), 0) - 1
            keep = visual[cut][masks.reshape(-1)[cut]]
            sliced["deepstack_visual_embeds"] = [features.index_select(0, keep) for features in deepstack]
        return args, sliced


@dataclass(frozen=True)
class PlanBalance:
    """Forward pre-hook of a decoder's base model under balanced all-gather attention (``sequence_parallel.balance``
    ``auto`` or ``zigzag``): a packed call (its boundaries given) gets its row's
    :class:`~padfree_plugins.modeling.attention.context_parallel.BalancePlan` in its kwargs
    (:data:`~padfree_plugins.modeling.attention.BALANCE_PLAN_KWARG`), made once from the boundaries — the one host
    read of the boundaries in the forward — and handed by the model to every attention layer with the boundaries
    (gradient checkpointing's recompute keeps a layer's kwargs, so it reuses the plan too)."""

    layout: Any

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens is None:
            return None  # an ordinary call (padded, generate()): as before
        return args, {**kwargs, BALANCE_PLAN_KWARG: self.layout.plan(cu_seq_lens)}


def language_model(model: Any) -> Any:
    """A vision-language model's language model (the module its base model hands the merged embeddings), or
    ``None``."""
    base = getattr(unwrap_model(model), "base_model", model)
    found = getattr(base, "language_model", None)
    return found if isinstance(found, torch.nn.Module) else None


@dataclass
class SequenceParallelPatch:
    """Sequence parallelism installed on a patched model (see the module docstring); ``remove()`` undoes it."""

    patch: ModelPatch
    group: SequenceGroup
    implementation: str | None = None
    saved: list = field(default_factory=list)
    hooks: list = field(default_factory=list)

    @classmethod
    def install(cls, patch: ModelPatch, group: SequenceGroup, layout: Any = None, mixers: str = "split",
                whole_rows: bool = False) -> SequenceParallelPatch:
        """``layout``: how attention sees the row (an :class:`~padfree_plugins.modeling.attention.context_parallel.
        AttentionLayout`; ``None``: Ulysses over the group). ``mixers``: ``split`` (each rank's slice only, the state
        passed between ranks: :mod:`~padfree_plugins.modeling.split_mixers`; the whole row, with a warning, for a mixer
        that cannot start from a state) or ``gather`` (:class:`WholeRowMixer` for every mixer). ``whole_rows``: a
        vision-language model, given whole image-text rows: its language model takes this rank's slice
        (:class:`SliceRow`), and each rank's vision tower encodes its own media
        (:func:`~padfree_plugins.modeling.tower_share.install_tower_share`)."""
        if mixers not in MIXER_MODES:
            raise ConfigError(f"sequence_parallel.mixers: {mixers!r} is not one of {', '.join(MIXER_MODES)}")
        model = patch.model
        if mixers == "split":
            refuse_split_under_zero3(model)
        installed = cls(patch, group)
        if whole_rows:
            text_model = language_model(model)
            if text_model is None:
                raise ConfigError(f"{type(model).__name__} names no language_model, where sequence parallelism cuts "
                                  "an image-text row after the image features are merged: train it with "
                                  "sequence_parallel.size: 1")
            installed.hooks.append(text_model.register_forward_pre_hook(SliceRow(group), with_kwargs=True))
            shared_tower = install_tower_share(model, group, patch.handles)
            if shared_tower is not None:
                installed.hooks.append(shared_tower)
        if patch.previous_implementation is not None:  # a model with attention (not Mamba)
            installed.implementation = attention.register(patch.backend, patch.fallback, patch.attention_dropout,
                                                          patch.architecture.kind == "decoder",
                                                          sequence=layout or group)
            installed._set_implementation(installed.implementation)
            if layout is not None and layout.balances and patch.architecture.kind == "decoder":
                base = getattr(model, "base_model", model)
                installed.hooks.append(base.register_forward_pre_hook(PlanBalance(layout), with_kwargs=True))
        unsplit = {}
        for module, mixer in sequence_mixers(model):
            if isinstance(mixer, (WholeRowMixer, SplitMixer)):
                continue
            installed.saved.append((module, own_attribute(module, "forward")))
            reason = why_not_split(mixer) if mixers == "split" else "sequence_parallel.mixers: gather"
            if reason:
                unsplit.setdefault(type(module).__name__, reason)
                module.forward = WholeRowMixer(mixer, group)
            else:
                module.forward = SplitMixer(mixer, group)
        if mixers == "split" and unsplit:
            why = "; ".join(f"{name}: {reason}" for name, reason in unsplit.items())
            warnings.warn(f"sequence_parallel.mixers: split: these sequence mixers cannot start from another rank's "
                          f"state, so every rank runs them on the whole row (gathered), which saves less memory: {why}",
                          stacklevel=3)
        patch.sequence, patch.whole_rows = group, whole_rows
        return installed

    def _set_implementation(self, name: str) -> None:
        config = self.patch.attention_config
        self.patch.model.set_attn_implementation(name if config is None else {config: name})

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        for module, forward in reversed(self.saved):
            restore_attributes(module, {"forward": forward})
        self.saved.clear()
        if self.implementation is not None:
            self._set_implementation(self.patch.implementation)
            self.implementation = None
        self.patch.sequence, self.patch.whole_rows = None, False


def refuse_split_under_zero3(model: Any) -> None:
    """Refuse ``sequence_parallel.mixers: split`` on a model DeepSpeed ZeRO-3 shards (configured through transformers,
    or its parameters already partitioned), before anything changes. The two sides of a cut run a mixer's own
    forward a different number of times (the later rank also runs the piece it continues, after receiving the state),
    and ZeRO-3 gathers each submodule's parameters by a collective at every call: the earlier rank waits in a gather
    for the later one, which waits for its state. DeepSpeed's leaf modules (one gather per mixer) fail in the
    backward on these mixers (a gradient against a partitioned weight). A model wrapped after assembly is refused
    at its first split call (:meth:`SplitMixer.run`)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    split = sorted({type(module).__name__ for module, mixer in sequence_mixers(model)
                    if not isinstance(mixer, (WholeRowMixer, SplitMixer)) and not why_not_split(mixer)})
    if split and (is_deepspeed_zero3_enabled() or partitioned_by_zero3(model)):
        raise ConfigError(zero3_refusal(", ".join(split)))


def _signature(batch: Mapping, media: tuple[str, ...] = ()) -> list[tuple]:
    """What every rank's batch must agree on to be exchanged: its keys, dtypes, and shapes past the token axis (the
    ``media`` keys apart: :func:`_media_shapes`)."""
    tokens = packed_tokens(batch)
    signature = []
    for key, value in batch.items():
        if key in media:
            continue
        if isinstance(value, torch.Tensor):
            kind = "token" if is_token_key(value, tokens) else "rotary" if is_rotary_rows(key, value, tokens) \
                else "example"
            trailing = tuple(value.shape[2:] if kind == "token" else value.shape[:2] if kind == "rotary"
                             else value.shape[1:])
            signature.append((key, kind, str(value.dtype), trailing))
        else:
            signature.append((key, type(value).__name__))
    return signature


def _media_shapes(batch: Mapping, media: tuple[str, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The ``media`` keys ``batch`` holds: their dtypes and shapes (a rank without images holds none)."""
    return {key: (str(batch[key].dtype), tuple(batch[key].shape)) for key in media
            if isinstance(batch.get(key), torch.Tensor)}


def gather_rows(batch: Mapping, group: SequenceGroup, dropped: tuple[str, ...] = DROPPED_KEYS,
                media: tuple[str, ...] = (), kept: tuple[str, ...] = ()) -> list[PackedBatch]:
    """Every rank's packed micro-batch of the group, in rank order (this rank's ``batch`` among them): one header
    exchange (token and example counts, one host sync), then one all-gather per key, padded to the largest; the
    keys ``dropped`` left out (by default the labelled logits, recomputed on the slice). ``media``: the keys of an
    image-text row's media (pixels, grids: any number of rows each, absent where a rank's micro-batch has no images),
    exchanged with their own lengths; a rank without one gets it empty. ``kept``: media keys that each rank keeps to
    itself (the pixels a :class:`~padfree_plugins.modeling.tower_share.TowerShare` encodes on their owner's rank
    alone): not exchanged, the other ranks' rows of them zeros of their shape. Multimodal ``position_ids``
    ``[R, 1, T]`` travel along their token axis."""
    batch = {key: value for key, value in batch.items() if key not in dropped}
    signatures: list[Any] = [None] * group.size
    dist.all_gather_object(signatures, (_signature(batch, media), _media_shapes(batch, media)), group=group.group)
    if any(s[0] != signatures[0][0] for s in signatures):
        raise PadfreeError("the ranks of a sequence-parallel group hold batches of different keys, dtypes or shapes; "
                           f"every rank must use the same collator: {[s[0] for s in signatures]}")
    shapes = _agreed_media(signatures)
    device = batch["input_ids"].device
    tokens = packed_tokens(batch)
    examples = int(batch["cu_seq_lens_q"].numel()) - 1
    longest = [int(batch.get(key, -1)) for key in MAX_KEYS]
    header = torch.tensor([tokens, examples, *longest], device=device)
    headers = [torch.empty_like(header) for _ in range(group.size)]
    dist.all_gather(headers, header, group=group.group)
    sizes = [[int(v) for v in h.tolist()] for h in headers]
    rows: list[PackedBatch] = [PackedBatch() for _ in range(group.size)]
    for row in rows:
        row.model_keys = getattr(batch, "model_keys", None)
    for key, value in batch.items():
        if key in media:
            continue
        if key in MAX_KEYS:
            pieces: list[Any] = [size[2 + MAX_KEYS.index(key)] for size in sizes]
        elif not isinstance(value, torch.Tensor):
            pieces = [None] * group.size
            dist.all_gather_object(pieces, value, group=group.group)
        elif key in CU_KEYS:
            pieces = _all_gather_padded(value, [size[1] + 1 for size in sizes], 0, group)
        elif is_token_key(value, tokens):
            pieces = _all_gather_padded(value, [size[0] for size in sizes], 1, group)
        elif is_rotary_rows(key, value, tokens):
            pieces = _all_gather_padded(value, [size[0] for size in sizes], 2, group)
        else:
            pieces = _all_gather_padded(value, [size[1] for size in sizes], 0, group)
        for row, piece in zip(rows, pieces):
            row[key] = piece
    for key, (dtype, trailing, lengths) in shapes.items():
        value = batch.get(key)
        if not isinstance(value, torch.Tensor):
            value = torch.zeros((0, *trailing), dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        if key in kept:  # never read on another rank: stand-ins of their shape
            pieces = [value.to(device) if rank == group.rank else value.new_zeros((length, *trailing), device=device)
                      for rank, length in enumerate(lengths)]
        else:
            pieces = _all_gather_padded(value.to(device), lengths, 0, group)
        for row, piece in zip(rows, pieces):
            row[key] = piece
    for row in rows:  # the joined row's media are model inputs on every rank, one without images of its own too
        if row.model_keys is not None and shapes:
            row.model_keys = tuple(dict.fromkeys((*row.model_keys, *shapes)))
    return rows


def _agreed_media(signatures: list[Any]) -> dict[str, tuple[str, tuple[int, ...], list[int]]]:
    """Per media key any rank holds: its dtype, its shape past the first axis (equal on every rank that holds it),
    and every rank's length along the first axis (0 without it)."""
    agreed: dict[str, tuple[str, tuple[int, ...], list[int]]] = {}
    for _, held in signatures:
        for key, (dtype, shape) in held.items():
            if key in agreed and agreed[key][:2] != (dtype, shape[1:]):
                raise PadfreeError(f"the ranks of a sequence-parallel group hold {key!r} of different dtypes or "
                                   f"shapes past the first axis ({agreed[key][:2]} and {(dtype, shape[1:])}), which "
                                   "one row cannot join; train this model with sequence_parallel.size: 1")
            agreed[key] = (dtype, shape[1:], [])
    for key, (_, _, lengths) in agreed.items():
        lengths.extend(held[key][1][0] if key in held else 0 for _, held in signatures)
    return agreed


def _all_gather_padded(value: torch.Tensor, lengths: list[int], dim: int, group: SequenceGroup) -> list[torch.Tensor]:
    """``value`` of every rank (of ``lengths[r]`` along ``dim``), exchanged padded to the longest and cut back."""
    longest = max(lengths)
    shape = list(value.shape)
    shape[dim] = longest - value.shape[dim]
    padded = torch.cat([value, value.new_zeros(shape)], dim=dim) if shape[dim] else value
    pieces = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(pieces, padded.contiguous(), group=group.group)
    return [piece.narrow(dim, 0, length) for piece, length in zip(pieces, lengths)]


def base_inputs(batch: Mapping) -> PackedBatch:
    """What of a packed ``batch`` the base model of a pooled task reads, for the group's row: the per-token keys,
    the boundaries and the max lengths (with the batch's ``model_keys``). A per-example input of the base (X-MOD's
    ``lang_ids`` per example) cannot be sliced with the tokens: refused."""
    tokens = packed_tokens(batch)
    per_example = [key for key in (*FAMILY_INPUT_KEYS, *(getattr(batch, "model_keys", None) or ()))
                   if key in batch and not is_token_key(batch[key], tokens)]
    if per_example:
        raise PadfreeError(f"sequence parallelism slices a row's per-token inputs; {', '.join(per_example)} holds one "
                           "value per example, which a rank's slice cannot carry: give it per token, or train with "
                           "sequence_parallel.size: 1")
    kept = PackedBatch({key: value for key, value in batch.items()
                        if key in CU_KEYS or key in MAX_KEYS or is_token_key(value, tokens)})
    kept.model_keys = getattr(batch, "model_keys", None)
    return kept


def exchange_plan(sizes: Sequence[int], rank: int, local: int) -> tuple[list[int], list[int]]:
    """For a row of micro-batches of ``sizes`` tokens (one per rank, in row order) cut into slices of ``local``
    tokens: how many tokens of rank ``rank``'s slice each rank owns (what it sends, from the slice's start: the
    owners' ranges follow each other, the padding segment last), and how many of its own tokens each rank's slice
    holds (what it receives, in row order)."""
    starts = [sum(sizes[:q]) for q in range(len(sizes))]

    def overlap(a: int, b: int, c: int, d: int) -> int:
        return max(0, min(b, d) - max(a, c))

    low = rank * local
    sends = [overlap(low, low + local, start, start + size) for start, size in zip(starts, sizes)]
    mine = starts[rank], starts[rank] + sizes[rank]
    receives = [overlap(q * local, (q + 1) * local, *mine) for q in range(len(sizes))]
    return sends, receives


class _OwnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, sends: list[int], receives: list[int], group: SequenceGroup) -> torch.Tensor:
        ctx.sends, ctx.receives, ctx.group, ctx.local = sends, receives, group, hidden.shape[1]
        return _exchange(hidden[0, :sum(sends)], sends, receives, group).unsqueeze(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _exchange(grad[0], ctx.receives, ctx.sends, ctx.group)
        whole = back.new_zeros((ctx.local, *back.shape[1:]))  # the padding segment's tokens: no gradient
        whole[:back.shape[0]] = back
        return whole.unsqueeze(0), None, None, None


def _exchange(rows: torch.Tensor, sends: list[int], receives: list[int], group: SequenceGroup) -> torch.Tensor:
    """``rows`` ``[sum(sends), ...]`` split ``sends`` to the ranks in order; returns ``[sum(receives), ...]``."""
    received = rows.new_empty((sum(receives), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=receives, input_split_sizes=sends,
                           group=group.group)
    return received


def own_rows(hidden: torch.Tensor, sizes: Sequence[int], group: SequenceGroup) -> torch.Tensor:
    """This rank's own micro-batch's tokens ``[1, sizes[rank], ...]`` of the per-token ``hidden`` ``[1, T/N, ...]``
    (this rank's slice of the group's row of micro-batches of ``sizes`` tokens): one all-to-all of uneven parts,
    differentiable (its backward is the reverse exchange)."""
    sends, receives = exchange_plan(sizes, group.rank, hidden.shape[1])
    return _OwnRows.apply(hidden, sends, receives, group)


def join_slices(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The group's row ``[1, T_row, ...]`` of its ranks' slices ``pieces`` (in rank order, the row's order)."""
    return torch.cat(list(pieces), dim=1)


@dataclass
class SequenceParallelForward:
    """The assembly's ``forward`` under sequence parallelism (see the module docstring): ``forward(model, batch,
    **loss_kwargs)`` with this rank's micro-batch ``batch``; ``inner`` is the task's forward. Its other attributes
    are ``inner``'s."""

    inner: Any
    group: SequenceGroup
    pad_token_id: int = 0
    #: The media keys of a vision-language model's rows (its collator's): non-empty, the group's row goes to the model
    #: whole, its targets sliced (:func:`~padfree_plugins.packing.sequence_parallel.slice_row` ``whole``), and the
    #: language model cuts this rank's slice after the image features are merged (:class:`SliceRow`).
    media_keys: tuple[str, ...] = ()
    #: Whether the model's router aux loss was checked to be the load-balancing loss the group reduces (once).
    checked_router_aux: bool = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def slice(self, batch: Mapping, kept: tuple[str, ...] = ()) -> PackedBatch:
        """This rank's slice of the group's row (the exchange of the ranks' micro-batches included); with labelled
        logits only when ``batch`` asked for them (``logits_to_keep``), computed on the slice. Its ``row_tokens``
        are the row's real tokens (the padding segment after them), its ``media_counts`` every rank's count of each
        media key (:func:`~padfree_plugins.modeling.tower_share.media_counts`). ``kept``: the media keys not
        exchanged (:func:`gather_rows`)."""
        labelled = "logits_to_keep" in batch
        rows = gather_rows(batch, self.group, media=self.media_keys, kept=kept)
        row = join_rows(rows)
        local = slice_row(row, self.group.rank, self.group.size, self.pad_token_id, whole=bool(self.media_keys))
        local.row_tokens = packed_tokens(row)
        local.media_counts = media_counts(rows, self.media_keys)
        if labelled and "labels" in local:  # its labels are shifted already: keep the positions that have one
            positions = torch.nonzero(local["labels"][0] != -100).reshape(-1)
            local.update(logits_to_keep=positions, shift_labels=local["labels"][:, positions])
        return local

    def __call__(self, model: Any, batch: Mapping, **kwargs: Any) -> Any:
        if getattr(self.inner, "pools_examples", False):
            return self.pooled(model, batch, **kwargs)
        local = self.slice(batch, kept_media(model, self.media_keys))
        scale = 1
        if kwargs.get("num_items_in_batch") is None and "labels" in local:
            count = (local["labels"] != -100).sum()
            dist.all_reduce(count, group=self.group.group)
            kwargs["num_items_in_batch"] = count
            scale = self.group.size
        with media_shares(getattr(local, "media_counts", {})):  # the vision tower runs on this rank's own media
            outputs = self.inner(model, local, **kwargs)
        if isinstance(outputs, Mapping) and outputs.get("aux_loss") is not None and outputs.get("router_logits"):
            self.share_router_aux(model, local, outputs)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        if scale != 1 and loss is not None:
            outputs["loss"] = loss * scale
        return outputs

    def pooled(self, model: Any, batch: Mapping, **kwargs: Any) -> Any:
        """A task that pools whole examples (``seq_cls``, ``embedding``, ``reranker``; encoders and decoders alike):
        the base model on this rank's slice of the group's row, then this rank's own micro-batch's last hidden states
        brought from the slices that computed them (:meth:`own_hidden`), on which the task's pooling, head and loss
        run as without sequence parallelism.

        What is exchanged is every token of the rank's own examples, not only the ones a pooler reads: every pooling
        (first / CLS, last, mean, max, a head that pools itself, prompts left out) then reads them exactly as on one
        process, and each rank receives about ``T / N`` tokens' hidden states (one all-to-all, not an all-gather of
        the row). Only the keys the base reads are exchanged before (per-token keys and the boundaries); the
        per-example keys (labels, group ids, row and column counts) stay on their rank: each rank's pooled outputs
        and loss are its own micro-batch's, as under data parallelism (an in-batch-negatives loss sees the
        negatives of the rank's own micro-batch)."""
        rows = gather_rows(base_inputs(batch), self.group)
        sizes = [packed_tokens(row) for row in rows]
        local = slice_row(join_rows(rows), self.group.rank, self.group.size, self.pad_token_id)

        def hidden(inner: Any) -> torch.Tensor:
            return self.own_hidden(run_base(inner, local), sizes)

        return self.inner(model, batch, hidden=hidden, **kwargs)

    def own_hidden(self, hidden: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """This rank's own micro-batch's last hidden states ``[1, sizes[rank], H]`` from the slices ``hidden``
        ``[1, T/N, H]`` of the group (``sizes``: every rank's micro-batch's tokens, in row order): each rank sends
        every other rank the part of its slice that rank owns (:func:`own_rows`; differentiable, the gradient goes
        back to the slice that computed each token)."""
        return own_rows(hidden, sizes, self.group)

    def own_tokens(self, outputs: Sequence[tuple[Any, Any]], batch: Mapping) -> list[torch.Tensor]:
        """This rank's own micro-batch's tokens ``[1, T_own, ...]`` of the per-token ``outputs`` (``(name, value)``
        pairs) of its slice ``[1, T_row / N, ...]``: the group's slices all-gathered (rank order is the row's order),
        the padding segment dropped and this rank's micro-batch cut out of the row, as one process computes it on
        that micro-batch alone. ``batch``: this rank's micro-batch. For evaluation: no gradient flows back.

        Every rank of the group must call it with the same names (one exchange of the token counts, then one
        all-gather per output); an output that is not per token of the slice is refused on every rank alike."""
        count = torch.tensor([packed_tokens(batch)], device=batch["input_ids"].device)
        counts = [torch.empty_like(count) for _ in range(self.group.size)]
        dist.all_gather(counts, count, group=self.group.group)
        sizes = [int(c) for c in counts]
        local = padded_length(sum(sizes), self.group.size) // self.group.size
        for name, value in outputs:
            if not is_token_key(value, local):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise PadfreeError(
                    f"sequence_parallel.size: {self.group.size}: the model output {name!r} ({shape}) is not per token "
                    f"of this rank's slice [1, {local}, ...], so it cannot be gathered into the rank's own examples "
                    f"for compute_metrics / predict. Leave it out (trainer.predict(..., ignore_keys=[{name!r}]), "
                    "the same for evaluate) or use sequence_parallel.size: 1")
        start, own = sum(sizes[:self.group.rank]), []
        for _, value in outputs:
            pieces = [torch.empty_like(value) for _ in range(self.group.size)]
            dist.all_gather(pieces, value.contiguous(), group=self.group.group)
            own.append(join_slices(pieces).narrow(1, start, sizes[self.group.rank]))
        return own

    def share_router_aux(self, model: Any, local: PackedBatch, outputs: Any) -> None:
        """``outputs``' ``aux_loss`` (the slice's load-balancing loss) replaced by this rank's share of the group
        row's, in the loss too where the model added it (``loss`` with ``labels``)."""
        owner = unwrap_model(model)
        router = RouterAux.of(owner)
        if router is None:
            raise PadfreeError(f"{type(owner).__name__} returned a router aux loss but names no num_experts_per_tok "
                               "and router_aux_loss_coef: sequence parallelism cannot make the group's. Set "
                               "output_router_logits=False, or train with sequence_parallel.size: 1")
        if not self.checked_router_aux:
            router.check(outputs, type(owner).__name__)
            self.checked_router_aux = True
        slice_tokens = local["labels"].shape[1] if "labels" in local else packed_tokens(local)  # whole inputs too
        real = min(max(getattr(local, "row_tokens", slice_tokens * self.group.size)
                       - self.group.rank * slice_tokens, 0), slice_tokens)
        share = router.share(outputs["router_logits"], real, self.group)
        aux = outputs["aux_loss"]
        if outputs.get("loss") is not None and "labels" in local:
            outputs["loss"] = outputs["loss"] + router.coefficient * (share - aux).to(outputs["loss"].dtype)
        outputs["aux_loss"] = share.to(aux.dtype)
