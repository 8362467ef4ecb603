"""LFM2 and LFM2-MoE (Liquid): attention layers beside gated short-convolution layers (``Lfm2ShortConv``: a
depthwise causal conv1d of kernel ``conv_L_cache``, 3 in the shipped models, between two gates).

The attention layers go through transformers' ``AttentionInterface`` as usual. The short conv would run straight
across a packed row — each example's first tokens would see the previous example's last ones — so for packed
calls the patch runs every ``*ShortConv`` module through :func:`~padfree_plugins.modeling.mixers.boundary_causal_conv1d`
(the taps that would cross an example's start are masked), which equals each example run alone; padded calls and
``generate()`` (with its conv-state cache) run the model's own code. In a row with shared prefixes a completion's
taps read its prompt's last inputs (the conv state a completion starts from). A packed call that reaches a short conv
without the boundaries, or with a cache, is an error, never a silent mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BoundaryError
from padfree_plugins.modeling.attention import PACKED_CALL
from padfree_plugins.modeling.mixers import boundary_causal_conv1d
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY
from padfree_plugins.modeling.patching import ModelPatch, own_attribute, restore_attributes

LFM2 = Architecture("lfm2", model_types=("lfm2", "lfm2_moe"), kind="decoder", default_pooling="last",
                    description="LFM2 / LFM2-MoE hybrids: attention and gated short convolutions, restarted per "
                    "example")


@hookimpl
def register_architectures():
    return [LFM2]


def short_convs(model: Any) -> list[Any]:
    """Every gated short-convolution module of an LFM2 model."""
    return [module for module in model.modules() if type(module).__name__.endswith("ShortConv")]


@dataclass
class PackedShortConv:
    """A short conv's forward: packed calls restart the convolution at every example; others run the module's
    own forward (a plain object, so that the model still pickles)."""

    module: Any
    original: Any
    #: Runs along the sequence: under sequence parallelism it gets the whole row (modeling.sequence_parallel).
    packed_sequence_mixer: ClassVar[bool] = True

    def __call__(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens is None:
            if PACKED_CALL.get():
                raise BoundaryError(f"{type(self.module).__name__} was called without the example boundaries during "
                                    "a packed forward: its convolution would run across examples")
            return self.original(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                                 **kwargs)
        if past_key_values is not None:
            raise BoundaryError("a packed row with a cache: the short convolution's state would span examples; "
                                "run packed rows without past_key_values (use_cache=False)")
        module = self.module
        gates = module.in_proj(hidden_states).transpose(-1, -2)
        b, c, x = gates.chunk(3, dim=-2)
        mixed = module.conv(b * x, cu_seq_lens=cu_seq_lens, shared=kwargs.get(SHARED_PREFIXES_KEY))  # its forward:
        # a sharded weight is whole there
        return module.out_proj((c * mixed.to(c.dtype)).transpose(-1, -2).contiguous())


@dataclass
class BoundaryConv:
    """A short conv's ``conv`` forward: given ``cu_seq_lens``, the convolution restarted at every example; else the
    module's own. The weight is read inside the conv's own forward, where FSDP2 and DeepSpeed ZeRO-3 have gathered
    it (outside, a sharded weight is a shard or a placeholder) and from where they reduce its gradient."""

    module: Any
    original: Any

    def __call__(self, x, cu_seq_lens=None, shared=None):
        if cu_seq_lens is None:
            return self.original(x)
        return boundary_causal_conv1d(x, self.module.weight.squeeze(1), self.module.bias, cu_seq_lens, shared)


@dataclass
class ShortConvPatch:
    """The short convs' forwards, and their ``conv`` modules', replaced on their instances; in ``patch.handles``:
    ``remove()`` restores them."""

    saved: list = field(default_factory=list)

    @classmethod
    def install(cls, model: Any) -> ShortConvPatch:
        patch = cls()
        for module in short_convs(model):
            patch.saved.append((module, own_attribute(module, "forward")))
            patch.saved.append((module.conv, own_attribute(module.conv, "forward")))
            module.forward = PackedShortConv(module, module.forward)
            module.conv.forward = BoundaryConv(module.conv, module.conv.forward)
        return patch

    def remove(self) -> None:
        for module, forward in reversed(self.saved):
            restore_attributes(module, {"forward": forward})
        self.saved.clear()


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name != LFM2.name:
        return None
    keep_dropout = config.attention_dropout == "keep"
    patch = ModelPatch.apply(model, architecture, backend, fallback, attention_dropout=keep_dropout)
    patch.handles.append(ShortConvPatch.install(model))
    return patch
