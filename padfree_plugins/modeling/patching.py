"""Patch a transformers model to run padding-free, and undo it.

A patch does these things, all reversible:

1. switches the model's attention implementation to ``padfree_<backend>`` (see
:mod:`padfree_plugins.modeling.attention`);
2. installs a guard on the base model that refuses packed rows without boundaries (positions that restart inside
   a row with no ``cu_seq_lens_q``): without it such a row would silently attend across examples; a packed row
   neither reads a KV cache (one is refused) nor returns one (``use_cache`` is turned off for it: a cache of the
   whole packed row would mix its examples in any later generation); a model whose own head pools one token per row
   (``*ForSequenceClassification``) refuses a packed row in its own forward (:func:`check_per_row_head`);
3. for tasks that compute per example inside the model's forward (classification, rerankers, embeddings:
   :meth:`ModelPatch.route_compute`), lets ``model(padfree_compute=fn)`` run ``fn`` as the forward, through
   every wrapper (DDP, FSDP, peft, accelerate's autocast).

The ``padfree_<backend>`` name stays in transformers' attention registry after ``undo`` (the registry has no
public way to remove a name); for a call without boundaries it behaves exactly as sdpa.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from padfree_plugins.contract.declarations import Architecture, AttentionBackend
from padfree_plugins.errors import BoundaryError, PadfreeError, UnsupportedArchitectureError
from padfree_plugins.modeling import attention
from padfree_plugins.modeling.attention import PACKED_CALL
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, SharedPrefixes

PATCH_ATTRIBUTE = "_padfree_patch"
#: The keyword of the model's forward that runs a task's computation instead (see :meth:`ModelPatch.route_compute`).
COMPUTE_KEYWORD = "padfree_compute"
logger = logging.getLogger("padfree_plugins")



def unwrap_model(model: Any) -> Any:
    """The transformers ``PreTrainedModel`` inside peft, DDP / FSDP, ``torch.compile`` and similar wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft PeftModel
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):  # DDP
            model = model.module
        elif isinstance(model, torch.nn.Sequential) and len(model) and hasattr(model[0], "auto_model"):
            model = model[0].auto_model  # sentence-transformers: the transformers model of its Transformer module
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is not a transformers PreTrainedModel (nor a peft / DDP / "
            "sentence-transformers wrapper of one)"
        )
    return model


def bound_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name, ``**kwargs`` merged in (``kwargs`` as given if ``args`` do not bind)."""
    if not args:
        return kwargs
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return kwargs
    arguments = dict(bound.arguments)
    for name, parameter in bound.signature.parameters.items():  # GPT-NeoX passes input_ids positionally: the
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:       # boundaries then sit inside ``**kwargs``
            arguments.update(arguments.pop(name, {}))
    return arguments


def _check_boundary_types(cu: Any, cu_k: Any) -> None:
    for name, value in (("cu_seq_lens_q", cu), ("cu_seq_lens_k", cu_k)):
        if value is not None and not (isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel() >= 2
                                      and not value.is_floating_point()):
            raise BoundaryError(f"{name} must be a 1-D integer tensor of boundaries 0, L1, L1+L2, …, T; got "
                                f"{type(value).__name__} {getattr(value, 'shape', '')}".rstrip())


#: Devices whose boundaries are checked on the host in an eager forward (a read there costs no device sync).
HOST_CHECKED_DEVICES = ("cpu",)


def _check_packed_boundaries(cu: Any, cu_k: Any, position_ids: torch.Tensor, sequence: Any = None) -> None:
    """Boundaries built by hand must be what the collator builds: a 1-D integer tensor ``0, L1, …, T`` whose
    examples are where ``position_ids`` restart. Checked on the host in an eager forward on the CPU (free there,
    with a message that shows the boundaries); on an accelerator, and in a compiled forward anywhere, by
    :func:`_assert_packed_boundaries` (no host read, no graph break). Under sequence parallelism (``sequence``, a
    :class:`~padfree_plugins.modeling.attention.ulysses.SequenceGroup`) the boundaries describe the group's whole
    row and ``position_ids`` this rank's slice of it: the restarts inside the slice are checked (on the host)."""
    _check_boundary_types(cu, cu_k)
    if position_ids.ndim != 2:
        return
    host = cu.device.type in HOST_CHECKED_DEVICES and position_ids.device.type in HOST_CHECKED_DEVICES
    if sequence is None and (torch.compiler.is_compiling() or not host):
        _assert_packed_boundaries(cu, cu_k, position_ids)
        return
    if not host:
        return
    total = position_ids.shape[-1]
    restarts = torch.nonzero(position_ids[0, 1:] != position_ids[0, :-1] + 1).flatten() + 1
    if sequence is not None:
        _check_slice_boundaries(cu, cu_k, restarts, total, sequence)
        return
    expected = torch.cat([torch.zeros(1, dtype=torch.long), restarts, torch.tensor([total])])
    if not torch.equal(cu.long(), expected) or (cu_k is not None and not torch.equal(cu_k.long(), cu.long())):
        raise BoundaryError(
            f"cu_seq_lens_q {cu.tolist()[:8]} does not match the packed row: position_ids restart at "
            f"{expected.tolist()[:8]} (T={total}); attention would cross examples. Build packed batches with "
            "padfree_plugins' collator"
        )


