"""Qwen2-VL (image-text, video-text): as Qwen2.5-VL (:mod:`.qwen2_5_vl`), with its own rotary index."""

from padfree_plugins.builtin.architectures.qwen2_5_vl import family

QWEN2_VL = family("qwen2_vl", "qwen2_vl", "Qwen2VLModel",
                  "Qwen2-VL image/video-text models (per-example mRoPE, per-image vision tower)")
register_architectures, patch_model = QWEN2_VL.hooks()
