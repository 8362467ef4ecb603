"""LLaVA-OneVision (image-text): the language model runs the packed row; the vision tower (SigLIP) keeps its own
attention, one image patch at a time.

Any-resolution images: the processor resizes an image to its best ``image_grid_pinpoints`` resolution, cuts it into
patches of the tower's ``image_size`` and puts the whole image first (the base patch), then pads every image of the
call to the same number of patches (``pixel_values [images, patches, 3, S, S]``, ``image_sizes [images, 2]``, the
original height and width). An example of several images (``batch_num_images`` ``[n]``, n > 1) is not patched: each
image is padded to a square and is its base patch alone. The tokens of an image depend on its size: the patches'
features unpadded to the image's aspect ratio, a newline feature after each row, the base patch's features first.

The packed row takes each image's own patches (the model's own count, ``image_size_to_num_patches`` — or one for a
multi-image example) as a 4-D ``pixel_values [all patches, 3, S, S]``, which the model splits again from the packed
``image_sizes`` and ``batch_num_images`` (each example's, in example order: an example of several images stays
unpatched beside single-image examples). The vision tower sees exactly the patches it sees for each example alone.

Each example is checked before anything is packed: its images' placeholders — counted by
``LlavaOnevisionProcessor``'s own formula on the image size, or the base patch and a newline for a multi-image
example — are one run per image (runs of adjacent images may merge), in the order of its pixels; the model checks
only the packed total. Videos (``pixel_values_videos``) are not packed: the collator refuses them.

A text-only packed micro-batch of a run of several processes runs the tower on one idle image
(:func:`any_resolution_idle_image`; see :class:`~padfree_plugins.modeling.vision.IdleTower`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import BatchError
from padfree_plugins.modeling.vision import VisionLanguage
from padfree_plugins.packing.multimodal import Media, MultimodalCollator, MultimodalPacking, config_value

#: What LlavaOnevisionProcessor makes for images: patches (one pixel row each), the images' sizes and each
#: example's number of images (whether its images are patched); the count of placeholders checked here.
ANY_RESOLUTION_MEDIA = (Media("image", "pixel_values", None, "image_token_id", 1,
                              extra=("image_sizes", "batch_num_images")),)

#: LLaVA-OneVision's video inputs, which this plugin does not pack.
VIDEO_KEYS = ("pixel_values_videos", "image_sizes_videos")


def as_tensor(value: Any, key: str, index: int) -> torch.Tensor:
    try:
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as error:
        raise BatchError(f"example {index}: {key!r} is not an array ({type(value).__name__}): {error}") from None


@dataclass(frozen=True)
class AnyResolution:
    """How an image of a given size becomes patches and placeholder tokens, from the model config: transformers'
    ``image_size_to_num_patches`` (the model's count) and ``LlavaOnevisionProcessor``'s ``_get_number_of_features``
    (the processor's), the latter on a stand-in that holds the config's values (it reads nothing else)."""

    grid_pinpoints: tuple[tuple[int, int], ...]
    image_size: int
    side: int
    base_tokens: int
    vision_aspect_ratio: str

    @classmethod
    def of(cls, model_config: Any) -> AnyResolution:
        vision = model_config.vision_config
        side = vision.image_size // vision.patch_size
        # the base patch's features: the tower's patches, and its class token where the model keeps it
        cls_token = model_config.vision_feature_select_strategy == "full" and "clip" in str(vision.model_type)
        return cls(tuple(tuple(pin) for pin in model_config.image_grid_pinpoints), int(vision.image_size), side,
                   side * side + int(cls_token), str(model_config.vision_aspect_ratio))

    def patches(self, height: int, width: int, patched: bool) -> int:
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        if not patched:
            return 1
        return image_size_to_num_patches((height, width), [list(pin) for pin in self.grid_pinpoints], self.image_size)

    def tokens(self, height: int, width: int, patched: bool) -> int:
        from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

        if not patched:
            return self.base_tokens + 1  # the base patch and one newline
        owner = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=[list(pin) for pin in
                                                                                      self.grid_pinpoints]),
                                num_image_tokens=self.side * self.side, vision_aspect_ratio=self.vision_aspect_ratio)
        owner._get_unpadded_features = functools.partial(LlavaOnevisionProcessor._get_unpadded_features, owner)
        tokens = LlavaOnevisionProcessor._get_number_of_features(owner, height, width, self.image_size,
                                                                 self.image_size)
        return tokens + self.base_tokens - self.side * self.side


def any_resolution_idle_image(model_config: Any) -> dict[str, torch.Tensor]:
    """The idle image of LLaVA-OneVision's tower: one image of zero pixels, a patch square (the tower's
    ``image_size``), patched as the model patches it — its base patch and grid patches, so the projector and the
    ``image_newline`` take part as for any image."""
    size = int(model_config.vision_config.image_size)
    patches = AnyResolution.of(model_config).patches(size, size, True)
    channels = model_config.vision_config.num_channels
    return {"pixel_values": torch.zeros(patches, channels, size, size), "image_sizes": torch.tensor([[size, size]]),
            "batch_num_images": torch.tensor([1])}


@dataclass
class AnyResolutionCollator(MultimodalCollator):
    """The :class:`~padfree_plugins.packing.multimodal.MultimodalCollator` of any-resolution images: each
    example's patches taken as the model takes them, its ``batch_num_images`` filled in, its placeholders counted
    per image (see the module docstring)."""

    layout: AnyResolution | None = None

    def _media_of(self, example: Any, index: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        videos = [key for key in VIDEO_KEYS if example.get(key) is not None]
        if videos:
            raise BatchError(f"example {index} carries {', '.join(map(repr, videos))}: the llava_onevision plugin "
                             "packs images only (a video's frames are pooled per video); run videos unpacked")
        example, expected = self._own_patches(example, index)
        found, counts = super()._media_of(example, index)
        if expected is not None:
            self._check_tokens(example, expected, counts[self.media[0].name], index)
        return found, counts

    def _own_patches(self, example: Any, index: int) -> tuple[Any, list[int] | None]:
        """``example`` with ``pixel_values`` ``[patches, 3, S, S]`` (each image's own) and ``batch_num_images``,
        and the tokens of each of its images."""
        media = self.media[0]
        if example.get(media.pixels) is None:
            return example, None
        if example.get("image_sizes") is None:
            raise BatchError(f"example {index} has {media.pixels!r} but no 'image_sizes': without each image's size "
                             "its patches and tokens cannot be told apart; pass the processor's output whole")
        pixels = as_tensor(example[media.pixels], media.pixels, index)
        sizes = as_tensor(example["image_sizes"], "image_sizes", index).reshape(-1, 2).tolist()
        numbers = example.get("batch_num_images")
        numbers = [1] * len(sizes) if numbers is None else as_tensor(numbers, "batch_num_images", index).reshape(-1)
        numbers = [int(n) for n in numbers]
        if sum(numbers) != len(sizes):
            raise BatchError(f"example {index}: its batch_num_images {numbers} count {sum(numbers)} images but its "
                             f"image_sizes {len(sizes)}")
        patched = [n == 1 for n in numbers for _ in range(n)]
        patches = [self.layout.patches(h, w, p) for (h, w), p in zip(sizes, patched)]
        if pixels.ndim == 5:  # [images, patches (padded to the call's most), 3, S, S], as the processor makes it
            if pixels.shape[0] != len(sizes):
                raise BatchError(f"example {index}: {media.pixels!r} holds {pixels.shape[0]} images but its "
                                 f"image_sizes {len(sizes)}")
            short = [i for i, n in enumerate(patches) if pixels.shape[1] < n]
            if short:
                raise BatchError(f"example {index}: image(s) {short} have {pixels.shape[1]} patches in "
                                 f"{media.pixels!r} but their sizes make {[patches[i] for i in short]}")
            pixels = torch.cat([image[:n] for image, n in zip(pixels, patches)])
        elif pixels.ndim != 4 or pixels.shape[0] != sum(patches):
            raise BatchError(f"example {index}: {media.pixels!r} of shape {tuple(pixels.shape)}: expected "
                             f"[images, patches, 3, H, W], or [{sum(patches)}, 3, H, W] (its images' patches)")
        if tuple(pixels.shape[-2:]) != (self.layout.image_size, self.layout.image_size):
            raise BatchError(f"example {index}: its patches are {tuple(pixels.shape[-2:])} pixels, but the vision "
                             f"tower's image_size is {self.layout.image_size}")
        expected = [self.layout.tokens(h, w, p) for (h, w), p in zip(sizes, patched)]
        return {**example, media.pixels: pixels, "batch_num_images": torch.tensor(numbers)}, expected

    def split_call(self, inputs: Any, rows: Any) -> list[dict[str, Any]]:
        """A padded call's images by row: ``pixel_values [images, patches, 3, S, S]`` and ``image_sizes`` one entry
        per image; ``batch_num_images``, where given, one entry per row with images (the processor skips rows
        without). Each row takes the next images whose tokens (by size, patched or not as the model will take
        them) make its own count."""
        media = self.media[0]
        if any(inputs.get(key) is not None for key in VIDEO_KEYS):
            raise BatchError("a call with videos: the llava_onevision plugin packs images only")
        if inputs.get(media.pixels) is None:
            return super().split_call(inputs, rows)
        if inputs.get("image_sizes") is None:
            raise BatchError(f"a call with {media.pixels!r} and no 'image_sizes'")
        pixels = torch.as_tensor(inputs[media.pixels])
        sizes = torch.as_tensor(inputs["image_sizes"]).detach().cpu().reshape(-1, 2).tolist()
        numbers = inputs.get("batch_num_images")
        numbers = None if numbers is None else [int(n) for n in torch.as_tensor(numbers).reshape(-1).tolist()]
        if pixels.shape[0] != len(sizes):
            raise BatchError(f"{media.pixels!r} holds {pixels.shape[0]} images, 'image_sizes' {len(sizes)}")
        split: list[dict[str, Any]] = []
        image = with_images = 0
        for tokens in rows:
            count = int((tokens == self.token_ids[media.name]).sum())
            if not count:
                split.append({})
                continue
            first, found = image, 0
            if numbers is not None:
                if with_images == len(numbers):
                    raise BatchError("more rows with images than entries of 'batch_num_images'")
                image += numbers[with_images]
                found = sum(self.layout.tokens(h, w, numbers[with_images] == 1) for h, w in sizes[first:image])
            while numbers is None and found < count and image < len(sizes):
                found, image = found + self.layout.tokens(*sizes[image], True), image + 1
            if found != count or image > len(sizes):
                raise BatchError(f"a row's {count} image tokens are not whole images of the call")
            example = {media.pixels: pixels[first:image], "image_sizes": torch.tensor(sizes[first:image])}
            if numbers is not None:
                example["batch_num_images"] = torch.tensor([numbers[with_images]])
                with_images += 1
            split.append(example)
        if image != len(sizes) or (numbers is not None and with_images != len(numbers)):
            raise BatchError("the call's images are more than its rows' image tokens")
        return split

    def _check_tokens(self, example: Any, expected: list[int], placeholders: int, index: int) -> None:
        """The placeholders of each image one run of its own count, in the order of its pixels; the runs of images
        written next to each other may merge."""
        if placeholders != sum(expected):
            raise BatchError(f"example {index} has {placeholders} image tokens but its {len(expected)} image(s) make "
                             f"{sum(expected)} ({expected}, by their image_sizes): the text and the pixels do not "
                             "belong together; pass the processor's output as made")
        ids = np.asarray(example["input_ids"]).reshape(-1)
        placeholder = np.concatenate([[False], ids == self.token_ids[self.media[0].name], [False]])
        edges = np.flatnonzero(placeholder[1:] != placeholder[:-1])
        runs = (edges[1::2] - edges[::2]).tolist()
        if not set(itertools.accumulate(runs)) <= set(itertools.accumulate(expected)):
            raise BatchError(f"example {index}: its image tokens run {runs} but its images make {expected} in that "
                             "order: every image's tokens must be one run of its own length, in the order of its "
                             "pixels, as the processor makes them")


@dataclass(frozen=True)
class AnyResolutionPacking(MultimodalPacking):
    """The ``wrap_collator`` of LLaVA-OneVision: an :class:`AnyResolutionCollator` of the model config's layout."""

    media: tuple[Media, ...] = ANY_RESOLUTION_MEDIA

    def __call__(self, collator: Any, model_config: Any) -> AnyResolutionCollator:
        token_ids = {media.name: config_value(model_config, media.token_id) for media in self.media}
        return AnyResolutionCollator(collator, self.media, token_ids, layout=AnyResolution.of(model_config))


LLAVA_ONEVISION = VisionLanguage(
    Architecture("llava_onevision", model_types=("llava_onevision",), kind="decoder", features=window_features,
                 default_pooling="last", wrap_collator=AnyResolutionPacking(),
                 description="LLaVA-OneVision image-text models (any-resolution patches, per-patch vision tower)"),
    towers=("vision_tower",), idle_image=any_resolution_idle_image)
register_architectures, patch_model = LLAVA_ONEVISION.hooks()
