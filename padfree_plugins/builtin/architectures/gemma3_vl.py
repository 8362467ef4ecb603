"""Gemma 3 image-text (``Gemma3ForConditionalGeneration``, model type ``gemma3``; the text-only ``gemma3_text`` is
:mod:`.gemma3`'s): each image is ``mm_tokens_per_image`` soft tokens (``pixel_values`` ``[images, 3, size, size]``,
one image or pan-and-scan crop per pixel row), filled in the order of the packed pixels; the SigLIP tower keeps its
own attention, and the language model runs the packed row with sliding-window and global layers.

Its attention is causal except that the tokens of one image attend to each other both ways: transformers builds that
into its masks from ``token_type_ids`` (1 at an image's tokens, as ``Gemma3Processor`` makes them), and a packed row
builds no mask. Here a forward pre-hook on the base model (:class:`ImageBlocks`) numbers the images' runs of tokens
across the packed row — a run never continues across an example's start — and hands them to attention as
``block_sequence_ids`` (transformers' name: ``-1`` outside images). Only backends with the ``bidirectional_blocks``
feature take them (``exact``, ``repad``: ``auto`` picks ``exact`` on a CPU and ``repad`` on a GPU; ``varlen`` and
``flash_attn`` run causal or not only, and are refused), and they apply them inside each example: an image's tokens
never see another example's. On a sliding layer the window limits how far back a token sees, never an image's later
tokens — transformers' ``(causal | blockwise) & sliding window``. In a row that holds a prompt once (shared prefixes),
every image lies in a prompt (a completion holding a block is refused): the prompts attend to themselves with their
blocks, the completions to their prompt causally.

The images are found from the ``token_type_ids`` the model is given, as transformers finds them; without them, from
the image placeholders (``image_token_id``) — the ``token_type_ids`` the processor would have made (transformers
would run such images causally, which Gemma 3 is not trained for).

A text-only packed micro-batch of a run of several processes runs the tower on one zero image
(:func:`gemma3_idle_image`; see :class:`~padfree_plugins.modeling.vision.IdleTower`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.builtin.architectures._features import softcap_features, window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import BoundaryError, UnsupportedArchitectureError
from padfree_plugins.modeling.attention import BLOCKS_FEATURE, BLOCKS_KWARG, check_blocks_in_prompts
from padfree_plugins.modeling.patching import ModelPatch, bound_inputs
from padfree_plugins.modeling.families import Family, Trait
from padfree_plugins.modeling.vision import VisionTowers
from padfree_plugins.packing.multimodal import Media, MultimodalPacking
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY

#: What Gemma3Processor makes: every pixel row (an image, or a pan-and-scan crop of one) is ``mm_tokens_per_image``
#: placeholders in one run (between ``<start_of_image>`` and ``<end_of_image>``).
GEMMA3_MEDIA = (Media("image", "pixel_values", None, "image_token_id", 1, tokens_per_row="mm_tokens_per_image"),)


def gemma3_idle_image(model_config: Any) -> dict[str, torch.Tensor]:
    """The idle image of Gemma 3's tower: one image of zero pixels at the tower's ``image_size``."""
    vision = model_config.vision_config
    return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)}


def gemma3_vl_features(model_config: Any) -> frozenset[str]:
    """The language model's windows and soft-capping, and the images' bidirectional blocks."""
    text = model_config.get_text_config()
    return window_features(text) | softcap_features(text) | {BLOCKS_FEATURE}


def image_blocks(images: torch.Tensor, cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """``block_sequence_ids`` ``[1, T]`` of a packed row whose image tokens are ``images`` (bool, ``[1, T]``): every
    run of image tokens one block, numbered across the row, a run cut at every example's start; ``-1`` elsewhere.
    transformers' ``get_block_sequence_ids_for_mask`` per example; on the device, nothing read back."""
    images = images.reshape(-1)
    starts = torch.zeros_like(images)
    starts[cu_seq_lens[:-1].to(images.device).long()] = True
    continued = torch.cat([images.new_zeros(1), images[:-1]]) & ~starts
    ids = torch.cumsum((images & ~continued).long(), 0) - 1
    return torch.where(images, ids, -1)[None]


@dataclass(frozen=True)
class ImageBlocks:
    """Forward pre-hook of the base model: a packed call gets its images' blocks (``block_sequence_ids``), from its
    ``token_type_ids`` or, without them, its placeholders (``image_token_id``); one already given is kept. A row
    without an image on the host gets none (plain causal attention, as alone)."""

    image_token_id: int

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        inputs = bound_inputs(module, args, kwargs)
        cu_seq_lens = inputs.get("cu_seq_lens_q")
        if cu_seq_lens is None or inputs.get(BLOCKS_KWARG) is not None:
            return None
        token_types, input_ids = inputs.get("token_type_ids"), inputs.get("input_ids")
        if token_types is not None:
            images = token_types == 1
        elif input_ids is not None:
            images = input_ids == self.image_token_id
        else:
            raise BoundaryError(
                "a packed Gemma 3 row given as inputs_embeds needs its token_type_ids (1 at every image token, as "
                "Gemma3Processor makes them): without them nothing says which tokens attend to each other both ways"
            )
        blocks = image_blocks(images, cu_seq_lens)
        if blocks.device.type == "cpu" and not bool((blocks >= 0).any()):
            return None
        if inputs.get(SHARED_PREFIXES_KEY) is not None:  # images in prompts only
            check_blocks_in_prompts(blocks, inputs[SHARED_PREFIXES_KEY], "Gemma 3")
        return args, {**kwargs, BLOCKS_KWARG: blocks}


@dataclass(frozen=True)
class BidirectionalImages(Trait):
    """The trait of Gemma 3's images: each image's tokens attend to each other both ways, their blocks handed to
    attention by an :class:`ImageBlocks` pre-hook on the base model."""

    def check(self, model: Any, architecture: Any, config: Any) -> None:
        if getattr(model.config.get_text_config(), "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError(
                "Gemma 3 image-text with use_bidirectional_attention: transformers' own masks for it stay causal "
                "outside images while its attention modules say bidirectional; padfree-plugins refuses rather than "
                "pick one. Use the text-only model (gemma3_text) for a bidirectional encoder"
            )

    def install(self, model: Any, patch: ModelPatch, config: Any) -> Any:
        base = getattr(patch.model, "base_model", patch.model)
        return base.register_forward_pre_hook(ImageBlocks(int(patch.model.config.image_token_id)), with_kwargs=True)


GEMMA3_VL = Family(
    Architecture("gemma3_vl", model_types=("gemma3",), kind="decoder", features=gemma3_vl_features,
                 default_pooling="last", token_keys=("token_type_ids",), wrap_collator=MultimodalPacking(GEMMA3_MEDIA),
                 description="Gemma 3 image-text models (each image's tokens bidirectional among themselves, per "
                 "example; sliding-window and global layers)"),
    traits=(VisionTowers(("vision_tower",), idle_image=gemma3_idle_image), BidirectionalImages()))
register_architectures, patch_model = GEMMA3_VL.hooks()
