"""Qwen3.5 and Qwen3.5-MoE as image/video-text models (``Qwen3_5ForConditionalGeneration``): the vision tower and
mRoPE positions of Qwen3-VL (:mod:`.qwen3_vl`; no deepstack features), the language model the gated-DeltaNet hybrid
of the text-only ``qwen3_5`` plugin (:mod:`.qwen3_5`). The family has both traits: the vision towers
(:class:`~padfree_plugins.modeling.vision.VisionTowers`: the language model's attention packed, the vision tower kept
from the packed row's boundaries) and the sequence mixers (:class:`~padfree_plugins.modeling.hybrids.SequenceMixers`:
every gated DeltaNet restarted at each example of the packed row; ``mixers:`` picks its backend)."""

from __future__ import annotations

from padfree_plugins.builtin.architectures.qwen3_vl import family
from padfree_plugins.modeling.hybrids import GATED_DELTA_CHUNK, GATED_DELTA_KERNELS, SequenceMixers

QWEN3_5_VL = family("qwen3_5_vl", {"qwen3_5": "qwen3_5.modeling_qwen3_5.Qwen3_5Model",
                                   "qwen3_5_moe": "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeModel"},
                    "Qwen3.5 and Qwen3.5-MoE image/video-text models (per-example mRoPE, gated DeltaNet restarted "
                    "per example)",
                    SequenceMixers(("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), kernels=GATED_DELTA_KERNELS,
                                   chunk=GATED_DELTA_CHUNK))
register_architectures, patch_model = QWEN3_5_VL.hooks()
