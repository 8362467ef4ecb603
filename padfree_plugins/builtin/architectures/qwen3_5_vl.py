"""Qwen3.5 and Qwen3.5-MoE as image/video-text models (``Qwen3_5ForConditionalGeneration``): the vision tower and
mRoPE positions of Qwen3-VL (:mod:`.qwen3_vl`; no deepstack features), the language model the gated-DeltaNet hybrid
of the text-only ``qwen3_5`` plugin (:mod:`.qwen3_5`). Both patches are applied: the language model's attention
packed and the vision tower kept from the packed row's boundaries (:class:`~padfree_plugins.modeling.vision.
VisionLanguage`), and every gated DeltaNet restarted at each example of the packed row
(:class:`~padfree_plugins.modeling.hybrids.Hybrid`'s mixer patch; ``mixers:`` picks its backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from padfree_plugins.builtin.architectures.qwen3_vl import family
from padfree_plugins.errors import UnsupportedArchitectureError
from padfree_plugins.modeling.hybrids import GATED_DELTA_CHUNK, GATED_DELTA_KERNELS, Hybrid
from padfree_plugins.modeling.mixers import MixerPatch, check_mixer_backend
from padfree_plugins.modeling.patching import ModelPatch
from padfree_plugins.modeling.vision import VisionLanguage


@dataclass(frozen=True)
class HybridVisionLanguage(VisionLanguage):
    """A vision-language family whose language model is a hybrid: ``mixers``, ``kernels`` and ``chunk`` as
    :class:`~padfree_plugins.modeling.hybrids.Hybrid` declares them. Its patch is the vision-language patch with
    the mixer patch appended to its handles (``undo()`` removes both)."""

    mixers: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    chunk: int | str = 1

    @property
    def hybrid(self) -> Hybrid:
        return Hybrid(self.architecture, self.mixers, self.kernels, chunk=self.chunk)

    def patch(self, model: Any, backend: Any, fallback: Any, config: Any) -> ModelPatch:
        hybrid = self.hybrid
        check_mixer_backend(config.mixers, self.architecture.name, hybrid.kernels)
        modules = hybrid.mixer_modules(model)
        if not modules:  # refused before anything is patched
            raise UnsupportedArchitectureError(
                f"{type(model).__name__}: no {' or '.join(self.mixers)} in its language model, where the "
                f"{self.architecture.name} plugin restarts the linear attention at every example; this transformers "
                "version changed the model, and an unknown mixer would run across examples")
        patch = super().patch(model, backend, fallback, config)
        patch.handles.append(MixerPatch.install(model, modules, config.mixers, hybrid.kernels, hybrid.chunk_of))
        return patch


QWEN3_5_VL = family("qwen3_5_vl", {"qwen3_5": "qwen3_5.modeling_qwen3_5.Qwen3_5Model",
                                   "qwen3_5_moe": "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeModel"},
                    "Qwen3.5 and Qwen3.5-MoE image/video-text models (per-example mRoPE, gated DeltaNet restarted "
                    "per example)",
                    declaration=HybridVisionLanguage, mixers=("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"),
                    kernels=GATED_DELTA_KERNELS, chunk=GATED_DELTA_CHUNK)
register_architectures, patch_model = QWEN3_5_VL.hooks()
