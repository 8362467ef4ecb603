"""Qwen3-VL (image-text, video-text): as Qwen2.5-VL (:mod:`.qwen2_5_vl`) the language model runs the packed row with
each example's mRoPE positions computed as if it ran alone — transformers' own ``get_rope_index``, which splits a
video into its frames, each frame's tokens after its timestamp as ``Qwen3VLProcessor`` writes them — and the vision
tower (per-image attention) keeps its own. Its deepstack features (merged from early vision blocks) are added to
the first decoder layers' hidden states at the image and video tokens of the packed row: the model finds those
tokens in the packed ``input_ids`` and the features come in the order of the packed pixels, each example's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import BatchError
from padfree_plugins.modeling.families import Family, Trait
from padfree_plugins.modeling.vision import QwenPositions, VisionTowers
from padfree_plugins.packing.multimodal import Media, MultimodalPacking

#: What Qwen3VLProcessor makes (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE): images, and videos frame by frame —
#: a video's placeholders are one run per frame, a timestamp (text) before each, so not one run per video (checked
#: here instead, :class:`FrameRopeIndex`); no ``second_per_grid_ts``.
QWEN3_VL_MEDIA = (Media("image", "pixel_values", "image_grid_thw", "image_token_id", 1),
                  Media("video", "pixel_values_videos", "video_grid_thw", "video_token_id", 2, one_run_per_item=False))


def placeholder_runs(mask: torch.Tensor) -> list[int]:
    """The lengths of the runs of ``True`` in a 1-D ``mask``, in order."""
    edges = torch.diff(torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).int()).nonzero()[:, 0]
    return (edges[1::2] - edges[::2]).tolist()


@dataclass(frozen=True)
class FrameRopeIndex:
    """An example's mRoPE rows (``rope_index``: a :class:`~padfree_plugins.modeling.vision.QwenRopeIndex`), its
    videos checked first to be written frame by frame: Qwen3's ``get_rope_index`` takes each run of video tokens for
    one frame (``t`` runs of ``h·w / merge²`` tokens per video), so a video in one run (Qwen2-VL's layout) would get
    one frame's positions for all its tokens."""

    rope_index: Any
    merge: int

    def __call__(self, input_ids: torch.Tensor, token_types: torch.Tensor, grids: dict[str, Any]) -> torch.Tensor:
        videos = grids.get("video_grid_thw")
        if videos is not None:
            frames = [int(h * w) // self.merge ** 2 for t, h, w in videos.tolist() for _ in range(int(t))]
            runs = placeholder_runs(token_types == QWEN3_VL_MEDIA[1].modality)
            if runs != frames:
                raise BatchError(
                    f"an example's video tokens run {runs}, but its videos (grid {videos.tolist()}) make frames of "
                    f"{frames} tokens: Qwen3-VL's positions take a video frame by frame, each frame's tokens apart "
                    "(after its timestamp), as Qwen3VLProcessor writes them; pass the processor's output as made")
        return self.rope_index(input_ids, token_types, grids)


@dataclass(frozen=True)
class PositionsByModelType:
    """``positions`` of a Qwen3 family (it may declare several model types): the :class:`FrameRopeIndex` of the
    model class declared for the config's ``model_type`` (``model_classes``: pairs of model type and dotted class
    path, as :class:`~padfree_plugins.modeling.vision.QwenPositions` takes it)."""

    model_classes: tuple[tuple[str, str], ...]

    def __call__(self, model_config: Any) -> FrameRopeIndex:
        rope_index = QwenPositions(dict(self.model_classes)[model_config.model_type])(model_config)
        return FrameRopeIndex(rope_index, int(model_config.vision_config.spatial_merge_size))


def family(name: str, model_classes: dict[str, str], description: str, *traits: Trait) -> Family:
    """A Qwen3 vision-language family: ``model_classes`` maps each model type to its base model class in
    ``transformers.models`` (``"qwen3_vl.modeling_qwen3_vl.Qwen3VLModel"``), whose ``get_rope_index`` computes the
    positions; its traits the vision towers (at ``visual``) and ``traits`` (a hybrid language model's mixers)."""
    positions = PositionsByModelType(tuple((model_type, f"transformers.models.{path}")
                                           for model_type, path in model_classes.items()))
    packing = MultimodalPacking(QWEN3_VL_MEDIA, positions=positions)
    return Family(Architecture(name, model_types=tuple(model_classes), kind="decoder", default_pooling="last",
                               description=description, wrap_collator=packing), traits=(VisionTowers(), *traits))


QWEN3_VL = family("qwen3_vl", {"qwen3_vl": "qwen3_vl.modeling_qwen3_vl.Qwen3VLModel"},
                  "Qwen3-VL image/video-text models (per-example mRoPE with frame timestamps, deepstack features)")
register_architectures, patch_model = QWEN3_VL.hooks()
