"""Tiny vision-language models, their processors built locally (an image processor and a tokenizer trained on the
spot with the family's special tokens — no hub), and synthetic images, for tests and benchmarks.

    processor = image_text_processor("qwen2_5_vl")
    model = tiny_vision_language_model("qwen2_5_vl", processor)
    example = image_text_example(processor, "a photo of <image> and more text", [synthetic_image(56, 84)])

Families: Qwen2-VL and Qwen2.5-VL (14-pixel patches), Qwen3-VL and Qwen3-VL-MoE (16-pixel patches, deepstack
features from vision blocks 0 and 1), Qwen3.5 and Qwen3.5-MoE (16-pixel patches; the language model a gated-DeltaNet
layer then a gated-attention layer). The Qwen3 families' processor (``Qwen3VLProcessor``) writes a video frame by
frame, each frame's tokens after its timestamp (:func:`synthetic_video_example` does the same).

Also Idefics3 and SmolVLM (:data:`TILED`: each image split into sub-image tiles and a global image) and
LLaVA-OneVision (:data:`ANY_RESOLUTION`: any-resolution images in patches, their tokens depending on their size),
images only; their text marks an image with ``<image>``, their own image token.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
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

    if model_type in (*TILED, *ANY_RESOLUTION):
        return _tiled_processor(model_type) if model_type in TILED else _any_resolution_processor()
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
    :func:`_qwen3_config`; Idefics3 / SmolVLM :func:`_tiled_config`; LLaVA-OneVision :func:`_any_resolution_config`."""
    if model_type in TILED:
        return _tiled_config(model_type, processor, **text_overrides)
    if model_type in ANY_RESOLUTION:
        return _any_resolution_config(processor, **text_overrides)
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
    and ``image_grid_thw`` ``[images, 3]`` when there are images. ``text`` marks each image with ``<image>``.
    Idefics3 / SmolVLM and LLaVA-OneVision: see :func:`_own_token_example`."""
    own = _own_token_example(processor, text, images)
    if own is not None:
        return own
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


# -- Gemma 3 (image-text): a fixed number of soft tokens per image, bidirectional among themselves ----------------

#: Gemma 3's image tokens: the text marks an image with ``<start_of_image>``, which ``Gemma3Processor`` expands to
#: ``\n\n<start_of_image>`` + ``<image_soft_token>`` × ``mm_tokens_per_image`` + ``<end_of_image>\n\n`` and marks the
#: soft tokens 1 in ``token_type_ids`` (what makes them attend to each other bidirectionally).
GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
#: The tiny Gemma 3's images: 56 × 56 pixels in 14-pixel patches (4 × 4), average-pooled to ``2 × 2`` soft tokens.
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH_SIZE, GEMMA3_TOKENS_PER_IMAGE = 56, 14, 4


def gemma3_processor() -> Any:
    """``Gemma3Processor`` from a local image processor (the PIL one: the default needs torchvision; every image
    resized to :data:`GEMMA3_IMAGE_SIZE`) and a tokenizer trained here, whose ``boi_token`` / ``image_token`` /
    ``eoi_token`` are Gemma's (:data:`GEMMA3_TOKENS`)."""
    import copy

    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = copy.deepcopy(_tokenizer(GEMMA3_TOKENS))
    tokenizer._set_model_specific_special_tokens(special_tokens=dict(zip(("boi_token", "image_token", "eoi_token"),
                                                                          GEMMA3_TOKENS)))
    images = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=GEMMA3_TOKENS_PER_IMAGE)


def tiny_gemma3_config(processor: Any, **text_overrides: Any) -> Any:
    """A tiny ``Gemma3Config`` whose image token ids are ``processor``'s: 2 text layers (d=64, GQA, head 16) — a
    sliding-window layer (window 6, shorter than most examples) then a global one — and a 2-block SigLIP tower
    (d=32) over :data:`GEMMA3_IMAGE_SIZE` images, :data:`GEMMA3_TOKENS_PER_IMAGE` tokens per image."""
    from transformers import Gemma3Config

    tokenizer = processor.tokenizer
    boi, image, eoi = tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=6, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    text.update(text_overrides)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH_SIZE)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
                        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image)


