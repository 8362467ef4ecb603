"""The padding-free attention implementation registered with transformers' ``AttentionInterface``.

One implementation per backend, named ``padfree_<backend>`` (e.g. ``padfree_exact``), each registered together
with a mask function in ``AttentionMaskInterface``:

* **Packed call** (``cu_seq_lens_q`` in the kwargs, which the model forwards from the batch): attention runs
  inside each example through the backend. No ``[T, T]`` mask is ever built.
* **Ordinary call** (no boundaries: a padded batch, ``generate()``): the mask function builds the usual sdpa
  mask and attention runs as sdpa would, so a patched model gives the results it gave before patching.
  The model-level guard in :mod:`padfree_plugins.modeling.patching` refuses packed rows that lack boundaries.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.contract.declarations import AttentionBackend
from padfree_plugins.errors import BoundaryError
from padfree_plugins.modeling.attention.backends import attend
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_FEATURE, SHARED_PREFIXES_KEY, SharedPrefixes

class ThreadValue(threading.local):
    """A value of this thread (``default`` until set): ``set`` returns the value it replaces, which ``reset``
    restores (nested calls). Unlike a context variable, ``torch.compile`` traces it (and guards on it)."""

    def __init__(self, default: Any = None) -> None:
        self.value = default

    def get(self) -> Any:
        return self.value

    def set(self, value: Any) -> Any:
        previous, self.value = self.value, value
        return previous

    def reset(self, previous: Any) -> None:
        self.value = previous


#: True while a patched model runs a packed batch (set by the guard, reset when the forward ends, even on error).
#: Attention reads it to refuse a call that lost the boundaries on the way: a layer that does not forward
#: ``**kwargs`` to attention would otherwise attend across examples silently. Thread-local, so threads never see
#: each other's calls (a forward holds no ``await``, so async tasks cannot interleave inside one), and traced by
#: ``torch.compile`` (a context variable breaks the graph at every read).
PACKED_CALL = ThreadValue(False)

#: While set (by :func:`record_attention_calls`), every packed attention call appends what it received.
_RECORDED_CALLS = ThreadValue(None)

IMPLEMENTATION_PREFIX = "padfree_"
#: Keyword arguments that change attention semantics in ways no backend here implements.
_UNSUPPORTED_KWARGS = ("position_bias", "alibi_slopes")
#: ``sliding_window`` not passed to attention at all (``None`` passed means no window).
_NOT_PASSED = object()
#: The names models give attention sinks (one learned logit per head in every softmax: gpt-oss's ``s_aux``).
_SINK_KWARGS = ("s_aux", "sinks")
#: The keyword that carries a packed row's bidirectional blocks into attention (``[1, T]``, transformers'
#: ``block_sequence_ids``: an image's tokens one block ``>= 0``, numbered across the row, ``-1`` elsewhere; Gemma 3).
BLOCKS_KWARG = "block_sequence_ids"
#: The backend feature that implements them (passed to its ``varlen`` as ``blocks=``; opt-in, as ``sinks``).
BLOCKS_FEATURE = "bidirectional_blocks"
#: Set (by all-gather sequence parallelism) when a packed call's keys are the group's whole row and its queries one
#: rank's slice of it, the boundaries saying which keys each example's queries see (with shared prefixes, the keys
#: are each segment's already: :meth:`~padfree_plugins.packing.prefixes.SharedPrefixes.slice_keys`).
GATHERED_KEYS = "gathered_keys"
#: The keyword that carries a sequence-parallel row's balance plan into attention (where all-gather attention cuts
#: the row for its balanced causal work, and this rank's route: a
#: :class:`~padfree_plugins.modeling.attention.context_parallel.BalancePlan`), made once per forward from the row's
#: boundaries (:class:`~padfree_plugins.modeling.sequence_parallel.PlanBalance`) and read by every layer.
BALANCE_PLAN_KWARG = "balance_plan"


def implementation_name(backend: AttentionBackend, fallback: AttentionBackend | None = None,
                        attention_dropout: bool = True, default_causal: bool = True) -> str:
    """The transformers ``attn_implementation`` name of one variant, e.g. ``padfree_exact`` or
    ``padfree_varlen_or_exact_nodropout``: every variant has its own name, so models patched differently in one
    process never overwrite each other's function."""
    name = IMPLEMENTATION_PREFIX + backend.name
    if fallback is not None and fallback.name != backend.name:
        name += f"_or_{fallback.name}"
    if not attention_dropout:
        name += "_nodropout"
    return name if default_causal else name + "_bidirectional"


