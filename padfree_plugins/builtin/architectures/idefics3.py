"""Idefics3 and SmolVLM (image-text): the language model runs the packed row; the SigLIP vision tower keeps its own
attention, one sub-image tile at a time.

Their processor splits each image into tiles (``do_image_splitting``: rows × columns of ``max_image_size`` crops,
then the whole image resized as one more, the global image) and writes ``image_seq_len`` ``<image>`` tokens per
tile, each tile's run after ``<fake_token_around_image>`` and its ``<row_i_col_j>`` (or ``<global-img>``) marker.
One example comes as ``pixel_values [1, tiles, 3, S, S]`` and ``pixel_attention_mask [1, tiles, S, S]``. The
packed row drops each example's batch dimension, concatenates the tiles in example order and gives the model
``[1, all tiles, 3, S, S]``: the model fills the packed row's ``<image>`` runs in that order, so each example's
tokens get its own tiles. Each example is checked: ``image_seq_len`` tokens per tile, one run each — the count the
model computes itself, ``((image_size // patch_size)² / scale_factor²``, not a config attribute — and tiles of the
vision tower's ``image_size``.

The model drops every all-zero tile as padding (``real_images_inds``: a batch pads its examples to the same number
of tiles with zeros). A packed row has no padding tiles: the processor's padding tiles (all-zero pixels *and* mask)
of an example taken from a batched call are dropped here as the model would drop them; a real tile whose pixels are
all zero (a black image with ``do_normalize=False``) is refused, since the model would drop it too and its tokens
would get no features. A black image normalised as usual (to -1) is no padding.

A text-only packed micro-batch of a run of several processes runs the tower on one idle tile (:func:`tiled_idle_image`:
ones, which the model does not drop; see :class:`~padfree_plugins.modeling.vision.IdleTower`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import BatchError
from padfree_plugins.modeling.vision import VisionLanguage
from padfree_plugins.packing.multimodal import Media, MultimodalCollator, MultimodalPacking, config_value

#: What the Idefics3 / SmolVLM processors make: tiles (one pixel row each: ``[3, S, S]``) with their pixel masks,
#: ``image_seq_len`` placeholders per tile (``tokens_per_row`` is computed from the config: see :func:`image_seq_len`),
#: the pixels given to the model as ``[1, tiles, 3, S, S]``.
TILED_MEDIA = (Media("image", "pixel_values", None, "image_token_id", 1, tokens_per_row="image_seq_len",
                     per_row=("pixel_attention_mask",), batch_dim=True),)


def image_seq_len(model_config: Any) -> int:
    """Placeholders per tile, as ``Idefics3Model`` / ``SmolVLMModel`` compute it at init: the vision tower's
    ``(image_size // patch_size)²`` patches, pixel-shuffled by ``scale_factor`` on each side."""
    vision = model_config.vision_config
    return int(((vision.image_size // vision.patch_size) ** 2) / (model_config.scale_factor ** 2))


def tiled_idle_image(model_config: Any) -> dict[str, torch.Tensor]:
    """The idle image of a tiled tower: one tile of the tower's ``image_size``, every pixel one (an all-zero tile
    would be dropped as padding) and every pixel in its mask, as ``[1, 1, 3, S, S]``."""
    vision = model_config.vision_config
    size = vision.image_size
    return {"pixel_values": torch.ones(1, 1, vision.num_channels, size, size),
            "pixel_attention_mask": torch.ones(1, 1, size, size, dtype=torch.bool)}


def as_tensor(value: Any, key: str, index: int) -> torch.Tensor:
    try:
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as error:
        raise BatchError(f"example {index}: {key!r} is not an array ({type(value).__name__}): {error}") from None


@dataclass
class TiledCollator(MultimodalCollator):
    """The :class:`~padfree_plugins.packing.multimodal.MultimodalCollator` of tiled images: each example's
    ``pixel_values`` / ``pixel_attention_mask`` taken without its batch dimension and without padding tiles, its
    tiles checked to be ``tile_size`` pixels square (see the module docstring)."""

    tile_size: int | None = None

    def _media_of(self, example: Any, index: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return super()._media_of(self._own_tiles(example, index), index)

    def _own_tiles(self, example: Any, index: int) -> Any:
        media = self.media[0]
        if example.get(media.pixels) is None:
            return example
        pixels = self._unbatched(as_tensor(example[media.pixels], media.pixels, index), media.pixels, 4, index)
        masks = {key: self._unbatched(as_tensor(example[key], key, index), key, 3, index)
                 for key in media.per_row if example.get(key) is not None}
        if self.tile_size is not None and tuple(pixels.shape[-2:]) != (self.tile_size, self.tile_size):
            raise BatchError(f"example {index}: its tiles are {tuple(pixels.shape[-2:])} pixels, but the vision "
                             f"tower's image_size is {self.tile_size}: the processor's max_image_size must be the "
                             "model's, every tile a square of that size (the model counts its tokens from it)")
        zero = (pixels == 0).flatten(1).all(1)
        if zero.any():
            mask = next(iter(masks.values()), None)
            if mask is not None and mask.shape[0] == pixels.shape[0]:
                black = zero & mask.flatten(1).any(1)  # a real tile (its mask set) of zero pixels
            else:
                placeholders = int((np.asarray(example["input_ids"]).reshape(-1) == self.token_ids[media.name]).sum())
                counted = placeholders == int((~zero).sum()) * self.row_tokens[media.name]
                black = torch.zeros_like(zero) if counted else zero  # without masks: padding if the count says so
            if black.any():
                raise BatchError(
                    f"example {index}: tile(s) {black.nonzero()[:, 0].tolist()} of its {media.pixels!r} are all "
                    "zeros: the model drops every all-zero tile as batch padding, so its image tokens would get no "
                    "features (a black image without normalisation?); normalise the pixels as the processor does")
            pixels = pixels[~zero]
            masks = {key: mask[~zero] if mask.shape[0] == zero.shape[0] else mask for key, mask in masks.items()}
        return {**example, media.pixels: pixels, **masks}

    def split_call(self, inputs: Any, rows: Any) -> list[dict[str, Any]]:
        """A padded call's tiles by row: the processor batches them per row (``[rows, tiles, 3, S, S]``, each row's
        tiles padded with all-zero tiles to the call's most), so row ``r`` takes ``pixel_values[r]`` and its
        masks, its padding tiles dropped as for any example; a row without image tokens has padding tiles only."""
        media = self.media[0]
        if inputs.get(media.pixels) is None:
            return super().split_call(inputs, rows)
        pixels = torch.as_tensor(inputs[media.pixels])
        masks = {key: torch.as_tensor(inputs[key]) for key in media.per_row if inputs.get(key) is not None}
        if pixels.ndim != 5 or any(value.shape[0] != pixels.shape[0] for value in masks.values()):
            raise BatchError(f"{media.pixels!r} of shape {tuple(pixels.shape)}: expected [rows, tiles, 3, S, S]")
        if pixels.shape[0] != len(rows):
            raise BatchError(f"{media.pixels!r} holds tiles for {pixels.shape[0]} rows, the call {len(rows)}")
        split: list[dict[str, Any]] = []
        for row, tokens in enumerate(rows):
            if not bool((tokens == self.token_ids[media.name]).any()):
                if bool(pixels[row].detach().ne(0).any()):
                    raise BatchError(f"row {row} has tiles with pixels but no {media.name} tokens")
                split.append({})
                continue
            split.append({media.pixels: pixels[row], **{key: value[row] for key, value in masks.items()}})
        return split

    @staticmethod
    def _unbatched(value: torch.Tensor, key: str, ndim: int, index: int) -> torch.Tensor:
        """``value`` without the processor's batch dimension of one example (``[1, tiles, …]`` -> ``[tiles, …]``)."""
        if value.ndim == ndim + 1:
            if value.shape[0] != 1:
                raise BatchError(f"example {index}: {key!r} of shape {tuple(value.shape)} holds {value.shape[0]} "
                                 "rows of tiles: pass each example's own processor output (one row)")
            value = value[0]
        if value.ndim != ndim:
            raise BatchError(f"example {index}: {key!r} of shape {tuple(value.shape)} is not tiles "
                             f"([1, tiles, …] or [tiles, …] with {ndim - 1} dimensions per tile)")
        return value


@dataclass(frozen=True)
class TiledPacking(MultimodalPacking):
    """The ``wrap_collator`` of Idefics3 / SmolVLM: a :class:`TiledCollator` whose placeholders per tile are
    :func:`image_seq_len` of the model config."""

    media: tuple[Media, ...] = TILED_MEDIA

    def __call__(self, collator: Any, model_config: Any) -> TiledCollator:
        token_ids = {media.name: config_value(model_config, media.token_id) for media in self.media}
        row_tokens = {media.name: image_seq_len(model_config) for media in self.media}
        return TiledCollator(collator, self.media, token_ids, row_tokens=row_tokens,
                             tile_size=int(model_config.vision_config.image_size))


def family(name: str, description: str) -> VisionLanguage:
    """A tiled vision-language family: the SigLIP tower at ``model.vision_model`` (the connector, a linear map of
    each tile's own features, needs nothing), the language model at ``model.text_model`` (``text_config``)."""
    return VisionLanguage(Architecture(name, model_types=(name,), kind="decoder", default_pooling="last",
                                       description=description, wrap_collator=TiledPacking()),
                          towers=("vision_model",), idle_image=tiled_idle_image)


IDEFICS3 = family("idefics3", "Idefics3 image-text models (sub-image tiles, per-tile SigLIP vision tower)")
register_architectures, patch_model = IDEFICS3.hooks()
