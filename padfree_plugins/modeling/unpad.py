"""Padded in, padded out: an ordinary padded batch run padding-free inside the model's body.

Code that calls a patched model with a padded batch — a ``Trainer`` subclass with its own ``compute_loss``, TRL's
trainers, a hand-written loop — gets the speed of padding-free with its own loss untouched. At the entry of the
base model (the transformer body) the real tokens of every row are packed into one row, with the position ids the
padded forward would have used (the given ``position_ids``, else each token's column: transformers' default) and
the boundaries computed once — one read from the device per forward, never per layer; every layer then runs on
real tokens only; at the exit, every per-token output is scattered back to the padded shape (zeros at pads), so
the head, the loss and the caller see what a padded forward returns.

A call is unpadded when it has a 2-D ``attention_mask`` whose ones are contiguous in every row (left or right
padding) and at least one pad, no cache and no request for attention weights; with ``unpad: auto`` only in training
mode (``always``: evaluation and ``no_grad`` forwards too, e.g. a reference model's log-probabilities). Every other
call — ``generate()``, a cached step, a batch without padding (which so costs nothing extra), a mask with holes — runs
the model's own padded code, exactly as unpatched. A label on a left-padded row's first real token is predicted,
padded, from the pad before it, which a packed row does not hold: a call whose labels give any pad a token to
predict runs padded (collators set such labels to -100, and the check rides on the one transfer). So does a
vision-language call with images or video, or with 3-D (mRoPE) positions: pack such batches with the multimodal
collator instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from padfree_plugins.modeling.patching import bound_inputs
from padfree_plugins.packing.batch import BOUNDARY_KEYS, MEDIA_KEYS
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, Segment, SharedPrefixes, prefix_tree

#: ``unpad`` modes a config may name.
UNPAD_MODES = ("auto", "always", "off")
#: Keys of the padded call that the packed call replaces or drops.
REPLACED_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position")
#: Why a call without any pad is not packed: nothing to gain (it runs as it is, padded by nothing).
NO_PADDING = "it holds no pad"
#: Why a call's repeated prompts were held more than once: sharing them would not save the mixers' chunks.
CHUNK_RULE = ("its sequence mixers pad every segment to {chunk} tokens, and sharing some of these prefixes (prefixes "
              "or continuations shorter than a chunk) would keep more activations than the rows whole; those are "
              "held in each row instead, the rest stays shared")
#: Told why a call is not packed: ``refused(reason, detail)`` (``reason`` a short fixed phrase, one per kind of
#: refusal; ``detail`` this call's particulars, or ``""``).
Refused = Callable[[str, str], None]


def ignore_refusal(reason: str, detail: str = "") -> None:
    """A :data:`Refused` that is told nothing (the caller does not ask why)."""


@dataclass(frozen=True)
class Unpadded:
    """Where a padded call's real tokens went: ``index`` (int64 ``[T]``) are their flat positions in the padded
    ``[rows, width]`` grid, in packed order."""

    rows: int
    width: int
    index: torch.Tensor

    def scatter(self, value: Any) -> Any:
        """``value`` with every packed per-token tensor (``[1, T, …]``, or ``[T, …]`` as MoE router logits are)
        put back in the padded shape, zeros at pads; tuples and model outputs field by field."""
        total = self.index.numel()
        if isinstance(value, torch.Tensor):
            if value.ndim >= 2 and value.shape[0] == 1 and value.shape[1] == total:
                return self._grid(value[0]).reshape(self.rows, self.width, *value.shape[2:])
            if value.ndim >= 2 and value.shape[0] == total:
                return self._grid(value)
            return value
        if isinstance(value, tuple):
            items = [self.scatter(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if hasattr(value, "keys") and hasattr(value, "__setitem__"):  # a transformers ModelOutput (or a dict)
            for key in list(value.keys()):
                value[key] = self.scatter(value[key])
        return value

    def _grid(self, tokens: torch.Tensor) -> torch.Tensor:
        grid = tokens.new_zeros(self.rows * self.width, *tokens.shape[1:])
        return grid.index_copy(0, self.index.to(tokens.device), tokens)


def contiguous_rows(mask: torch.Tensor, labels: torch.Tensor | None = None,
                    refused: Refused = ignore_refusal) -> list[tuple[int, int]] | None:
    """``(first, length)`` of each row's ones, read in one transfer from the device; ``None`` when a row's ones are
    not contiguous (a mask with holes), the mask is not 0 / 1, or ``labels`` (the head's, ``[rows, width]``) give
    a pad a token to predict: the padded loss then holds a term computed from a pad, which a packed row has not
    (``refused`` is told which)."""
    ones = mask != 0
    width = mask.shape[1]
    lengths = ones.sum(1)
    first = ones.int().argmax(1)
    last = width - 1 - ones.flip(1).int().argmax(1)
    binary = ((mask == 0) | (mask == 1)).all(1)
    from_a_pad = torch.zeros_like(binary)
    if labels is not None and labels.shape == mask.shape:
        from_a_pad = ((labels[:, 1:] != -100) & ~ones[:, :-1]).any(1)
    stats = torch.stack([lengths, first, last, binary.long(), from_a_pad.long()], 1).tolist()
    rows = []
    for row, (length, start, end, is_binary, predicted_from_a_pad) in enumerate(stats):
        if not is_binary:
            refused("its attention_mask holds values other than 0 and 1", f"row {row}")
            return None
        if predicted_from_a_pad:
            refused("its labels give a pad a token to predict (padded, a pad's logits score it; packed, no pad "
                    "exists)", f"row {row}")
            return None
        if length and end - start + 1 != length:
            refused("its attention_mask has holes (a row's real tokens are not one run)", f"row {row}")
            return None
        rows.append((start, length))
    return rows


def pack_padded_call(inputs: dict, mask: torch.Tensor, labels: torch.Tensor | None = None,
                     without_padding: bool = False, share_prefixes: bool = False,
                     refused: Refused = ignore_refusal, chunk: int = 1, unshared: Refused = ignore_refusal
                     ) -> tuple[dict, Unpadded] | None:
    """The packed call of a padded one (``inputs``: the base model's keyword arguments; ``labels``: those the
    model's head got), and where its tokens went; ``None`` when the call is not one to unpad (see the module
    docstring). ``without_padding``: a call without any pad is packed too (sequence parallelism splits its row).
    ``share_prefixes``: rows that begin with the same unlabelled tokens at the same positions (a DPO pair's prompt,
    a GRPO group's, the turns a multi-turn episode's rollouts share) hold them once, as prefix segments their rests
    continue (:func:`shared_rows`; ``chunk``: the model's mixers',
    :func:`~padfree_plugins.modeling.mixers.mixer_chunk`; ``unshared`` is told where the chunk keeps repeated prompts
    whole, :data:`CHUNK_RULE`); such a call is packed even without a pad. ``refused`` is told why a call is not
    packed (:data:`NO_PADDING` for a call without a pad)."""
    tokens = inputs.get("input_ids")
    tokens = inputs.get("inputs_embeds") if tokens is None else tokens
    if tokens is None or mask.ndim != 2 or tuple(tokens.shape[:2]) != tuple(mask.shape):
        refused("its attention_mask is not 2-D with the shape of its tokens", "")
        return None
    rows, width = mask.shape
    spans = contiguous_rows(mask, labels, refused)
    if spans is None:
        return None
    if not any(length for _, length in spans):
        refused("no row holds a real token", "")
        return None
    given = inputs.get("position_ids")
    given = given if isinstance(given, torch.Tensor) and given.shape == mask.shape else None
    segments = shared_rows(inputs.get("input_ids"), given, labels, spans, chunk, unshared) if share_prefixes else None
    if segments is None and not without_padding and all(length == width for _, length in spans):
        refused(NO_PADDING, "")
        return None
    if segments is None:
        segments = [Segment(row, 0, length) for row, (_, length) in enumerate(spans) if length]
    index = torch.cat([torch.arange(segment.length) + segment.row * width + spans[segment.row][0] + segment.start
                       for segment in segments])
    device = tokens.device
    on_device = index.to(device, non_blocking=True)
    sizes = [segment.length for segment in segments]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(sizes).cumsum(0)]).to(device, torch.int32)
    positions = given.reshape(-1).index_select(0, on_device) if given is not None else on_device % width
    packed = {key: value for key, value in inputs.items() if key not in REPLACED_KEYS}
    for key, value in list(packed.items()):  # other per-token inputs (token_type_ids …) are packed alike
        if isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (rows, width):
            packed[key] = value.reshape(rows * width, *value.shape[2:]).index_select(0, on_device)[None]
    name = "input_ids" if inputs.get("input_ids") is not None else "inputs_embeds"
    packed[name] = tokens.reshape(rows * width, *tokens.shape[2:]).index_select(0, on_device)[None]
    longest = max(sizes)
    packed.update(position_ids=positions[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                  max_length_k=longest)
    parents = [segment.parent for segment in segments]
    if any(parent >= 0 for parent in parents):
        packed[SHARED_PREFIXES_KEY] = SharedPrefixes.build(sizes, parents, device)
    return packed, Unpadded(rows, width, index)


def shared_rows(input_ids: torch.Tensor | None, position_ids: torch.Tensor | None, labels: torch.Tensor | None,
                spans: list[tuple[int, int]], chunk: int = 1, unshared: Refused = ignore_refusal
                ) -> list[Segment] | None:
    """The segments of a padded call's rows (real tokens ``spans``) with their repeated prefixes shared, to any depth
    (:func:`~padfree_plugins.packing.prefixes.prefix_tree`), or ``None`` when no two rows share one. A row's
    shareable prefix is its tokens before the first that predicts a label (at most all but its last token: every
    completion keeps one), each with its position; one read from the device. Without token ids or labels nothing is
    shared."""
    if not isinstance(input_ids, torch.Tensor) or not isinstance(labels, torch.Tensor) or \
            labels.shape != input_ids.shape:
        return None
    rows, width = input_ids.shape
    predicts = labels[:, 1:] != -100  # token j predicts label j + 1
    first = torch.where(predicts.any(1), predicts.int().argmax(1), width)
    parts = [input_ids.reshape(-1), first]
    if position_ids is not None:
        parts.append(position_ids.reshape(-1).to(input_ids.dtype))
    host = torch.cat([part.to(input_ids.dtype) for part in parts]).cpu()
    ids, first = host[:rows * width].view(rows, width), host[rows * width:rows * width + rows].tolist()
    positions = host[rows * (width + 1):].view(rows, width) if position_ids is not None else None
    shareable: list[list[tuple[int, int]] | None] = []
    for row, (start, length) in enumerate(spans):
        shared = min(first[row] - start, length - 1)
        if shared < 1:
            shareable.append(None)
            continue
        where = positions[row, start:start + shared] if positions is not None else torch.arange(start, start + shared)
        shareable.append(list(zip(ids[row, start:start + shared].tolist(), where.tolist())))
    declined: list = []
    segments = prefix_tree([length for _, length in spans], shareable, chunk, declined)
    if declined:
        unshared(CHUNK_RULE.format(chunk=chunk), "")
    return segments if any(segment.parent >= 0 for segment in segments) else None


@dataclass
class UnpadPatch:
    """Padded calls of a base model unpadded (see the module docstring); in ``patch.handles``: ``remove()``
    takes the hooks off."""

    base: Any
    always: bool
    hooks: list = field(default_factory=list)
    calls: list = field(default_factory=list, repr=False)  # per call: its Unpadded, or None
    labels: list = field(default_factory=list, repr=False)  # per call of the model: the labels its head got
    loss_labels: list = field(default_factory=list, repr=False)  # see labels_for_loss

    @classmethod
    def install(cls, model: Any, mode: str) -> UnpadPatch:
        """Unpad the padded calls of ``model``'s base model; the labels of ``model``'s own calls are looked at."""
        if mode not in UNPAD_MODES or mode == "off":
            raise ValueError(f"unpad mode {mode!r}: install for one of auto, always")
        base = getattr(model, "base_model", model)
        patch = cls(base, always=mode == "always")
        # prepended: the guard and the mixers' hooks then see the packed call
        patch.hooks.append(base.register_forward_pre_hook(patch._before, with_kwargs=True, prepend=True))
        patch.hooks.append(base.register_forward_hook(patch._after, with_kwargs=True, always_call=True,
                                                      prepend=True))
        if base is not model:
            patch.hooks.append(model.register_forward_pre_hook(patch._remember_labels, with_kwargs=True))
            patch.hooks.append(model.register_forward_hook(patch._forget_labels, with_kwargs=True, always_call=True))
        return patch

    @contextmanager
    def labels_for_loss(self, labels: Any) -> Iterator[None]:
        """Within the block, a call whose head gets no labels is checked against ``labels``: those a caller's own
        loss reads (a ``compute_loss`` that takes them out of the batch before calling the model)."""
        self.loss_labels.append(labels if isinstance(labels, torch.Tensor) else None)
        try:
            yield
        finally:
            self.loss_labels.pop()

    def _remember_labels(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.labels.append(bound_inputs(module, args, kwargs).get("labels"))

    def _forget_labels(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self.labels:
            self.labels.pop()

    def _before(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.calls.append(None)
        if not (self.always or module.training):
            return None
        inputs = bound_inputs(module, args, kwargs)
        mask = inputs.get("attention_mask")
        positions = inputs.get("position_ids")
        unpackable = ("past_key_values", *BOUNDARY_KEYS, *MEDIA_KEYS)
        if not isinstance(mask, torch.Tensor) or any(inputs.get(key) is not None for key in unpackable) or inputs.get(
                "output_attentions") or (isinstance(positions, torch.Tensor) and positions.ndim != 2):
            return None
        labels = self.labels[-1] if self.labels else None
        if labels is None and self.loss_labels:
            labels = self.loss_labels[-1]
        labels = labels.to(mask.device, non_blocking=True) if isinstance(labels, torch.Tensor) else None
        packed = pack_padded_call(inputs, mask, labels)
        if packed is None:
            return None
        self.calls[-1] = packed[1]
        return (), packed[0]

    def _after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        unpadded = self.calls.pop() if self.calls else None
        return None if unpadded is None else unpadded.scatter(output)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