@dataclass(frozen=True)
class AttentionCall:
    """What one packed attention call received (recorded by :func:`record_attention_calls`)."""

    module: str
    causal: bool
    window: int | None
    sinks: bool
    #: The prompts the call's row shares (segments that others continue); 0 without shared prefixes.
    shared_prompts: int = 0
    #: The most prefixes above one segment of the call's row (1: one level of prompts; more: a prefix tree).
    shared_depth: int = 0


@contextmanager
def record_attention_calls() -> Iterator[list[AttentionCall]]:
    """Collect an :class:`AttentionCall` for every packed attention call in the block (the probe reads which
    structure reached attention); thread-local, so other threads are not recorded."""
    calls: list[AttentionCall] = []
    token = _RECORDED_CALLS.set(calls)
    try:
        yield calls
    finally:
        _RECORDED_CALLS.reset(token)


def padfree_mask(*args, attention_mask=None, **kwargs):
    """Mask function. A packed row builds no mask: attention keeps the examples apart itself (structure a model
    adds through its own mask functions is not applied there — a plugin declares it, and the probe measures it
    against the model's own mask). Any other call gets sdpa's mask, the model's own mask functions included (an
    ESM C chain mask; ``None`` where sdpa needs none), as before patching."""
    if PACKED_CALL.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@dataclass
