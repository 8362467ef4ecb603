"""Image-text (and video-text) examples packed into one row, each example's media kept with its own tokens.

A vision-language processor (``AutoProcessor``) makes, per example, the text with one placeholder token per visual
token (``<|image_pad|>`` repeated), the pixels of its images as rows (``pixel_values``: ``[patches, dim]``) and each
image's grid (``image_grid_thw``: ``[images, 3]``). :class:`MultimodalCollator` consumes these as made:

* the text goes through the task's collator (labels, boundaries, text positions restarting per example); the
  placeholder tokens get no label when labels are taken from ``input_ids``;
* every media key is concatenated in example order — the model fills the placeholders of the packed row in that
  order, so each example's tokens get its own pixels; examples without media contribute nothing;
* each example is checked before anything is packed: its placeholders match its media (grid ``t·h·w / merge²``
  tokens per item, ``t·h·w`` pixel rows), a grid comes with its pixels, and nothing is truncated;
* positions: with a per-example position function (Qwen's mRoPE), ``position_ids`` becomes ``[4, 1, T]`` — the text
  row first (transformers' layout, which says where examples start), then the three rotary rows of every example
  computed as if it ran alone;
* a placeholder token of a media the example has none of, typed text (0) by the example's own
  ``mm_token_type_ids`` — one a model generated in a completion — is text: the model fills placeholders only with
  the media it is given, so it embeds that token and positions it as text (:meth:`MultimodalCollator.placeholders`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from padfree_plugins.errors import BatchError
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.packing.collator import as_examples
from padfree_plugins.packing.prefixes import Segment, set_segments, shared_layout

#: The per-token modality of a processor's output (0 text, 1 image, 2 video), consumed for the positions.
TOKEN_TYPES_KEY = "mm_token_type_ids"
#: The per-token modalities a processor may make (Qwen's ``mm_token_type_ids``; Gemma 3's ``token_type_ids``, 1 at
#: image tokens), both readable off the placeholders.
MODALITY_KEYS = (TOKEN_TYPES_KEY, "token_type_ids")


@dataclass(frozen=True)
class Media:
    """One kind of media a processor makes, and how its placeholders are counted.

    ``pixels``: its pixel rows, concatenated across examples (an image, a sub-image tile, a grid cell: whatever the
    processor makes one row of); ``token_id``: the config attribute naming its placeholder token; ``modality``: its
    number in ``mm_token_type_ids``. Then one of:

    * ``grid`` (Qwen-VL): one ``[t, h, w]`` row per item; an item has ``t·h·w`` pixel rows and ``t·h·w / merge²``
      placeholders;
    * ``tokens_per_row`` (Gemma 3, Idefics3 / SmolVLM): every pixel row is ``tokens_per_row`` placeholders (an int,
      or a config attribute path), one run each;
    * neither (LLaVA-OneVision's any-resolution images): the model checks the count itself.

    ``per_row``: other keys with one entry per pixel row, concatenated like the pixels (``pixel_attention_mask``);
    ``extra``: per-item values (``second_per_grid_ts``, ``image_sizes``); ``batch_dim``: the model takes the
    pixels (and ``per_row`` keys) with a leading batch dimension, ``[1, rows, …]``.
    """

    name: str
    pixels: str
    grid: str | None
    token_id: str
    modality: int
    extra: tuple[str, ...] = ()
    #: Each item's placeholders are one run of tokens in the text (``False`` where a processor interleaves other
    #: tokens, as Qwen3-VL's timestamps between a video's frames).
    one_run_per_item: bool = True
    tokens_per_row: int | str | None = None
    per_row: tuple[str, ...] = ()
    batch_dim: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key in (self.pixels, self.grid, *self.per_row, *self.extra) if key is not None)


def _tensor(value: Any, key: str, index: int) -> torch.Tensor:
    try:
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as error:
        raise BatchError(f"example {index}: {key!r} is not an array ({type(value).__name__}): {error}") from None


@dataclass
class MultimodalCollator:
    """The task's ``collator`` with media packed beside it (see the module docstring). ``token_ids``: each media's
    placeholder token id; ``merge``: visual tokens per grid cell are ``1 / merge²``; ``positions(input_ids,
    token_types, grids) -> [3, L]`` per example, or ``None``."""

    collator: Any
    media: tuple[Media, ...]
    token_ids: Mapping[str, int]
    merge: int = 1
    positions: Callable[..., torch.Tensor] | None = None
    #: Placeholders per pixel row of each ``tokens_per_row`` media, resolved from the config.
    row_tokens: Mapping[str, int] = field(default_factory=dict)
    #: Pixels of one grid cell (the vision tower's patch, ``patch_size²``), for :meth:`media_pixels`.
    patch_area: int = 1
    #: Why this family's image-text prompts cannot be held once in a shared row (:func:`share_prompts`), or ``None``:
    #: they can (its media of equal prompts computed once give what each row computes alone). A family whose model
    #: mixes media across a row's items sets the reason; ``prefix_sharing: auto`` is then off, ``on`` refused.
    why_prompts_not_shared: str | None = None

    @property
    def packing(self) -> Any:
        return getattr(self.collator, "packing", self.collator)

    def __getattr__(self, name: str) -> Any:
        """What trainers read from the task's collator (``labelled_logits_only``, ``max_length`` …)."""
        if name == "collator":  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.collator, name)

    @property
    def media_keys(self) -> tuple[str, ...]:
        return tuple(key for media in self.media for key in media.keys)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> Any:
        examples = as_examples(examples)
        consumed = (*self.media_keys, TOKEN_TYPES_KEY)
        items = [self._media_of(example, index) for index, example in enumerate(examples)]
        texts = [{key: value for key, value in example.items() if key not in consumed} for example in examples]
        if self._labels_from_input_ids() and any(found for found, _ in items):
            texts = [self._unlabelled_placeholders(text) for text in texts]
        batch = self.collator(texts)
        lengths = batch["cu_seq_lens_q"].diff().tolist()
        for index, (example, length) in enumerate(zip(texts, lengths)):
            if length != len(example["input_ids"]) and items[index][0]:
                raise BatchError(f"example {index} holds {len(example['input_ids'])} tokens with images or video, "
                                 f"more than the collator keeps ({length}): truncating it would cut placeholders "
                                 "from their pixels. Raise max_length or drop the example")
        batch.update(self._joined(items))
        if self.positions is not None:
            batch["position_ids"] = self._positions(batch, examples, items, lengths)
        keys = tuple(key for key in self.media_keys if key in batch)
        if getattr(batch, "model_keys", None) is not None:
            batch.model_keys = tuple(dict.fromkeys((*batch.model_keys, *keys)))
        return batch

    def media_batch(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """The media keys :meth:`__call__` packs for ``examples`` (each example's media checked against its
        placeholders, then concatenated in example order), without collating their text."""
        return self._joined([self._media_of(example, index) for index, example in enumerate(as_examples(examples))])

    def _joined(self, items: list) -> dict[str, torch.Tensor]:
        """Every media key of the examples' ``items`` (:meth:`_media_of`) concatenated in example order."""
        joined = {}
        for media in self.media:
            for key in media.keys:
                values = [found[key] for found, _ in items if key in found]
                if values:
                    joined[key] = torch.cat(values)
                    if media.batch_dim and key in (media.pixels, *media.per_row):
                        joined[key] = joined[key][None]
        return joined

    def split_call(self, inputs: Mapping[str, Any], rows: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        """The media of a padded call split by row, each row's as :meth:`__call__` takes one example's.

        ``inputs``: the call's keyword arguments, every row's media given together as a processor makes them for a
        batch; ``rows``: each row's real tokens (1-D, on the CPU), in row order. Each row takes the next items
        (images, videos, tiles) whose placeholders make its own count, and their pixel rows; every item and pixel
        row must be taken. A :class:`~padfree_plugins.errors.BatchError` says why a call cannot be split (it then
        runs padded). This is the one way a family declares how its padded media divide into rows: a family whose
        media are laid out otherwise overrides it (:class:`~padfree_plugins.builtin.architectures.idefics3.
        TiledCollator`: tiles batched per row; ``AnyResolutionCollator``: patches per image, sizes by image)."""
        split: list[dict[str, Any]] = [{} for _ in rows]
        for media in self.media:
            if inputs.get(media.pixels) is None:
                given = [key for key in media.keys if inputs.get(key) is not None]
                if given:
                    raise BatchError(f"a call with {', '.join(map(repr, given))} and no {media.pixels!r}")
                continue  # its placeholders, if any, are checked per example (:meth:`placeholders`)
            counts = [int((tokens == self.token_ids[media.name]).sum()) for tokens in rows]
            pixels = self._unbatched_pixels(media, inputs[media.pixels])
            sizes = self._item_sizes(media, inputs, pixels)
            per_item = {key: inputs[key] for key in (media.grid, *media.extra)
                        if key is not None and inputs.get(key) is not None}
            per_pixel_row = {key: self._unbatched_pixels(media, inputs[key]) for key in media.per_row
                             if inputs.get(key) is not None}
            item = pixel_row = 0
            for example, count in zip(split, counts):
                first, tokens = item, 0
                while tokens < count and item < len(sizes):
                    tokens, item = tokens + sizes[item][0], item + 1
                if tokens != count:
                    raise BatchError(f"a row's {count} {media.name} tokens are not whole {media.name}s of the call")
                if item == first:
                    continue
                taken = sum(size[1] for size in sizes[first:item])
                for key, value in (*per_pixel_row.items(), (media.pixels, pixels)):
                    example[key] = value[pixel_row:pixel_row + taken]
                for key, value in per_item.items():
                    example[key] = value[first:item]
                pixel_row += taken
            if item != len(sizes) or pixel_row != pixels.shape[0]:
                raise BatchError(f"the call's {media.name}s are more than its rows' {media.name} tokens")
        return split

    def media_pixels(self, example: Mapping[str, Any]) -> int:
        """The pixels the vision tower embeds for one example (its media as :meth:`__call__` takes them): height ×
        width of every image, tile, patch or temporal patch as the processor resized it — grid cells × the patch's
        pixels, or each pixel row's last two dimensions."""
        found, _ = self._media_of(example, 0)
        pixels = 0
        for media in self.media:
            if media.grid is not None and media.grid in found:
                pixels += int(found[media.grid].prod(-1).sum()) * self.patch_area
            elif media.pixels in found:
                value = found[media.pixels]
                pixels += value.numel() // value.shape[-3] if value.ndim >= 3 else 0
        return pixels

    def _unbatched_pixels(self, media: Media, value: Any) -> torch.Tensor:
        """A call's pixel rows (or per-row values) without the batch dimension of a ``batch_dim`` media."""
        value = torch.as_tensor(value)
        if media.batch_dim:
            if value.shape[0] != 1:
                raise BatchError(f"{media.pixels!r} of shape {tuple(value.shape)}: expected one batch row")
            value = value[0]
        return value

    def _item_sizes(self, media: Media, inputs: Mapping[str, Any], pixels: torch.Tensor) -> list[tuple[int, int]]:
        """Each item's placeholders and pixel rows, in the call's order."""
        if media.grid is not None:
            if inputs.get(media.grid) is None:
                raise BatchError(f"a call with {media.pixels!r} and no {media.grid!r}")
            cells = torch.as_tensor(inputs[media.grid]).detach().cpu().long().reshape(-1, 3).prod(-1).tolist()
            return [(cell // self.merge ** 2, cell) for cell in cells]
        if media.tokens_per_row is not None:
            return [(self.row_tokens[media.name], 1)] * pixels.shape[0]
        raise BatchError(f"{type(self).__name__} does not split a padded call's {media.name}s by row: its family "
                         "declares neither grids nor tokens per pixel row, and overrides no split_call")

    def _labels_from_input_ids(self) -> bool:
        return bool(getattr(self.collator, "labels_from_input_ids", False))

    def _unlabelled_placeholders(self, example: dict) -> dict:
        """Labels taken from ``input_ids`` with every placeholder token ``-100`` (a visual token predicts nothing)."""
        if "labels" in example:
            return example
        ids = np.asarray(example["input_ids"]).reshape(-1)
        labels = np.where(np.isin(ids, list(self.token_ids.values())), -100, ids)
        return {**example, "labels": labels.tolist()}

    def placeholders(self, example: Mapping[str, Any], media: Media) -> np.ndarray:
        """Where ``example``'s tokens are ``media``'s placeholders (bool, one per token). Where the example has none
        of that media and gives its own ``mm_token_type_ids``, the tokens it types as text (0) are left out: a
        placeholder a model generated in a completion, which the model, given no such media, embeds and positions
        as text (Qwen-VL's forward fills placeholders only with the media it is given)."""
        ids = np.asarray(example["input_ids"]).reshape(-1)
        found = ids == self.token_ids[media.name]
        types = example.get(TOKEN_TYPES_KEY)
        if types is None or any(example.get(key) is not None for key in media.keys):
            return found
        types = np.asarray(types).reshape(-1)
        if types.shape != ids.shape:
            raise BatchError(f"{TOKEN_TYPES_KEY!r} of {types.shape[0]} tokens for {ids.shape[0]} input_ids")
        return found & (types != 0)

    def _media_of(self, example: Mapping[str, Any], index: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """An example's media tensors (by key) and its placeholder count per media, checked against each other."""
        ids = np.asarray(example["input_ids"]).reshape(-1)
        found: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        for media in self.media:
            placeholders = int(self.placeholders(example, media).sum())
            counts[media.name] = placeholders
            pixels = example.get(media.pixels)
            grid = example.get(media.grid) if media.grid is not None else None
            if pixels is None and grid is None:
                if placeholders:
                    needs = " and ".join(repr(key) for key in (media.pixels, media.grid) if key is not None)
                    raise BatchError(f"example {index} has {placeholders} {media.name} tokens but no "
                                     f"{media.pixels!r}: pass the processor's {needs} with the text")
                continue
            if pixels is None:
                raise BatchError(f"example {index} has {media.grid!r} but no {media.pixels!r}")
            pixels = _tensor(pixels, media.pixels, index)
            if media.grid is not None:
                if grid is None:
                    raise BatchError(f"example {index} has {media.pixels!r} but no {media.grid!r}: without each "
                                     f"{media.name}'s grid its pixels cannot be split into {media.name}s; pass the "
                                     "processor's output whole")
                grid = _tensor(grid, media.grid, index).long().reshape(-1, 3)
                found[media.grid] = grid
                self._check_grid(ids, media, pixels, grid, placeholders, index)
            elif media.tokens_per_row is not None:
                self._check_rows(ids, media, pixels, placeholders, index)
            found[media.pixels] = pixels
            for key in media.per_row:
                if example.get(key) is not None:
                    found[key] = _tensor(example[key], key, index)
                    if found[key].shape[0] != pixels.shape[0]:
                        raise BatchError(f"example {index}: {key!r} has {found[key].shape[0]} rows for "
                                         f"{pixels.shape[0]} rows of {media.pixels!r}")
            for key in media.extra:
                if example.get(key) is not None:
                    value = _tensor(example[key], key, index)
                    found[key] = value.reshape(-1) if value.ndim <= 1 else value
        return found, counts

    def _check_grid(self, ids: np.ndarray, media: Media, pixels: torch.Tensor, grid: torch.Tensor,
                    placeholders: int, index: int) -> None:
        cells = int(grid.prod(-1).sum())
        if pixels.shape[0] != cells:
            raise BatchError(f"example {index}: {media.pixels!r} has {pixels.shape[0]} rows but its "
                             f"{media.grid} {grid.tolist()} makes {cells}")
        expected = cells // (self.merge ** 2)
        if placeholders != expected:
            raise BatchError(f"example {index} has {placeholders} {media.name} tokens but its {len(grid)} "
                             f"{media.name}(s) make {expected} (grid {grid.tolist()}, merge {self.merge}): the "
                             "text and the pixels do not belong together; pass the processor's output as made")
        if media.one_run_per_item:
            self._check_runs(ids, media, (grid.prod(-1) // (self.merge ** 2)).tolist(), index,
                             f"(grid {grid.tolist()})")

    def _check_rows(self, ids: np.ndarray, media: Media, pixels: torch.Tensor, placeholders: int,
                    index: int) -> None:
        per_row = self.row_tokens[media.name]
        if placeholders != pixels.shape[0] * per_row:
            raise BatchError(f"example {index} has {placeholders} {media.name} tokens but {pixels.shape[0]} rows of "
                             f"{media.pixels!r} at {per_row} tokens each make {pixels.shape[0] * per_row}: the text "
                             "and the pixels do not belong together; pass the processor's output as made")
        if media.one_run_per_item:
            self._check_runs(ids, media, [per_row] * pixels.shape[0], index, f"({per_row} per pixel row)")

    def _check_runs(self, ids: np.ndarray, media: Media, expected: list[int], index: int, why: str) -> None:
        """Each item's placeholders one run of its own length, in the order of its pixels: the model fills them in
        that order, so a split or reordered run would give an image another's pixels."""
        placeholder = np.concatenate([[False], ids == self.token_ids[media.name], [False]])
        edges = np.flatnonzero(placeholder[1:] != placeholder[:-1])
        runs = (edges[1::2] - edges[::2]).tolist()
        if runs != expected:
            raise BatchError(f"example {index}: its {media.name} tokens run {runs} but its {media.name}s make "
                             f"{expected} in that order {why}: every {media.name}'s tokens must be one run of its "
                             "own length, in the order of its pixels, as the processor makes them")

    def _positions(self, batch: Mapping[str, Any], examples: Sequence[Mapping[str, Any]],
                   items: list, lengths: list[int]) -> torch.Tensor:
        """``[4, 1, T]``: the text positions, then each example's rotary rows computed for it alone."""
        rows = []
        for example, (found, _), length in zip(examples, items, lengths):
            ids = torch.as_tensor(np.asarray(example["input_ids"]).reshape(-1)[:length], dtype=torch.long)
            types = torch.zeros_like(ids)
            for media in self.media:
                types[torch.as_tensor(self.placeholders(example, media)[:length])] = media.modality
            grids = {media.grid: found.get(media.grid) for media in self.media if media.grid is not None}
            grids.update({key: found[key] for media in self.media for key in media.extra if key in found})
            rows.append(self.positions(ids, types, grids))
        text = batch["position_ids"].reshape(1, 1, -1)
        return torch.cat([text, torch.cat(rows, dim=1)[:, None].to(text.dtype)])


def media_equal(one: Mapping[str, Any], two: Mapping[str, Any]) -> bool:
    """Whether two examples' media (as :meth:`MultimodalCollator.split_call` gives them) are the same: the same keys,
    and tensors of equal shapes and values (pixels compared, never only the placeholders)."""
    if one.keys() != two.keys():
        return False
    for key in one:
        a, b = torch.as_tensor(one[key]), torch.as_tensor(two[key])
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b.to(a.device)):
            return False
    return True


def prompt_examples(examples: Sequence[Mapping[str, Any]], segments: Sequence[Segment]) -> list[Mapping[str, Any]]:
    """The examples whose media a shared row holds, in the row's order: the example of every segment without a
    parent (a shared prompt's first row, or a row kept whole); a completion holds no media."""
    return [examples[segment.row] for segment in segments if segment.parent < 0]


def share_prompts(collator: MultimodalCollator, examples: Sequence[Mapping[str, Any]], batch: PackedBatch,
                  prefixes: Sequence[tuple[int, Any] | None]) -> tuple[PackedBatch, torch.Tensor] | None:
    """``batch`` (``collator``'s packed row of ``examples`` whole) with each repeated prompt held once, its media
    once, and the packed tokens the shared row keeps (int64, into ``batch``'s row); ``None`` when no prompt repeats.

    ``prefixes``: per example, as :func:`~padfree_plugins.packing.prefixes.shared_layout` takes them — equal keys only
    for prompts equal in their tokens and in the media they hold, and every media placeholder of an example that
    shares inside its prompt. Every per-token value keeps the tokens the shared row holds, so a completion keeps the
    positions (the mRoPE rows too, ``[4, 1, T]``) it has in its whole row; the media are the collator's for the
    examples of :func:`prompt_examples`, in the row's order (each prompt's images once)."""
    cu = batch["cu_seq_lens_q"].long().tolist()
    total = cu[-1]
    segments = shared_layout([end - start for start, end in zip(cu, cu[1:])], prefixes)
    if not any(segment.parent >= 0 for segment in segments):
        return None
    index = torch.cat([torch.arange(segment.length) + cu[segment.row] + segment.start for segment in segments])
    media = collator.media_batch(prompt_examples(examples, segments))
    shared = PackedBatch()
    for key, value in batch.items():
        if key in collator.media_keys:
            continue
        if isinstance(value, torch.Tensor) and key == "position_ids" and value.ndim == 3:
            shared[key] = value.index_select(2, index.to(value.device))
        elif isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (1, total):
            shared[key] = value.index_select(1, index.to(value.device))
        else:
            shared[key] = value
    for key in collator.media_keys:
        if key in media:
            shared[key] = media[key]
    set_segments(shared, batch, segments)
    return shared, index


@dataclass(frozen=True)
class MultimodalPacking:
    """What a vision-language family declares as its ``Architecture.wrap_collator``: called at assembly with the
    task's collator and the model config, it returns the :class:`MultimodalCollator`. ``merge_size``: the config
    attribute path of the spatial merge; ``positions(model_config)``: the per-example position function."""

    media: tuple[Media, ...]
    merge_size: str = "vision_config.spatial_merge_size"
    positions: Callable[[Any], Any] | None = None

    @property
    def model_keys(self) -> tuple[str, ...]:
        return tuple(key for media in self.media for key in media.keys)

    def __call__(self, collator: Any, model_config: Any) -> MultimodalCollator:
        token_ids = {media.name: config_value(model_config, media.token_id) for media in self.media}
        row_tokens = {media.name: media.tokens_per_row if isinstance(media.tokens_per_row, int) else
                      config_value(model_config, media.tokens_per_row)
                      for media in self.media if media.tokens_per_row is not None}
        positions = self.positions(model_config) if self.positions is not None else None
        merge = int(config_value(model_config, self.merge_size) or 1)
        patch = int(config_value(model_config, "vision_config.patch_size") or 1)
        return MultimodalCollator(collator, self.media, token_ids, merge, positions, row_tokens, patch * patch)


def config_value(config: Any, path: str) -> Any:
    """``config``'s attribute at a dotted ``path`` (``"vision_config.spatial_merge_size"``), ``None`` if absent."""
    for name in path.split("."):
        config = getattr(config, name, None)
    return config
