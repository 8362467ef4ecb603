"""Hybrid families: attention layers (through transformers' ``AttentionInterface``, as for any decoder) beside
sequence-mixer layers — a gated delta rule, KDA, a Mamba1 / Mamba2 scan — that carry state along the sequence.

A :class:`Hybrid` declares a family once: its :class:`~padfree_plugins.contract.declarations.Architecture`, the
class names of its mixer modules, and the CUDA packages through which transformers runs those mixers with the
example boundaries (none where no package takes them). Its hooks patch the attention as usual and route every
mixer through :class:`~padfree_plugins.modeling.mixers.PackedMixer` (``mixers:`` in the config picks the
backend; see :mod:`padfree_plugins.modeling.mixers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BoundaryError, UnsupportedArchitectureError
from padfree_plugins.modeling.mixers import MixerPatch, check_mixer_backend
from padfree_plugins.modeling.patching import ModelPatch

#: transformers' routes that take the boundaries: the gated delta rule (``cu_seqlens``) and the conv (``seq_idx``).
GATED_DELTA_KERNELS = ("fla", "causal_conv1d")
#: Mamba2's chunked scan and fused conv + scan (``seq_idx``).
MAMBA2_KERNELS = ("mamba_ssm", "causal_conv1d")


def checkpointing(model: Any) -> bool:
    """Whether gradient (activation) checkpointing is on in any layer of ``model``."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


@dataclass(frozen=True)
class Hybrid:
    """A hybrid family: ``mixers`` are the class names of its sequence-mixer modules; ``kernels`` the import names
    of the packages its boundary-aware CUDA route needs (``()``: none, every packed call runs ``exact``);
    ``boundaries_reach_mixers``: whether the model hands its mixers the forward's ``**kwargs`` (with the
    boundaries), which gradient checkpointing's recomputation needs; ``has_attention``: ``False`` for
    attention-free families (Mamba), whose attention implementation is left alone."""

    architecture: Architecture
    mixers: tuple[str, ...]
    kernels: tuple[str, ...] = ()
    boundaries_reach_mixers: bool = True
    has_attention: bool = True

    def mixer_modules(self, model: Any) -> list[Any]:
        return [module for module in model.modules() if type(module).__name__ in self.mixers]

    def patch(self, model: Any, backend: Any, fallback: Any, config: Any) -> ModelPatch:
        check_mixer_backend(config.mixers, self.architecture.name, self.kernels)
        modules = self.mixer_modules(model)
        if not modules:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has none of the sequence-mixer modules the {self.architecture.name} plugin "
                f"knows ({', '.join(self.mixers)}): this transformers version changed them; padfree-plugins "
                "refuses rather than run an unknown mixer across examples")
        patch = ModelPatch.apply(model, self.architecture, backend, fallback,
                                 attention_dropout=config.attention_dropout == "keep",
                                 has_attention=self.has_attention)
        if not self.boundaries_reach_mixers:
            for module in dict.fromkeys((model, model.base_model)):  # Mamba's head keeps the boundaries
                patch.handles.append(module.register_forward_pre_hook(self._refuse_recompute, with_kwargs=True))
        patch.handles.append(MixerPatch.install(model, modules, config.mixers, self.kernels))
        return patch

    def _refuse_recompute(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Gradient checkpointing recomputes a layer in the backward pass, outside the packed forward: a mixer that
        gets no boundaries from its layer would then run across examples."""
        if kwargs.get("cu_seq_lens_q") is not None and module.training and checkpointing(module):
            raise BoundaryError(
                f"{self.architecture.name}: its layers hand the sequence mixers no boundaries, so gradient "
                "checkpointing would recompute them across examples in the backward pass. Train it padding-free "
                "without gradient checkpointing (gradient_checkpointing=False)")

    def hooks(self) -> tuple[Any, Any]:
        """The module-level hooks of the family's plugin: ``register_architectures, patch_model = FAMILY.hooks()``."""

        @hookimpl
        def register_architectures():
            return [self.architecture]

        @hookimpl
        def patch_model(model, architecture, backend, fallback, config):
            if architecture.name != self.architecture.name:
                return None
            return self.patch(model, backend, fallback, config)

        return register_architectures, patch_model