def _assert_packed_boundaries(cu: torch.Tensor, cu_k: Any, position_ids: torch.Tensor) -> None:
    """:func:`_check_packed_boundaries` in a compiled forward: the same check as tensor ops ending in one
    ``torch._assert_async`` (no host read, no graph break, on any device), which fails the forward with a
    ``RuntimeError`` when the boundaries are not where ``position_ids`` restart (or ``cu_seq_lens_k`` differs)."""
    if cu_k is not None and cu_k.shape != cu.shape:
        raise BoundaryError(f"cu_seq_lens_k {tuple(cu_k.shape)} must equal cu_seq_lens_q {tuple(cu.shape)} in a "
                            "packed row; attention would cross examples")
    positions, cu = position_ids[0], cu.long()
    total = positions.shape[0]
    restarts = torch.cat([positions.new_ones(1, dtype=torch.bool), positions[1:] != positions[:-1] + 1])
    starts = torch.zeros_like(restarts).index_fill(0, cu[:-1].clamp(0, max(total - 1, 0)), True)
    valid = (cu[0] == 0) & (cu[-1] == total) & (cu.diff() > 0).all() & (restarts == starts).all()
    if cu_k is not None:
        valid = valid & (cu_k.long() == cu).all()
    torch._assert_async(valid, BOUNDARY_MISMATCH)


#: The message of a packed row whose boundaries are not where its position_ids restart.
BOUNDARY_MISMATCH = ("padfree-plugins: cu_seq_lens_q does not match the packed row (its examples must start exactly "
                     "where position_ids restart, 0 … T); attention would cross examples. Build packed batches with "
                     "padfree_plugins' collator")


def _check_slice_boundaries(cu: torch.Tensor, cu_k: Any, restarts: torch.Tensor, local: int, sequence: Any) -> None:
    """A rank's slice of a sequence-parallel row: ``local`` tokens, the ``sequence.rank``-th of ``sequence.size``
    equal slices of the row the boundaries describe; position ids restart exactly at the boundaries inside it."""
    cu = cu.long()
    if int(cu[-1]) != local * sequence.size:
        raise BoundaryError(
            f"a sequence-parallel forward got {local} tokens on each of {sequence.size} ranks, but cu_seq_lens_q "
            f"describes a row of {int(cu[-1])}: each rank takes its slice of the group's row, as "
            "assembly.forward cuts it (padfree_plugins.packing.sequence_parallel.slice_row)")
    start = sequence.rank * local
    inside = cu[(cu > start) & (cu < start + local)] - start
    if not torch.equal(inside, restarts.long()) or (cu_k is not None and not torch.equal(cu_k.long(), cu)):
        raise BoundaryError(
            f"cu_seq_lens_q does not match rank {sequence.rank}'s slice of the sequence-parallel row: its examples "
            f"start at {inside.tolist()[:8]} inside the slice, its position_ids restart at {restarts.tolist()[:8]}; "
            "attention would cross examples")