def tiny_gemma3_model(processor: Any, seed: int = 0, **text_overrides: Any) -> Any:
    """A randomly initialised tiny ``Gemma3ForConditionalGeneration``, fp32, eval mode, seeded. Its multi-modal
    projection, which transformers initialises to zeros (every image would embed as zeros), is drawn at random."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_gemma3_config(processor, **text_overrides)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    return model


def gemma3_example(processor: Any, text: str, images: list | None = None, **processor_kwargs: Any) -> dict[str, Any]:
    """One example as ``Gemma3Processor`` makes it, unbatched: ``input_ids`` and ``token_type_ids`` (lists), and
    ``pixel_values`` ``[rows, 3, size, size]`` when there are images (a row per image, and per crop with
    ``do_pan_and_scan=True, pan_and_scan_min_crop_size=32`` among ``processor_kwargs``). ``text`` marks each image
    with ``<image>``."""
    if text.count(IMAGE_MARK) != len(images or []):
        raise ValueError(f"{text.count(IMAGE_MARK)} {IMAGE_MARK} marks for {len(images or [])} images")
    marked = text.replace(IMAGE_MARK, processor.boi_token)
    output = processor(text=[marked], images=[images] if images else None, return_tensors="pt", **processor_kwargs)
    example = {key: output[key][0].tolist() for key in ("input_ids", "token_type_ids")}
    if "pixel_values" in output:
        example["pixel_values"] = output["pixel_values"]
    return example


#: Idefics3 and SmolVLM: an image's longest side resized to two tiles of :data:`TILE` pixels, cut into (at most 2 × 2)
#: tiles, then the whole image as one more tile (the global image); a tile is 4 × 4 patches of 14 pixels,
#: pixel-shuffled 2 × 2 into :data:`TILE_TOKENS` tokens.
TILED = ("idefics3", "smolvlm")
#: LLaVA-OneVision: any-resolution images in patches of :data:`ANY_RESOLUTION_PATCH` pixels (2 × 2 patches of 14
#: pixels: 4 tokens each) on the grids of :data:`ANY_RESOLUTION_PINPOINTS`; an image of more than
#: ``anyres_max_4`` patches' features is interpolated down (the large images of the tests are).
ANY_RESOLUTION = ("llava_onevision",)
TILE = 56
TILE_TOKENS = ((TILE // 14) ** 2) // 2 ** 2
#: Idefics3 / SmolVLM special tokens: a tile is ``<fake_token_around_image><row_i_col_j>`` + ``<image>`` × its
#: tokens; the global image ``<fake_token_around_image><global-img>`` + ``<image>`` × its tokens +
#: ``<fake_token_around_image>``.
TILED_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))
ANY_RESOLUTION_TOKENS = ("<image>", "<video>")
ANY_RESOLUTION_PATCH = 28
ANY_RESOLUTION_PINPOINTS = ((28, 28), (28, 56), (56, 28), (56, 56), (28, 84), (84, 28), (56, 84), (84, 56), (84, 84))
ANY_RESOLUTION_ASPECT = "anyres_max_4"


def _tiled_processor(model_type: str) -> Any:
    """Idefics3's processor, or SmolVLM's (its video processor, which needs torchvision, and ``num2words`` for video
    prompts left out), with the PIL image processor: tiles of :data:`TILE` pixels, :data:`TILE_TOKENS` each."""
    import copy

    from transformers import Idefics3Processor, SmolVLMProcessor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    tokenizer = copy.deepcopy(_tokenizer(TILED_TOKENS))
    sizes = dict(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    if model_type == "idefics3":
        return Idefics3Processor(Idefics3ImageProcessorPil(**sizes), tokenizer, image_seq_len=TILE_TOKENS)

    class ImageTextProcessor(SmolVLMProcessor):  # SmolVLM's processor for images
        def __init__(self, image_processor=None, tokenizer=None, image_seq_len=169, chat_template=None, **kwargs):
            self.fake_image_token, self.image_token = "<fake_token_around_image>", "<image>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.end_of_utterance_token, self.global_image_token = "<end_of_utterance>", "<global-img>"
            self.image_seq_len, self.video_token = image_seq_len, "<video>"
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        @property
        def video_processor(self):  # what apply_chat_template reads of it (its defaults), no video processor
            return SimpleNamespace(num_frames=64, fps=1)

    return ImageTextProcessor(SmolVLMImageProcessorPil(**sizes), tokenizer, image_seq_len=TILE_TOKENS)


def _any_resolution_processor() -> Any:
    """LLaVA-OneVision's processor (its video processor, which needs torchvision, left out) with the PIL image
    processor: patches of :data:`ANY_RESOLUTION_PATCH` pixels on :data:`ANY_RESOLUTION_PINPOINTS`."""
    import copy

    from transformers import LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(LlavaOnevisionProcessor):  # LLaVA-OneVision's processor for images
        def __init__(self, image_processor=None, tokenizer=None, num_image_tokens=None,
                     vision_feature_select_strategy=None, chat_template=None, vision_aspect_ratio="anyres_max_9",
                     **kwargs):
            self.num_image_tokens = num_image_tokens
            self.vision_feature_select_strategy = vision_feature_select_strategy
            self.image_token, self.video_token = ANY_RESOLUTION_TOKENS
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_aspect_ratio = vision_aspect_ratio
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    images = LlavaOnevisionImageProcessorPil(size={"height": ANY_RESOLUTION_PATCH, "width": ANY_RESOLUTION_PATCH},
                                             image_grid_pinpoints=[list(pin) for pin in ANY_RESOLUTION_PINPOINTS])
    return ImageTextProcessor(images, copy.deepcopy(_tokenizer(ANY_RESOLUTION_TOKENS)),
                              num_image_tokens=(ANY_RESOLUTION_PATCH // 14) ** 2, vision_feature_select_strategy="full",
                              vision_aspect_ratio=ANY_RESOLUTION_ASPECT)


def _text_config(tokenizer: Any, **text_overrides: Any) -> dict[str, Any]:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, **text_overrides)


def _tiled_config(model_type: str, processor: Any, **text_overrides: Any) -> Any:
    """Idefics3 / SmolVLM: a Llama language model (2 layers, d=64, GQA), a 2-layer SigLIP tower (d=32) on tiles of
    :data:`TILE` pixels in 14-pixel patches, pixel-shuffled 2 × 2 (``scale_factor``)."""
    from transformers import AutoConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
                  patch_size=14)
    return AutoConfig.for_model(model_type, text_config=_text_config(processor.tokenizer, **text_overrides),
                                vision_config=vision, scale_factor=2, image_token_id=processor.image_token_id)


def _any_resolution_config(processor: Any, **text_overrides: Any) -> Any:
    """LLaVA-OneVision: a Qwen2 language model (2 layers, d=64, GQA), a 2-layer SigLIP tower (d=32, no head) on
    patches of :data:`ANY_RESOLUTION_PATCH` pixels in 14-pixel patches, all its features taken (``full``)."""
    from transformers import AutoConfig

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=ANY_RESOLUTION_PATCH, patch_size=14, vision_use_head=False)
    return AutoConfig.for_model(
        "llava_onevision", text_config={"model_type": "qwen2", **_text_config(processor.tokenizer, **text_overrides)},
        vision_config=vision, image_token_index=processor.image_token_id, video_token_index=processor.video_token_id,
        image_grid_pinpoints=[list(pin) for pin in ANY_RESOLUTION_PINPOINTS], vision_feature_select_strategy="full",
        vision_feature_layer=-1, vision_aspect_ratio=ANY_RESOLUTION_ASPECT)


def _own_token_example(processor: Any, text: str, images: list | None) -> dict[str, Any] | None:
    """An example of a family whose text marks images with its own ``<image>`` token, as its processor makes it for
    this one example (``None`` for another processor): ``input_ids`` (a list), and with images

    * Idefics3 / SmolVLM: ``pixel_values`` ``[1, tiles, 3, S, S]`` and ``pixel_attention_mask`` ``[1, tiles, S, S]``;
    * LLaVA-OneVision: ``pixel_values`` ``[images, patches, 3, S, S]``, ``image_sizes`` ``[images, 2]`` and
      ``batch_num_images`` ``[1]`` — the images given as this example's (several images: each unpatched, as
      OneVision takes a multi-image example; the processor given them flat patches each instead).
    """
    from transformers import Idefics3Processor, LlavaOnevisionProcessor, SmolVLMProcessor

    if isinstance(processor, (Idefics3Processor, SmolVLMProcessor)):
        keys = ("pixel_values", "pixel_attention_mask")
    elif isinstance(processor, LlavaOnevisionProcessor):
        keys = ("pixel_values", "image_sizes", "batch_num_images")
    else:
        return None
    if text.count(IMAGE_MARK) != len(images or []):
        raise ValueError(f"{text.count(IMAGE_MARK)} {IMAGE_MARK} marks for {len(images or [])} images")
    output = processor(text=[text], images=[list(images)] if images else None, return_tensors="pt")
    example = {"input_ids": output["input_ids"][0].tolist()}
    example.update({key: output[key] for key in keys if key in output})
    return example
