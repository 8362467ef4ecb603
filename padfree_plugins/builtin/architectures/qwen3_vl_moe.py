"""Qwen3-VL-MoE (image-text, video-text): as Qwen3-VL (:mod:`.qwen3_vl`), its language model's MLPs routed experts.
The router and the experts work token by token, so packing changes nothing for them; the load-balancing loss
(``output_router_logits``) is computed over the packed tokens, as padded it is over the real ones."""

from padfree_plugins.builtin.architectures.qwen3_vl import family

QWEN3_VL_MOE = family("qwen3_vl_moe", {"qwen3_vl_moe": "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeModel"},
                      "Qwen3-VL-MoE image/video-text models (per-example mRoPE, deepstack features, routed experts)")
register_architectures, patch_model = QWEN3_VL_MOE.hooks()
