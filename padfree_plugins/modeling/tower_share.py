"""The vision tower of an image-text row under sequence parallelism, run by each rank on its own media.

Every rank of a group gets the group's whole image-text row (every rank's media joined in rank order, the order the
model fills the placeholders in) and its language model cuts this rank's slice after the features are merged
(:class:`~padfree_plugins.modeling.sequence_parallel.SliceRow`). The tower need not run on every image on every
rank: :class:`TowerShare`, in place of the base model's ``get_image_features`` / ``get_video_features``, runs the
original on this rank's own pixel rows and grids only (:data:`MEDIA_SHARES`: every rank's count of each media key,
published around the model call) and all-gathers the features (:class:`_GatherFeatures`, rank order) so that the
model merges the whole row's as before; the pixels (:data:`PIXEL_KEYS`) are therefore not exchanged with the row
(:func:`kept_media`). Its backward sums the features' gradients over the group (each rank's slice
uses every image's features) and hands each rank its own images' part: a rank's tower gets its own images' whole
gradient, which the data-parallel all-reduce sums over the group as before.

A rank whose micro-batch holds no media of the call's kind runs the tower on the family's idle image (every rank runs
the same modules: FSDP / ZeRO-3), whose output joins the features times zero. A family without ``get_image_features``
or an idle image keeps the whole tower on every rank, with a warning saying why (:func:`install_tower_share`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from padfree_plugins.errors import PadfreeError
from padfree_plugins.modeling.attention import ThreadValue
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.modeling.patching import own_attribute, restore_attributes, unwrap_model
from padfree_plugins.modeling.vision import TowerGuard, zero_sum

__all__ = ["MEDIA_SHARES", "PIXEL_KEYS", "TowerShare", "TowerShareHandle", "gather_features", "install_tower_share",
           "kept_media", "media_counts", "media_shares", "why_not_shared"]

#: Every rank's count of each media key of the group's joined row (``{key: [count per rank]}``), while the model
#: runs on it; ``None`` outside.
MEDIA_SHARES = ThreadValue(None)
#: True while :class:`TowerShare` runs the original on this rank's share (its own nested calls pass through: Qwen3-VL's
#: ``get_video_features`` calls ``get_image_features``).
_SHARING = ThreadValue(False)

#: The methods of a vision-language base model that run its tower on pixels.
FEATURE_METHODS = ("get_image_features", "get_video_features")
#: Their pixel inputs: another rank's rows of them are never encoded here, so they are not exchanged (:func:`kept_media`).
PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
#: The fields of their outputs that the model's forward merges (gathered); the others are left out.
GATHERED_FIELDS = ("pooler_output", "deepstack_features")


def media_counts(rows: Sequence[Mapping], media: Sequence[str]) -> dict[str, list[int]]:
    """Every rank's count (first axis) of each ``media`` key of the gathered ``rows`` (one per rank, in rank order);
    empty where no rank holds media."""
    return {key: [int(row[key].shape[0]) for row in rows] for key in media
            if all(isinstance(row.get(key), torch.Tensor) for row in rows)}


@contextlib.contextmanager
def media_shares(counts: Mapping[str, list[int]]) -> Iterator[None]:
    """Within the block, :data:`MEDIA_SHARES` is ``counts`` (none where ``counts`` is empty)."""
    previous = MEDIA_SHARES.set(dict(counts) or None)
    try:
        yield
    finally:
        MEDIA_SHARES.reset(previous)


class _GatherFeatures(torch.autograd.Function):
    """Every rank's ``own`` features ``[n_r, ...]`` concatenated in rank order; backward: the gradient summed over
    the group (every rank's loss reads every rank's features) and this rank's part returned."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, counts: list[int], group: SequenceGroup) -> torch.Tensor:
        ctx.counts, ctx.group = counts, group
        longest = max(counts)
        padded = own
        if own.shape[0] < longest:
            padded = torch.cat([own, own.new_zeros((longest - own.shape[0], *own.shape[1:]))])
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded.contiguous(), group=group.group)
        return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = sum_over_group(grad.contiguous().clone(), ctx.group)
        start = sum(ctx.counts[:ctx.group.rank])
        return summed.narrow(0, start, ctx.counts[ctx.group.rank]), None, None