def _check_shared_prefixes(cu: Any, cu_k: Any, position_ids: torch.Tensor, shared: Any, sequence: Any) -> None:
    """A packed row with shared prefixes (:mod:`padfree_plugins.packing.prefixes`): one parent per segment, the keys
    each segment attends to exactly its ancestors' tokens and its own, and positions that restart at every segment
    without a parent and continue its parent's end in every other (checked on the host only, as the boundaries).
    Under sequence parallelism (``sequence``) the boundaries and the structure describe the group's whole row and
    ``position_ids`` this rank's slice: the slices' positions are gathered (one all-gather) and the whole row checked,
    so a completion whose parent sits in another rank's slice is checked against that parent's end."""
    _check_boundary_types(cu, cu_k)
    if cu_k is not None and cu_k.device.type == cu.device.type == "cpu" and not torch.equal(cu_k.long(), cu.long()):
        raise BoundaryError("a shared row carries its keys' boundaries in shared_prefixes: cu_seq_lens_k must equal "
                            "cu_seq_lens_q")
    if not isinstance(shared, SharedPrefixes):
        raise BoundaryError(f"shared_prefixes must be a padfree_plugins.packing.prefixes.SharedPrefixes; got "
                            f"{type(shared).__name__}")
    if len(shared.parents) != cu.numel() - 1:
        raise BoundaryError(f"shared_prefixes names parents for {len(shared.parents)} segments, but cu_seq_lens_q "
                            f"holds {cu.numel() - 1}")
    if cu.device.type != "cpu" or position_ids.device.type != "cpu" or position_ids.ndim != 2:
        return
    if sequence is not None:
        position_ids = _joined_positions(cu, position_ids, sequence)
    bounds, positions = cu.long().tolist(), position_ids[0].tolist()
    if bounds[0] != 0 or bounds[-1] != len(positions) or any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise BoundaryError(f"cu_seq_lens_q {bounds[:8]} does not split the packed row of {len(positions)} tokens "
                            "into non-empty segments")
    expected = SharedPrefixes.build([e - b for b, e in zip(bounds, bounds[1:])], shared.parents)
    if not (torch.equal(shared.key_index.cpu(), expected.key_index) and
            torch.equal(shared.cu_seq_lens_k.cpu().long(), expected.cu_seq_lens_k.long())):
        raise BoundaryError("shared_prefixes' keys are not each segment's ancestors' and its own tokens: attention "
                            "would cross examples. Build the structure with SharedPrefixes.build")
    for segment, (start, end, parent) in enumerate(zip(bounds, bounds[1:], shared.parents)):
        inside = positions[start:end]
        if inside != list(range(inside[0], inside[0] + len(inside))):
            raise BoundaryError(f"segment {segment} of a shared row: its position_ids restart inside it "
                                f"({inside[:8]}); attention would cross examples")
        if parent >= 0 and inside[0] != positions[bounds[parent + 1] - 1] + 1:
            raise BoundaryError(f"segment {segment} of a shared row starts at position {inside[0]}, but it continues "
                                f"segment {parent}, which ends at {positions[bounds[parent + 1] - 1]}: a completion's "
                                "positions continue from its prompt's end")
        if parent < 0 and start > 0 and inside[0] == positions[start - 1] + 1:
            raise BoundaryError(f"segment {segment} of a shared row has no parent but its positions continue the "
                                f"previous segment's ({positions[start - 1]} → {inside[0]}): they restart at every "
                                "example")