class PadfreeAttention:
    """The attention function for one backend; ``fallback`` runs inputs the backend cannot (e.g. fp32 on a
    bf16-only kernel) when the backend was chosen automatically. An attention module that does not say whether it
    is causal (no ``is_causal``: LayoutLM, Splinter) is taken as ``default_causal`` — the architecture's kind."""

    backend: AttentionBackend
    fallback: AttentionBackend | None = None
    attention_dropout: bool = True
    default_causal: bool = True

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 sliding_window=_NOT_PASSED, softcap=None, **kwargs):
        if sliding_window is _NOT_PASSED:  # a module that keeps its window for its mask only (Qwen2-MoE)
            sliding_window = getattr(module, "sliding_window", None)
        for name in _UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None:
                raise NotImplementedError(
                    f"{type(module).__name__} passes {name!r} to attention, which padfree-plugins does not "
                    "implement; this architecture needs its own plugin (see docs/writing-a-plugin.md)"
                )
        if not self.attention_dropout:
            dropout = 0.0
        sinks = next((kwargs[name] for name in _SINK_KWARGS if kwargs.get(name) is not None), None)
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", self.default_causal) if causal is None else causal)
        cu_seq_lens_q = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens_q is None:
            if PACKED_CALL.get():
                raise BoundaryError(
                    f"{type(module).__name__} was called without the example boundaries during a packed forward: "
                    "a layer of this model does not pass **kwargs on to attention, so it would attend across "
                    "examples. This architecture needs a plugin that implements patch_model (see "
                    "docs/writing-a-plugin.md)."
                )
            return self._ordinary(module, query, key, value, attention_mask, scaling, dropout,
                                  sliding_window, softcap, causal, sinks, bool(kwargs.get("output_attentions")))
        if query.shape[0] != 1:
            raise BoundaryError(
                f"a packed batch must be one row [1, T]; got {query.shape[0]} rows with cu_seq_lens_q. "
                "Use padfree_plugins' collator, which packs every example into a single row."
            )
        if kwargs.get("output_attentions"):
            raise BoundaryError(
                "output_attentions=True on a packed row: padding-free attention never builds the [T, T] weights of "
                "a packed row. Run the examples as an ordinary padded batch to inspect attention weights."
            )
        if key.shape[2] != query.shape[2] and not kwargs.get(GATHERED_KEYS):  # all-gather: a slice's queries
            raise BoundaryError(
                f"{type(module).__name__}: packed queries ({query.shape[2]} tokens) attend to {key.shape[2]} keys "
                "(a KV cache or cross-attention); padding-free packing supports self-attention without cache only"
            )
        cu_seq_lens_k = kwargs.get("cu_seq_lens_k")
        cu_seq_lens_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
        max_q = kwargs.get("max_length_q")
        max_k = kwargs.get("max_length_k", max_q)
        if not torch.compiler.is_compiling() and max_q is None:  # compiled: not read here, so the graph holds
            max_q = max_k = int(cu_seq_lens_q.diff().max())  # no guard on it; a sync: collators always provide it
        recorded = _RECORDED_CALLS.get()
        if recorded is not None:
            shared = kwargs.get(SHARED_PREFIXES_KEY)
            prompts = len({parent for parent in shared.parents if parent >= 0}) if shared is not None else 0
            recorded.append(AttentionCall(type(module).__name__, causal, sliding_window, sinks is not None, prompts,
                                          shared.depth if shared is not None else 0))
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        backend = self._backend_for(q)
        extra = {}
        if sinks is not None:
            if "sinks" not in backend.features:
                raise NotImplementedError(
                    f"{type(module).__name__} uses attention sinks, which the {backend.name!r} attention backend "
                    "does not implement: use attention: auto (which picks one that does) or exact"
                )
            extra["sinks"] = sinks
        blocks = kwargs.get(BLOCKS_KWARG)
        if blocks is not None:
            if BLOCKS_FEATURE not in backend.features:
                raise NotImplementedError(
                    f"{type(module).__name__} is given bidirectional blocks (an image's tokens attend to each other "
                    f"both ways), which the {backend.name!r} attention backend does not implement: use attention: "
                    "auto (which picks one that does) or exact"
                )
            extra["blocks"] = blocks.reshape(-1)
        shared = kwargs.get(SHARED_PREFIXES_KEY)
        if shared is not None and blocks is not None:
            extra.pop("blocks")
            out = _shared_with_blocks(module, backend, shared, q, k, v, causal, blocks.reshape(-1), scale=scaling,
                                      window=sliding_window, softcap=softcap, dropout=dropout, **extra)
            return out.unsqueeze(0), None
        if shared is not None and kwargs.get(GATHERED_KEYS):  # each segment's keys gathered for the slice
            _check_shared(module, backend, causal, blocks)
        elif shared is not None:
            k, v, cu_seq_lens_k, max_k = _shared_keys(module, backend, shared, k, v, causal, blocks)
        out = backend.varlen(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_q, max_k, causal=causal,
                             scale=scaling, window=sliding_window, softcap=softcap, dropout=dropout, **extra)
        return out.unsqueeze(0), None

    def _backend_for(self, query: torch.Tensor) -> AttentionBackend:
        if self.fallback is None or self.backend.accepts(query.device.type, query.dtype):
            return self.backend
        return self.fallback

    def _ordinary(self, module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                  causal, sinks, output_attentions):
        """Inputs without boundaries: behave as the sdpa implementation, plus windows, soft-capping, sinks, and the
        attention weights when ``output_attentions`` asks for them (as the eager implementation returns them)."""
        from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

        plain = softcap is None and sinks is None and not output_attentions
        if plain and (attention_mask is not None or sliding_window is None):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=causal)
        groups = query.shape[1] // key.shape[1]
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:  # an additive float mask: 0 attends, a large negative not
            mask = mask > torch.finfo(mask.dtype).min / 2
        out = attend(query, repeat_kv(key, groups), repeat_kv(value, groups), causal=causal, scale=scaling,
                     window=sliding_window, softcap=softcap, dropout=dropout, mask=mask, sinks=sinks,
                     return_weights=output_attentions)
        out, weights = out if output_attentions else (out, None)
        return out.transpose(1, 2).contiguous(), weights


