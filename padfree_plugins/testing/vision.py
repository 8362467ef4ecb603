"""Tiny vision-language models, their processors built locally (an image processor and a tokenizer trained on the
spot with the family's special tokens — no hub), and synthetic images, for tests and benchmarks.

    processor = image_text_processor("qwen2_5_vl")
    model = tiny_vision_language_model("qwen2_5_vl", processor)
    example = image_text_example(processor, "a photo of <image> and more text", [synthetic_image(56, 84)])

Families: Qwen2-VL and Qwen2.5-VL (14-pixel patches), Qwen3-VL and Qwen3-VL-MoE (16-pixel patches, deepstack
features from vision blocks 0 and 1), Qwen3.5 and Qwen3.5-MoE (16-pixel patches; the language model a gated-DeltaNet
layer then a gated-attention layer). The Qwen3 families' processor (``Qwen3VLProcessor``) writes a video frame by
frame, each frame's tokens after its timestamp (:func:`synthetic_video_example` does the same).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from padfree_plugins.data.tokenizer import train_tokenizer

#: The placeholder a test's text marks each image with; the processor expands it to the family's tokens.
IMAGE_MARK = "<image>"
#: Qwen-VL special tokens: an image is ``<|vision_start|>`` + ``<|image_pad|>`` × its tokens + ``<|vision_end|>``.
QWEN_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
#: Families these helpers build, with their config and processor classes.
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
#: Families whose processor (``Qwen3VLProcessor``) writes a video frame by frame, ``<t seconds>`` before each frame's
#: ``<|vision_start|>`` + ``<|video_pad|>`` × its tokens + ``<|vision_end|>``, and makes no ``second_per_grid_ts``.
TIMESTAMPED_VIDEO = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
#: The Qwen3 families whose vision tower feeds deepstack features to the first decoder layers.
DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")
#: The Qwen3.5 families, whose language model is the gated-DeltaNet hybrid.
HYBRID_TEXT = ("qwen3_5", "qwen3_5_moe")
#: The families with routed experts in their language model.
MOE = ("qwen3_vl_moe", "qwen3_5_moe")
WORDS = ("a tiny picture of the red square on a green field with some words about it and more words "
         "every example has its own length and images of many sizes").split()


@lru_cache(maxsize=4)
def _tokenizer(tokens: tuple[str, ...]) -> Any:
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer = train_tokenizer(texts, vocab_size=320)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


def patch_size(model_type: str) -> int:
    """The vision tower's patch (pixels per side) of the family's tiny config: 14 for Qwen2(.5)-VL, 16 after."""
    return 14 if model_type in ("qwen2_vl", "qwen2_5_vl") else 16


def image_text_processor(model_type: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The family's processor (``AutoProcessor``'s class), built from a local image processor and tokenizer; images
    are resized to between ``min_pixels`` and ``max_pixels`` (by default 2 and 24 merged cells: ``28 * 28 * 2`` and
    ``28 * 28 * 24`` for 14-pixel patches).

    Without torchvision, transformers cannot build Qwen-VL's video processor, so the processor here handles images
    only (videos are made by :func:`synthetic_video_example`)."""
    import copy

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    if model_type not in FAMILIES:
        raise ValueError(f"no tiny processor for {model_type!r}; these helpers build {', '.join(FAMILIES)}")
    base = _processor_class(model_type)

    class ImageTextProcessor(base):  # the family's processor, its video processor left out
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            if model_type in TIMESTAMPED_VIDEO:  # Qwen3VLProcessor also names the frame delimiters
                self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
                self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
                self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    cell = (patch_size(model_type) * 2) ** 2  # one merged 2 × 2 cell of patches
    images = Qwen2VLImageProcessorPil(min_pixels=min_pixels or cell * 2, max_pixels=max_pixels or cell * 24,
                                      patch_size=patch_size(model_type))
    return ImageTextProcessor(image_processor=images, tokenizer=copy.deepcopy(_tokenizer(QWEN_VL_TOKENS)))


def _processor_class(model_type: str) -> type:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    if model_type in TIMESTAMPED_VIDEO:  # AutoProcessor's class for all four
        return Qwen3VLProcessor
    return {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[model_type]


def tiny_vision_language_config(model_type: str, processor: Any, **text_overrides: Any) -> Any:
    """A tiny config of ``model_type`` whose special token ids are ``processor``'s: 2 text layers (d=64, GQA),
    a 2-block vision tower (d=32, patches of :func:`patch_size` merged 2×2). The Qwen3 families' see
    :func:`_qwen3_config`."""
    if model_type in TIMESTAMPED_VIDEO:
        return _qwen3_config(model_type, processor, **text_overrides)
    from transformers import AutoConfig

    tokenizer = processor.tokenizer
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))))
    text = {**dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                   rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=tokenizer.pad_token_id,
                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id), **text_overrides}
    if "rope_scaling" not in text_overrides and text["hidden_size"] // text["num_attention_heads"] != 16:
        half = text["hidden_size"] // text["num_attention_heads"] // 2  # mRoPE sections: a quarter, 3/8, 3/8
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [half // 4, half * 3 // 8, half - half // 4 -
                                                                   half * 3 // 8]}
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3)
    if model_type == "qwen2_5_vl":  # the tower's output is the language model's width
        vision.update(intermediate_size=64, out_hidden_size=text["hidden_size"], window_size=56,
                      fullatt_block_indexes=[1])
    else:
        vision.update(embed_dim=32, mlp_ratio=2, hidden_size=text["hidden_size"])
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids)