def text_positions(position_ids: Any) -> Any:
    """The text-position row ``[1, T]`` of a packed multimodal row's ``position_ids`` ``[4, 1, T]`` (transformers'
    layout for Qwen-VL mRoPE: the text positions first, which restart at every example, then the three rotary rows);
    any other value as it is. Three rotary rows without the text row are refused: nothing would say where the
    examples start."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 3:
        return position_ids
    if position_ids.shape[0] == 4 and position_ids.shape[1] == 1:
        return position_ids[0]
    raise BoundaryError(
        f"position_ids of shape {tuple(position_ids.shape)} in a packed row: a packed multimodal row carries "
        "[4, 1, T] — the text positions (restarting at every example) first, then the three mRoPE rows — as "
        "padfree_plugins' multimodal collator builds them")


def _joined_positions(cu: torch.Tensor, position_ids: torch.Tensor, sequence: Any) -> torch.Tensor:
    """The positions ``[1, T]`` of a sequence-parallel group's row, of which ``position_ids`` is this rank's slice:
    the slices all-gathered (every rank of the group checks the same row, so all refuse a wrong one alike)."""
    local = position_ids.shape[-1]
    if int(cu[-1]) != local * sequence.size:
        raise BoundaryError(
            f"a sequence-parallel forward got {local} tokens on each of {sequence.size} ranks, but cu_seq_lens_q "
            f"describes a row of {int(cu[-1])}: each rank takes its slice of the group's row, as "
            "assembly.forward cuts it (padfree_plugins.packing.sequence_parallel.slice_row)")
    import torch.distributed as dist

    pieces = [torch.empty_like(position_ids) for _ in range(sequence.size)]
    dist.all_gather(pieces, position_ids.contiguous(), group=sequence.group)
    return torch.cat(pieces, dim=1)


def check_boundaries(module: torch.nn.Module, args: tuple, kwargs: dict, sequence: Any = None) -> bool:
    """Raise :class:`BoundaryError` on a packed row that lacks its boundaries (or carries a mask or a KV cache);
    return whether the call is packed. ``sequence``: the model's sequence-parallel group, if any (a packed call then
    carries this rank's slice of the group's row)."""
    inputs = bound_inputs(module, args, kwargs)
    position_ids = inputs.get("position_ids")
    attention_mask = inputs.get("attention_mask")
    tokens = inputs.get("input_ids")
    tokens = inputs.get("inputs_embeds") if tokens is None else tokens
    if inputs.get("cu_seq_lens_q") is not None:
        position_ids = text_positions(position_ids)
        for name, value in (("input_ids", inputs.get("input_ids")), ("position_ids", position_ids)):
            if isinstance(value, torch.Tensor) and value.ndim != 2:
                raise BoundaryError(f"{name} of shape {tuple(value.shape)}; a packed batch is one row [1, T], as the "
                                    "collator builds it: keep the batch dimension")
        if tokens is not None and tokens.shape[0] != 1:
            raise BoundaryError(f"a packed batch is one row [1, T]; got {tokens.shape[0]} rows with cu_seq_lens_q")
        if attention_mask is not None:
            shape = tuple(getattr(attention_mask, "shape", ()))
            raise BoundaryError(
                f"a packed batch must not carry an attention_mask (got one of shape {shape}): its boundaries "
                "(cu_seq_lens_q) replace it, and no mask (all ones, padded or shorter) can describe a packed row. "
                "Drop the key (batch.model_inputs() never includes it)"
            )
        if inputs.get("past_key_values") is not None:
            raise BoundaryError(
                f"a packed batch cannot use a KV cache (got past_key_values={type(inputs['past_key_values']).__name__}"
                "): its examples would all continue one cache. Call a packed row without past_key_values; to "
                "generate, use model.generate() (or a cache) on ordinary, unpacked inputs"
            )
        if position_ids is None:
            raise BoundaryError(
                "a packed batch needs position_ids restarting at every example; without them positions would "
                "run on across examples. Use padfree_plugins' collator."
            )
        shared = inputs.get(SHARED_PREFIXES_KEY)
        if shared is not None:
            _check_shared_prefixes(inputs["cu_seq_lens_q"], inputs.get("cu_seq_lens_k"), position_ids, shared,
                                   sequence)
        else:
            _check_packed_boundaries(inputs["cu_seq_lens_q"], inputs.get("cu_seq_lens_k"), position_ids, sequence)
        return True
    if position_ids is None or position_ids.ndim != 2 or position_ids.shape[-1] < 2:
        return False
    if attention_mask is not None and attention_mask.ndim != 2:
        return False  # a custom 4D mask states the structure itself
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:
        rows, total = position_ids.shape
        if attention_mask.shape[0] != rows or attention_mask.shape[1] < total:
            if bool(restarts.any()):
                raise BoundaryError(
                    f"{type(module).__name__} got an attention_mask of shape {tuple(attention_mask.shape)} for "
                    f"position_ids of shape {(rows, total)} that restart inside a row: the mask does not cover the "
                    "tokens, and a packed row needs none. Pack with padfree_plugins' collator (cu_seq_lens_q, no "
                    "mask), or pass an ordinary padded batch with a mask of its input_ids' shape."
                )
            return False  # not packed: transformers judges the mask
        real = attention_mask[:, -total:].bool()  # longer with a KV cache: its last columns are these tokens
        restarts &= real[:, 1:] & real[:, :-1]
    if bool(restarts.any()):
        raise BoundaryError(
            f"{type(module).__name__} got position_ids that restart inside a row but no cu_seq_lens_q: this looks "
            "like several examples packed into one row without their boundaries, and attention would mix them. "
            "Pack with padfree_plugins' collator (it adds cu_seq_lens_q / max_length_q), or pass an ordinary "
            "padded batch."
        )
    return False


#: Class-name endings of transformers heads that pool one token per *row*: on a packed row they would return one
#: result for all of its examples.
PER_ROW_HEADS = ("ForSequenceClassification",)


def check_per_row_head(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse a packed row (``cu_seq_lens_q`` given) in the forward of a model whose head pools one token per row
    (``*ForSequenceClassification``): it would return one result for all the examples of the row."""
    if not type(model).__name__.endswith(PER_ROW_HEADS):
        return
    cu = bound_inputs(model, args, kwargs).get("cu_seq_lens_q")
    if cu is None:
        return
    count = f"{cu.numel() - 1} examples" if isinstance(cu, torch.Tensor) else "several examples"
    raise BoundaryError(
        f"{type(model).__name__}'s own forward pools one token per row, and a packed row holds {count}: it would "
        "return one result for all of them. Run it as assembly.forward(model, batch) (tasks seq_cls and reranker "
        "apply the head to every example), or pass an ordinary padded batch"
    )