def _shared_keys(module, backend: AttentionBackend, shared: SharedPrefixes, key: torch.Tensor, value: torch.Tensor,
                 causal: bool, blocks: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The keys and values each segment of a shared row attends to (its parent prompt's, then its own: gathered, so
    that every completion's gradient reaches the one copy of the prompt), their boundaries and longest segment."""
    _check_shared(module, backend, causal, blocks)
    index = shared.key_index.to(key.device)
    return key.index_select(0, index), value.index_select(0, index), \
        shared.cu_seq_lens_k.to(key.device), shared.max_length_k


def _check_shared(module, backend: AttentionBackend, causal: bool, blocks: Any) -> None:
    """Refuse shared prefixes on a backend without the feature, or in bidirectional attention."""
    name = type(module).__name__
    if SHARED_PREFIXES_FEATURE not in backend.features:
        raise NotImplementedError(
            f"{name} is given a packed row with shared prefixes, which the {backend.name!r} attention backend does "
            "not implement: use attention: exact or flash_attn, or prefix_sharing: off")
    if not causal or blocks is not None:
        raise BoundaryError(f"{name}: shared prefixes are for causal attention (bidirectional blocks are taken "
                            "inside prompts only); set prefix_sharing: off for this model")


def check_blocks_in_prompts(blocks: torch.Tensor, shared: SharedPrefixes, name: str = "attention") -> None:
    """Refuse bidirectional blocks (``[T]`` or ``[1, T]``) in a completion of a shared row: only a segment without a
    parent (a prompt) may hold one (one read from the device)."""
    if bool((blocks.reshape(-1).index_select(0, shared.roots.children.to(blocks.device)) >= 0).any()):
        raise BoundaryError(
            f"{name}: a completion of a shared row holds a bidirectional block (an image's tokens after its prompt): "
            "only a prompt (a segment without a parent) may hold one. Share only prompts that hold every image of "
            "their rows, or set prefix_sharing: off")


def _shared_with_blocks(module, backend: AttentionBackend, shared: SharedPrefixes, query: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor, causal: bool, blocks: torch.Tensor,
                        **options: Any) -> torch.Tensor:
    """Attention over a shared row that holds bidirectional blocks (Gemma 3's images in a prompt): the segments
    without a parent (prompts, and examples kept whole) attend to themselves with their blocks, the completions to
    their parent's keys and their own, causally (two calls of the backend). A block in a completion is refused: its
    tokens would have to see each other both ways across the parent's keys, which no backend takes."""
    name = type(module).__name__
    if SHARED_PREFIXES_FEATURE not in backend.features:
        raise NotImplementedError(
            f"{name} is given a packed row with shared prefixes, which the {backend.name!r} attention backend does "
            "not implement: use attention: exact or flash_attn, or prefix_sharing: off")
    if not causal:
        raise BoundaryError(f"{name}: shared prefixes are for causal attention; set prefix_sharing: off for this "
                            "model")
    split = shared.roots
    if blocks.device.type == "cpu":  # on an accelerator checked once per forward, where the blocks are made
        check_blocks_in_prompts(blocks, shared, name)
    roots = backend.varlen(query.index_select(0, split.roots), key.index_select(0, split.roots),
                           value.index_select(0, split.roots), split.roots_cu, split.roots_cu, split.roots_max,
                           split.roots_max, causal=causal, blocks=blocks.index_select(0, split.roots), **options)
    children = backend.varlen(query.index_select(0, split.children), key.index_select(0, split.children_keys),
                              value.index_select(0, split.children_keys), split.children_cu_q, split.children_cu_k,
                              split.children_max_q, split.children_max_k, causal=causal, **options)
    return torch.cat([roots, children]).index_select(0, split.order)


def register(backend: AttentionBackend, fallback: AttentionBackend | None = None,
             attention_dropout: bool = True, default_causal: bool = True, sequence: Any = None) -> str:
    """Register the implementation of this variant with transformers and return its name; ``sequence``: the variant
    for a sequence-parallel group (each rank's packed calls hold its slice of the group's row), an
    :class:`~padfree_plugins.modeling.attention.context_parallel.AttentionLayout` (Ulysses, all-gather or both; named
    ``…_sp<size>``, ``…_sp<size>_allgather``, ``…_sp<size>_ulysses<u>x<r>``, then ``_zigzag`` where balanced) or a
    :class:`~padfree_plugins.modeling.attention.ulysses.SequenceGroup` (Ulysses over the group).

    Registering the same variant again replaces its function with an equal one; the registry belongs to
    transformers, so nothing here keeps state.
    """
    if fallback is not None and fallback.name == backend.name:
        fallback = None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = implementation_name(backend, fallback, attention_dropout, default_causal)
    function: Any = PadfreeAttention(backend, fallback, attention_dropout, default_causal)
    if sequence is not None:
        from padfree_plugins.modeling.attention.context_parallel import AttentionLayout

        layout = sequence if isinstance(sequence, AttentionLayout) else AttentionLayout(sequence.size, sequence, None)
        name, function = name + layout.suffix, layout.wrap(function)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, padfree_mask)
    return name
