"""Qwen2-VL and Qwen2.5-VL (image-text, video-text): the language model runs the packed row with each example's
mRoPE positions computed as if it ran alone; the vision tower (windowed attention, per image) keeps its own."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.vision import QwenPositions, VisionLanguage
from padfree_plugins.packing.multimodal import Media, MultimodalPacking

#: What Qwen-VL processors make: images, and videos (with the seconds between temporal patches on Qwen2.5-VL).
QWEN_VL_MEDIA = (Media("image", "pixel_values", "image_grid_thw", "image_token_id", 1),
                 Media("video", "pixel_values_videos", "video_grid_thw", "video_token_id", 2,
                       extra=("second_per_grid_ts",)))


def family(name: str, module: str, model_class: str, description: str) -> VisionLanguage:
    packing = MultimodalPacking(QWEN_VL_MEDIA, positions=QwenPositions(
        f"transformers.models.{module}.modeling_{module}.{model_class}"))
    return VisionLanguage(Architecture(name, model_types=(name,), kind="decoder", features=window_features,
                                       default_pooling="last", description=description, wrap_collator=packing))


QWEN2_5_VL = family("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLModel",
                    "Qwen2.5-VL image/video-text models (per-example mRoPE, per-image vision tower)")
register_architectures, patch_model = QWEN2_5_VL.hooks()