def _use_cache_parameter(cls: type) -> tuple[bool, int | None]:
    """Whether ``cls.forward`` takes ``use_cache``, and its position among the arguments after ``self`` (``None``
    when keyword-only); read per call, as :func:`bound_inputs` reads the signature (``torch.compile`` traces it)."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False, None
    for index, parameter in enumerate(parameters):
        if parameter.name == "use_cache":
            positional = parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            return True, index if positional else None
    return False, None


def without_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a packed call with ``use_cache=False`` wherever the forward takes it: transformers
    defaults ``use_cache`` to ``config.use_cache`` (True for most decoders), and a cache of a packed row would hold
    every example of the row as one sequence, for any later generation to continue."""
    takes, index = _use_cache_parameter(type(module))
    if "use_cache" not in kwargs and index is not None and index < len(args):
        return (*args[:index], False, *args[index + 1:]), kwargs
    if takes or "use_cache" in kwargs:
        return args, {**kwargs, "use_cache": False}
    return args, kwargs


@contextmanager
def guarded_call(model: torch.nn.Module, inputs: Mapping[str, Any]) -> Iterator[None]:
    """The guard of :class:`ModelPatch` for a caller that runs ``model.forward(**inputs)`` directly (which skips the
    model's hooks, where the guard sits): the inputs are checked, and during a packed call attention refuses a
    layer that lost the boundaries."""
    token = PACKED_CALL.set(check_boundaries(model, (), dict(inputs)))
    try:
        yield
    finally:
        PACKED_CALL.reset(token)


