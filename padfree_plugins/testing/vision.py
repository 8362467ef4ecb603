"""Tiny vision-language models, their processors built locally (an image processor and a tokenizer trained on the
spot with the family's special tokens — no hub), and synthetic images, for tests and benchmarks.

    processor = image_text_processor("qwen2_5_vl")
    model = tiny_vision_language_model("qwen2_5_vl", processor)
    example = image_text_example(processor, "a photo of <image> and more text", [synthetic_image(56, 84)])
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
FAMILIES = ("qwen2_vl", "qwen2_5_vl")
WORDS = ("a tiny picture of the red square on a green field with some words about it and more words "
         "every example has its own length and images of many sizes").split()


@lru_cache(maxsize=4)
def _tokenizer(tokens: tuple[str, ...]) -> Any:
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer = train_tokenizer(texts, vocab_size=320)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


def image_text_processor(model_type: str, min_pixels: int = 28 * 28 * 2, max_pixels: int = 28 * 28 * 24) -> Any:
    """The family's processor (``AutoProcessor``'s class), built from a local image processor and tokenizer.

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
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    images = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return ImageTextProcessor(image_processor=images, tokenizer=copy.deepcopy(_tokenizer(QWEN_VL_TOKENS)))


def _processor_class(model_type: str) -> type:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    return {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[model_type]


def tiny_vision_language_config(model_type: str, processor: Any, **text_overrides: Any) -> Any:
    """A tiny config of ``model_type`` whose special token ids are ``processor``'s: 2 text layers (d=64, GQA),
    a 2-block vision tower (d=32, 14-pixel patches merged 2×2)."""
    from transformers import AutoConfig

    tokenizer = processor.tokenizer
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **text_overrides)
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3)
    if model_type == "qwen2_5_vl":
        vision.update(intermediate_size=64, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
    else:
        vision.update(embed_dim=32, mlp_ratio=2, hidden_size=64)
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
    placeholders in ``text``'s ``<image>`` mark (a video processor needs torchvision)."""
    import torch

    vision = model_config.vision_config
    merge, temporal = vision.spatial_merge_size, vision.temporal_patch_size
    grid = torch.tensor([[frames // temporal, height, width]])
    tokens = int(grid.prod()) // merge ** 2
    ids = processor.tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    before, after = text.split(IMAGE_MARK)
    encode = processor.tokenizer.encode
    input_ids = [*encode(before), ids[0], *[ids[3]] * tokens, ids[2], *encode(after)]
    dim = getattr(vision, "in_channels", 3) * temporal * vision.patch_size ** 2
    pixels = torch.from_numpy(np.random.RandomState(seed).randn(int(grid.prod()), dim).astype("float32"))
    return {"input_ids": input_ids, "pixel_values_videos": pixels, "video_grid_thw": grid,
            "second_per_grid_ts": torch.tensor([seconds_per_patch])}
