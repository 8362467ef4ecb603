"""The packed-batch contract: what a padding-free collator produces and every later stage reads.

A batch of ``n`` examples of lengths ``L_1 … L_n`` (``T = sum L_i``) is one row::

    input_ids       int64 [1, T]     tokens of all examples, back to back, no padding
    position_ids    int64 [1, T]     restart at ``position_start`` for every example (2 for RoBERTa-family)
    cu_seq_lens_q   int32 [n + 1]    example boundaries: 0, L_1, L_1 + L_2, …, T
    cu_seq_lens_k   int32 [n + 1]    the same tensor (self-attention)
    max_length_q    int              max L_i, a python int so kernels need no GPU->CPU sync
    max_length_k    int              the same
    seq_idx         int32 [1, T]     example index of every token
    <token keys>    [1, T]           e.g. labels, token_type_ids — concatenated like input_ids
    <example keys>  [n] or [n, k]    e.g. a class label, a group id — one row per example

The boundaries are computed once, in the collator; nothing downstream re-derives them from ``position_ids``.

What a model is called with: :meth:`PackedBatch.model_inputs` — the tokens, positions and boundaries plus the
per-token keys the task's model reads (``token_type_ids``; ``labels`` for ``causal_lm``), which the collator records
on the batch (:attr:`PackedBatch.model_keys`). Per-example keys (a class label ``[n]``, which a bare model would
read as one label per row) and the keys trainers add for labelled logits (``logits_to_keep``, ``shift_labels``,
which make it return logits for some positions only) are never among them unless named.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: The keys that carry the boundaries into attention (``**kwargs`` of transformers models).
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: The model input that carries a row's shared prefixes, where it has them (:mod:`padfree_plugins.packing.prefixes`).
SHARED_PREFIXES_KEY = "shared_prefixes"
#: What a patched model is called with on every packed batch: the tokens, their positions and the boundaries (and
#: the prefix structure of a row that shares prefixes).
MODEL_INPUT_KEYS = ("input_ids", "position_ids", *BOUNDARY_KEYS, SHARED_PREFIXES_KEY)
#: Inputs that carry images or video (vision-language processors' outputs): only a vision-language family's
#: multimodal collator packs them (:mod:`padfree_plugins.packing.multimodal`); any other path refuses or runs padded.
MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
              "pixel_attention_mask")
#: The row key under which a row fetched by a trainer's dataloader carries its index in the dataset, so that the
#: collator's errors name the example by it (:func:`padfree_plugins.batching.sampler.indexed_rows`); never packed.
INDEX_KEY = "padfree_dataset_index"
#: Per-token keys that are model inputs whenever a batch holds them as ``[1, T]`` (for a batch that carries no record
#: of its collator's model keys: one rebuilt from a plain ``dict``, as ``Trainer`` does when moving it to a device).
TOKEN_MODEL_KEYS = ("token_type_ids", "labels")


def packed_tokens(batch: Mapping) -> int | None:
    """``T``, the number of tokens of a packed batch, read from tensor shapes (no device sync); ``None`` if unknown."""
    for key in ("input_ids", "seq_idx", "position_ids"):
        if key in batch:
            return int(batch[key].shape[-1])
    return None


def token_examples(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """The example of every one of the ``total`` packed tokens (int64 ``[T]``, on ``cu_seq_lens``' device), from
    the boundaries ``0, L1, …, T``; sizes come from ``total``, so nothing is read back from the device."""
    lengths = cu_seq_lens.diff().long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seq_lens.device), lengths,
                                   output_size=total)


def restarts(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The boundaries ``0, L1, …, T`` (int64, on the host) of a row ``[1, T]`` whose position ids restart at every
    example, or ``None`` for a padded batch, a single example or no position ids.

    Only for models whose layers are handed nothing but what their embeddings get (MPNet, DeBERTa-v2: the
    boundaries cannot reach their attention, and sentence-transformers calls their forward past the hooks); the
    model's guard checks that the restarts are exactly ``cu_seq_lens_q``. One read from the device per forward.
    """
    if position_ids is None or position_ids.ndim != 2 or position_ids.shape[0] != 1:
        return None
    found = (position_ids[0, 1:] != position_ids[0, :-1] + 1).nonzero().flatten().cpu()
    if not len(found):
        return None
    return torch.cat([torch.zeros(1, dtype=torch.long), found + 1, torch.tensor([position_ids.shape[1]])])


def length_groups(cu_seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """A packed row's tokens grouped by example length, for code that runs the examples of equal length together.

    Returns ``order`` (int64 ``[T]``, on the host): the token indices with the examples sorted by length (stably),
    so that each length's examples are one contiguous block, viewable as ``[count, length, …]``; ``inverse``, which
    puts them back (``x[order][inverse] == x``); and each block's ``(length, count)``, shortest first. The
    boundaries are read on the host (one copy from an accelerator).
    """
    cu = cu_seq_lens.long().cpu()
    lengths = cu.diff()
    by_length = torch.sort(lengths, stable=True).indices
    sorted_lengths = lengths[by_length]
    total = int(sorted_lengths.sum())
    moved = cu[:-1][by_length] - (torch.cumsum(sorted_lengths, 0) - sorted_lengths)
    order = torch.repeat_interleave(moved, sorted_lengths, output_size=total) + torch.arange(total)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total)
    group_lengths, counts = torch.unique_consecutive(sorted_lengths, return_counts=True)
    return order, inverse, list(zip(group_lengths.tolist(), counts.tolist()))


def mark_dynamic_lengths(inputs: Mapping) -> Mapping:
    """Mark, for ``torch.compile``, the dimensions of a packed call that change from batch to batch as dynamic: the
    token dimension ``T`` (the last of every per-token tensor) and the boundaries' ``n + 1``. A compiled model then
    builds one graph for rows of every length and example count instead of one per shape (a hint:
    ``maybe_mark_dynamic`` never fails a compile; it sets an attribute, no copy, no host read). Returns ``inputs``."""
    tokens = inputs.get("input_ids")
    tokens = inputs.get("inputs_embeds") if tokens is None else tokens
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2 or inputs.get("cu_seq_lens_q") is None:
        return inputs
    total = tokens.shape[1]
    from torch._dynamo import maybe_mark_dynamic
    from torch._dynamo.decorators import mark_unbacked

    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        if key.startswith("cu_seq_lens"):
            mark_unbacked(value, 0, min=2)
        elif key == "inputs_embeds":  # [1, T, H]
            maybe_mark_dynamic(value, 1)
        elif value.shape[-1] == total and value.ndim <= 3:  # input_ids, position_ids ([4, 1, T] too), labels …
            maybe_mark_dynamic(value, value.ndim - 1)
    return inputs


class PackedBatch(dict):
    """A ``dict`` of tensors (and two ints) following the contract above.

    It stays a plain ``dict`` for ``Trainer`` (which rebuilds it with ``type(batch)(...)`` when moving it to a
    device) and for pickling; the properties only read it. ``model_keys``, set by the collator, names the per-token
    keys its task's model reads (an instance attribute, not a key: ``model(**batch)`` sees nothing new); it
    survives pickling, ``copy`` and :meth:`to`.
    """

    #: The per-token keys, besides :data:`MODEL_INPUT_KEYS`, that :meth:`model_inputs` hands to the model; ``None``:
    #: not recorded (a batch built by hand or rebuilt from a plain dict), then :data:`TOKEN_MODEL_KEYS` held per token.
    model_keys: tuple[str, ...] | None = None

    @property
    def num_examples(self) -> int:
        return int(self["cu_seq_lens_q"].numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self["input_ids"].shape[-1])

    @property
    def lengths(self) -> torch.Tensor:
        """Example lengths, int64 ``[n]``."""
        return self["cu_seq_lens_q"].diff().long()

    def token_model_keys(self) -> tuple[str, ...]:
        """The per-token keys of this batch that its model reads: those its collator recorded (``model_keys``), or,
        without a record, ``token_type_ids`` and ``labels`` where they are per token (``input_ids``' shape)."""
        if self.model_keys is not None:
            return tuple(key for key in self.model_keys if key in self)
        shape = getattr(self.get("input_ids"), "shape", None)
        return tuple(key for key in TOKEN_MODEL_KEYS
                     if shape is not None and getattr(self.get(key), "shape", None) == shape)

    def model_inputs(self, *extra: str) -> dict:
        """What the model takes for this batch, as ``model(**batch.model_inputs())``: ``input_ids``,
        ``position_ids`` and the boundaries, the per-token keys its task's model reads (:meth:`token_model_keys`:
        ``token_type_ids`` for sentence pairs, ``labels`` for ``causal_lm``, so that ``.loss`` is the padded
        model's), plus the named ``extra`` keys that are present (e.g. ``"logits_to_keep", "shift_labels"``).

        For a task with per-example heads (``seq_cls``, ``reranker``, ``embedding``) call ``assembly.forward(model,
        batch)`` instead: a ``*ForSequenceClassification`` model's own forward pools one token per *row*, and a
        patched one refuses a packed row.
        """
        inputs = {key: self[key] for key in (*MODEL_INPUT_KEYS, *self.token_model_keys(), *extra) if key in self}
        return mark_dynamic_lengths(inputs)

    def to(self, device: torch.device | str) -> "PackedBatch":
        """A copy with every tensor on ``device`` (and the same ``model_keys``)."""
        moved = PackedBatch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})
        moved.model_keys = self.model_keys
        return moved