#: The language model of the tiny Qwen3 configs: interleaved mRoPE over 8 rotary frequencies (4 temporal, 2 height,
#: 2 width, as Qwen3-VL's 24 / 20 / 20 of 64).
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
#: A gated-DeltaNet layer, then a gated-attention layer (partial rotary: 16 of 32 head dims).
QWEN3_5_TEXT = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "full_attention"])
#: Four routed experts, two per token (Qwen3.5-MoE also has its shared expert).
QWEN3_MOE_TEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _qwen3_config(model_type: str, processor: Any, **text_overrides: Any) -> Any:
    """Qwen3-VL(-MoE), Qwen3.5(-MoE): 2 text layers (d=64, GQA; head 16, Qwen3.5's 32 with half its dims rotary),
    a 2-block vision tower (d=32, 16-pixel patches merged 2×2, an 8 × 8 learned position grid), Qwen3-VL's
    deepstack features taken after both vision blocks (into decoder layers 0 and 1)."""
    from transformers import AutoConfig

    tokenizer = processor.tokenizer
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))))
    rope = dict(QWEN3_ROPE)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    if model_type in HYBRID_TEXT:
        text.update(QWEN3_5_TEXT)
        rope["partial_rotary_factor"] = 0.5
    if model_type in MOE:
        text.update(QWEN3_MOE_TEXT)
        if model_type == "qwen3_5_moe":
            text["shared_expert_intermediate_size"] = 32
    text.update(rope_parameters=rope, **text_overrides)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=patch_size(model_type),
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=64,
                  num_position_embeddings=64)
    if model_type in DEEPSTACK:
        vision["deepstack_visual_indexes"] = [0, 1]
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids)


def tiny_vision_language_model(model_type: str, processor: Any, seed: int = 0, **text_overrides: Any) -> Any:
    """A randomly initialised tiny image-text model (``*ForConditionalGeneration``), fp32, eval mode, seeded."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_vision_language_config(model_type, processor, **text_overrides)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()


def synthetic_image(height: int, width: int, seed: int = 0) -> Any:
    """A random RGB ``PIL.Image`` of ``height`` × ``width`` pixels."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def image_text_example(processor: Any, text: str, images: list | None = None) -> dict[str, Any]:
    """One example as the processor makes it, unbatched: ``input_ids`` (a list), ``pixel_values`` ``[patches, dim]``
    and ``image_grid_thw`` ``[images, 3]`` when there are images. ``text`` marks each image with ``<image>``."""
    marked = text.replace(IMAGE_MARK, "<|vision_start|><|image_pad|><|vision_end|>")
    if text.count(IMAGE_MARK) != len(images or []):
        raise ValueError(f"{text.count(IMAGE_MARK)} {IMAGE_MARK} marks for {len(images or [])} images")
    output = processor(text=[marked], images=images or None, return_tensors="pt")
    example = {"input_ids": output["input_ids"][0].tolist()}
    for key in ("pixel_values", "image_grid_thw"):
        if key in output:
            example[key] = output[key]
    return example


def synthetic_video_example(processor: Any, model_config: Any, text: str, frames: int = 4, height: int = 2,
                            width: int = 4, seed: int = 0, seconds_per_patch: float = 0.5) -> dict[str, Any]:
    """An example with one video of ``frames`` frames (``height`` × ``width`` patches each), its pixel rows and grid
    made as Qwen-VL's video processor makes them (``[t·h·w, channels·temporal_patch·patch²]``), and its
    placeholders in ``text``'s ``<image>`` mark (a video processor needs torchvision).

    Qwen2(.5)-VL: one run of placeholders, ``second_per_grid_ts`` the seconds between temporal patches. The Qwen3
    families (:data:`TIMESTAMPED_VIDEO`): as ``Qwen3VLProcessor`` writes a video, each temporal patch's placeholders
    after its timestamp ``<t seconds>`` (``t`` = its index × ``seconds_per_patch``), no ``second_per_grid_ts``."""
    import torch

    vision = model_config.vision_config
    merge, temporal = vision.spatial_merge_size, vision.temporal_patch_size
    grid = torch.tensor([[frames // temporal, height, width]])
    tokens = int(grid.prod()) // merge ** 2
    ids = processor.tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    before, after = text.split(IMAGE_MARK)
    encode = processor.tokenizer.encode
    timestamped = getattr(model_config, "model_type", None) in TIMESTAMPED_VIDEO
    if timestamped:
        per_frame = tokens // int(grid[0, 0])
        video = [token for frame in range(int(grid[0, 0]))
                 for token in (*encode(f"<{frame * seconds_per_patch:.1f} seconds>"), ids[0], *[ids[3]] * per_frame,
                               ids[2])]
    else:
        video = [ids[0], *[ids[3]] * tokens, ids[2]]
    input_ids = [*encode(before), *video, *encode(after)]
    dim = getattr(vision, "in_channels", 3) * temporal * vision.patch_size ** 2
    pixels = torch.from_numpy(np.random.RandomState(seed).randn(int(grid.prod()), dim).astype("float32"))
    example = {"input_ids": input_ids, "pixel_values_videos": pixels, "video_grid_thw": grid}
    if not timestamped:
        example["second_per_grid_ts"] = torch.tensor([seconds_per_patch])
    return example