@dataclass
class ForwardOrCompute:
    """A model's forward that runs ``padfree_compute(model)`` instead when given it (see
    :meth:`ModelPatch.route_compute`); a plain object, so that the model still pickles."""

    model: Any
    previous: Any = None  # an instance forward someone installed before the route

    @property
    def __wrapped__(self) -> Any:
        """The model's own forward: ``inspect.signature`` shows its parameters (Trainer and TRL read them)."""
        return type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, padfree_compute: Callable | None = None, **kwargs: Any) -> Any:
        if padfree_compute is not None:
            return padfree_compute(self.model)
        check_per_row_head(self.model, args, kwargs)  # also when a wrapper calls .forward itself (peft), past hooks
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)


@dataclass
class ModelPatch:
    """A model made padding-free; :meth:`undo` restores it exactly."""

    model: Any
    architecture: Architecture
    backend: AttentionBackend
    fallback: AttentionBackend | None
    implementation: str
    previous_implementation: str | None
    handles: list[RemovableHandle] = field(default_factory=list)
    active: bool = True
    attention_dropout: bool = True
    compute_route: ForwardOrCompute | None = field(default=None, repr=False)
    attention_config: str | None = None
    #: The sequence-parallel group whose row a packed call holds a slice of (set by
    #: :class:`~padfree_plugins.modeling.sequence_parallel.SequenceParallelPatch`); ``None``: whole rows.
    sequence: Any = None
    _call_tokens: list = field(default_factory=list, repr=False)

    @classmethod
    def apply(cls, model: Any, architecture: Architecture, backend: AttentionBackend,
              fallback: AttentionBackend | None = None, *, attention_dropout: bool = True,
              has_attention: bool = True, attention_config: str | None = None) -> "ModelPatch":
        """Patch ``model``; ``attention_dropout=False`` runs attention without probability dropout;
        ``has_attention=False``: an attention-free model (Mamba), of which only the guard is installed;
        ``attention_config``: the sub-config whose attention runs packed (a vision-language model's
        ``"text_config"``: its vision tower keeps its own implementation)."""
        model = unwrap_model(model)
        if getattr(model, PATCH_ATTRIBUTE, None) is not None:
            raise PadfreeError(f"{type(model).__name__} is already patched; undo the first patch before patching again")
        config = model.config if attention_config is None else getattr(model.config, attention_config)
        previous = config._attn_implementation if has_attention else None
        name = config._attn_implementation
        if has_attention:
            name = attention.register(backend, fallback, attention_dropout, architecture.kind == "decoder")
            model.set_attn_implementation(name if attention_config is None else {attention_config: name})
        if config._attn_implementation != name:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so its "
                "attention cannot be made padding-free by this plugin; it needs an architecture plugin of its own "
                "(see docs/writing-a-plugin.md)"
            )
        base = getattr(model, "base_model", model)
        patch = cls(model, architecture, backend, fallback, name, previous, attention_dropout=attention_dropout,
                    attention_config=attention_config)
        patch.handles.append(base.register_forward_pre_hook(patch._before_forward, with_kwargs=True))
        patch.handles.append(base.register_forward_hook(patch._after_forward, with_kwargs=True, always_call=True))
        if base is not model and type(model).__name__.endswith(PER_ROW_HEADS):
            patch.handles.append(model.register_forward_pre_hook(check_per_row_head, with_kwargs=True))
        setattr(model, PATCH_ATTRIBUTE, patch)
        return patch

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Guard the inputs, mark packed calls in :data:`PACKED_CALL` for attention to check, and run packed calls
        without a KV cache (:func:`without_cache`)."""
        self._call_tokens.append(PACKED_CALL.set(False))  # pushed first: the after-hook pops it even on error
        if check_boundaries(module, args, kwargs, self.sequence):
            PACKED_CALL.set(True)
            return without_cache(module, args, kwargs)
        return None

    def _after_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Restore :data:`PACKED_CALL` as it was before this forward (runs even when the forward raised)."""
        if self._call_tokens:
            PACKED_CALL.reset(self._call_tokens.pop())

    def __setstate__(self, state: dict) -> None:
        """Unpickled in another process (a DataLoader or encode worker): register the attention implementation the
        model names there too (the registry is per process)."""
        self.__dict__.update(state)
        if self.active:
            attention.register(self.backend, self.fallback, self.attention_dropout, self.architecture.kind == "decoder")

    def route_compute(self) -> None:
        """Make ``model(padfree_compute=fn)`` return ``fn(model)``, with every other call unchanged.

        A task that computes per example (its own pooling and heads over the packed base model) then runs *as the
        forward* of every wrapper around the model, which therefore does around it what it does around a forward:
        DDP prepares the gradient all-reduce, accelerate's mixed precision autocasts. Installed on the instance at
        assembly, under any wrapper added later (accelerate's autocast wraps it), and removed by :meth:`undo`.
        """
        if self.compute_route is not None:
            return
        previous = self.model.__dict__.get("forward")  # an instance forward someone installed before us, kept
        if previous is not None:
            logger.warning(
                "padfree-plugins: %s.forward was already replaced on the instance (accelerator.prepare does so for "
                "mixed precision): per-example computations run outside that wrapper, without its autocast; "
                "assemble the model before accelerator.prepare", type(self.model).__name__)
        self.compute_route = ForwardOrCompute(self.model, previous)
        self.model.forward = self.compute_route

    def _remove_compute_route(self) -> None:
        if self.compute_route is None:
            return
        if self.model.__dict__.get("forward") is self.compute_route:  # a wrapper installed over it since stays
            restore_attributes(self.model, {"forward": self.compute_route.previous or MISSING})
        self.compute_route = None

    def undo(self) -> None:
        """Restore the previous attention implementation and remove the guard. Safe to call twice."""
        if not self.active:
            return
        for handle in reversed(self.handles):  # last installed first: a handle may patch over an earlier one's
            handle.remove()
        self.handles.clear()
        self._remove_compute_route()
        if self.previous_implementation is not None:
            previous = self.previous_implementation
            self.model.set_attn_implementation(previous if self.attention_config is None else
                                               {self.attention_config: previous})
        if getattr(self.model, PATCH_ATTRIBUTE, None) is self:
            delattr(self.model, PATCH_ATTRIBUTE)
        self.active = False

    def describe(self) -> dict[str, Any]:
        """What was patched, for logs and the CLI."""
        attention_modules = sorted({type(m).__name__ for m in self.model.modules() if hasattr(m, "is_causal")})
        return {
            "model": type(self.model).__name__,
            "architecture": self.architecture.name,
            "attn_implementation": f"{self.previous_implementation} -> {self.implementation}",
            "backend": self.backend.name + (f" (fallback {self.fallback.name})" if self.fallback else ""),
            "attention_modules": attention_modules,
            "guard": type(getattr(self.model, "base_model", self.model)).__name__,
            "active": self.active,
        }


def patch_of(model: Any) -> ModelPatch | None:
    """The active patch of a model (or of the model inside a wrapper), if any."""
    try:
        return getattr(unwrap_model(model), PATCH_ATTRIBUTE, None)
    except UnsupportedArchitectureError:
        return None


#: Marks an attribute an object did not have in its own ``__dict__`` before a patch set it.
MISSING = object()


def own_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own instance attribute ``name`` (not its class's), or :data:`MISSING` — what a patch saves."""
    return obj.__dict__.get(name, MISSING)


def restore_attributes(obj: Any, saved: dict[str, Any]) -> None:
    """Undo instance-attribute patches: put back saved values, delete those that were :data:`MISSING`."""
    for name, value in saved.items():
        if value is MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, value)