def sum_over_group(grad: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """``grad`` summed over the ranks of ``group`` (in place)."""
    dist.all_reduce(grad, group=group.group)
    return grad


def gather_features(own: torch.Tensor, counts: list[int], group: SequenceGroup) -> torch.Tensor:
    """Differentiable all-gather of every rank's ``own`` features (first axis ``counts[r]``), in rank order."""
    return _GatherFeatures.apply(own, counts, group)


def _parts(value: Any) -> list[tuple[torch.Tensor, list[int] | None]]:
    """A gathered field's tensors as ``(tensor, per-item sizes)``: a tensor as it is (``None``), a tuple of per-image
    tensors concatenated (their sizes), a list of either (Qwen3-VL's deepstack layers) one part each."""
    if isinstance(value, torch.Tensor):
        return [(value, None)]
    if isinstance(value, tuple) and all(isinstance(item, torch.Tensor) for item in value):
        return [(torch.cat(value) if value else None, [int(item.shape[0]) for item in value])]
    if isinstance(value, list):
        return [part for item in value for part in _parts(item)]
    raise PadfreeError(f"an image-feature field of type {type(value).__name__} cannot be gathered over a sequence-"
                       "parallel group; train this model with sequence_parallel.size: 1")


def _rebuild(value: Any, parts: Iterator[torch.Tensor | tuple[torch.Tensor, ...]]) -> Any:
    if isinstance(value, list):
        return [_rebuild(item, parts) for item in value]
    return next(parts)


@dataclass
class TowerShare:
    """A base model's ``get_image_features`` / ``get_video_features`` (``original``, bound) under sequence
    parallelism: called on the group's joined media while :data:`MEDIA_SHARES` is set, it runs ``original`` on this
    rank's share of every media argument (the rows ranks before it hold skipped) — on ``idle_image`` where the share
    is empty — and returns the group's features all-gathered in rank order (see the module docstring). Any other call
    (one process, a padded batch, no media in the group) is ``original``'s."""

    original: Any
    idle: Any  # the base model's own get_image_features (bound), which runs the idle image
    idle_image: Callable[[Any], dict[str, torch.Tensor] | None]
    config: Any
    group: SequenceGroup

    @property
    def __signature__(self) -> inspect.Signature:
        """The original's: ``generate()`` reads it to pick the method's inputs out of its own."""
        return inspect.signature(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counts = MEDIA_SHARES.get()
        if counts is None or _SHARING.get():
            return self.original(*args, **kwargs)
        bound = inspect.signature(self.original).bind(*args, **kwargs)
        shared = {name: value for name, value in bound.arguments.items() if name in counts}
        if not shared:
            return self.original(*args, **kwargs)
        if any(not isinstance(value, torch.Tensor) or value.shape[0] != sum(counts[name])
               for name, value in shared.items()):
            found = {name: getattr(value, "shape", None) for name, value in shared.items()}
            raise PadfreeError(f"{type(self.original.__self__).__name__}.{self.original.__name__} was given media "
                               f"that are not the sequence-parallel group's joined row ({found}; every rank's counts: "
                               f"{counts}), so this rank's own cannot be picked out; train this model with "
                               "sequence_parallel.size: 1")
        rank = self.group.rank
        for name, value in shared.items():
            start = sum(counts[name][:rank])
            bound.arguments[name] = value.narrow(0, start, counts[name][rank])
        empty = any(counts[name][rank] == 0 for name in shared)
        previous = _SHARING.set(True)
        try:
            if empty:
                device = next(iter(shared.values())).device
                image = self.idle_image(self.config)
                output = self.idle(**{key: value.to(device) for key, value in image.items()}, return_dict=True)
            else:
                output = self.original(*bound.args, **bound.kwargs)
        finally:
            _SHARING.reset(previous)
        return self.gathered(output, empty)

    def gathered(self, output: Any, empty: bool) -> Any:
        """``output`` (this rank's share's features, or the idle image's where ``empty``) made the group's."""
        if not isinstance(output, Mapping) or output.get("pooler_output") is None:
            raise PadfreeError(f"{type(self.original.__self__).__name__}.{self.original.__name__} returned no "
                               "pooler_output, so the group's image features cannot be gathered under sequence "
                               "parallelism; train this model with sequence_parallel.size: 1")
        fields = {key: output[key] for key in GATHERED_FIELDS if output.get(key) is not None}
        parts = [part for value in fields.values() for part in _parts(value)]
        mine = [(0, []) if empty or tensor is None else (int(tensor.shape[0]), sizes) for tensor, sizes in parts]
        everyone: list[Any] = [None] * self.group.size
        dist.all_gather_object(everyone, mine, group=self.group.group)
        zero = zero_sum(output) if empty else 0
        whole = []
        for index, (tensor, sizes) in enumerate(parts):
            reference = tensor if tensor is not None else next(t for t, _ in parts if t is not None)
            own = reference[:0] if empty or tensor is None else tensor
            counts = [rank_parts[index][0] for rank_parts in everyone]
            joined = gather_features(own, counts, self.group)
            if index == 0:
                joined = joined + zero  # the idle image's tower in the graph, adding exactly zero
            if sizes is not None:
                joined = torch.split(joined, [size for rank_parts in everyone for size in rank_parts[index][1]])
            whole.append(joined)
        rebuilt = iter(whole)
        return type(output)(**{key: _rebuild(value, rebuilt) for key, value in fields.items()})


@dataclass
class TowerShareHandle:
    """The :class:`TowerShare` s installed on a base model (``saved``: its own attributes before); ``remove()``."""

    module: Any
    saved: dict

    def remove(self) -> None:
        restore_attributes(self.module, self.saved)
        self.saved = {}


def kept_media(model: Any, media: Sequence[str]) -> tuple[str, ...]:
    """The ``media`` keys each rank of the group keeps to itself (:data:`PIXEL_KEYS`) where ``model``'s feature
    methods are :class:`TowerShare` s (its tower encodes only this rank's own); none otherwise."""
    base = unwrap_model(model)
    base = getattr(base, "base_model", base)
    if not isinstance(base.__dict__.get("get_image_features"), TowerShare):
        return ()
    return tuple(key for key in media if key in PIXEL_KEYS)


def why_not_shared(model: Any, idle_image: Callable[[Any], Any] | None) -> str | None:
    """Why each rank cannot run the tower on its own media only (``None`` when it can)."""
    base = getattr(model, "base_model", model)
    if not callable(getattr(base, "get_image_features", None)):
        return f"{type(base).__name__} has no get_image_features to run on each rank's own images"
    if idle_image is None or idle_image(base.config) is None:
        return (f"{type(base).__name__} has no idle image, which a rank without images of its own would run the tower "
                "on")
    return None


def idle_image_of(handles: Sequence[Any]) -> Callable[[Any], Any] | None:
    """The idle image of the model's vision towers (its :class:`~padfree_plugins.modeling.vision.TowerGuard`, among
    a patch's ``handles``), or ``None``."""
    for handle in handles:
        if isinstance(handle, TowerGuard) and handle.idle is not None:
            return handle.idle.idle_image
    return None


def install_tower_share(model: Any, group: SequenceGroup, handles: Sequence[Any]) -> TowerShareHandle | None:
    """Make the base model's feature methods :class:`TowerShare` s (the idle image: the towers' of ``handles``, a
    patch's); where it cannot (:func:`why_not_shared`), every rank keeps running the tower on the whole row, said once
    in a warning, and ``None`` is returned."""
    idle_image = idle_image_of(handles)
    reason = why_not_shared(model, idle_image)
    if reason:
        warnings.warn(f"sequence_parallel: every rank runs the vision tower on all the images of its group's row "
                      f"(not only its own): {reason}", stacklevel=3)
        return None
    base = getattr(model, "base_model", model)
    idle = base.get_image_features
    saved = {}
    for name in FEATURE_METHODS:
        original = getattr(base, name, None)
        if callable(original):
            saved[name] = own_attribute(base, name)
            setattr(base, name, TowerShare(original, idle, idle_image, base.config, group))
    return TowerShareHandle(base, saved)

