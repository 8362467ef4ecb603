"""Sequence parallelism over packed rows: the row of a sequence-parallel group, and each rank's slice of it.

Under sequence parallelism (``sequence_parallel.size: N``) the ``N`` ranks of a group train one packed row
together, each computing a contiguous ``1/N`` of its tokens (attention and the sequence mixers see the whole row
through an all-to-all, :mod:`padfree_plugins.modeling.attention.ulysses`). Every rank of the group loads its own
micro-batch, as under data parallelism; the group's row is their micro-batches back to back, in rank order
(:func:`join_rows`), and :func:`slice_row` cuts it:

* ``labels`` are shifted **before** the cut, over the whole row: the label of a rank's last token is the first
  token of the next rank's slice. The slice carries them as ``labels`` and ``shift_labels`` (the same tensor), so
  a transformers loss does not shift again inside a slice;
* the row is padded to a multiple of ``N`` with one padding-only segment (its own example in the boundaries,
  positions from the start, no loss);
* the boundaries stay global (``cu_seq_lens_q`` / ``_k`` and the max lengths describe the whole row), and every
  other per-token key (``input_ids``, ``position_ids``, ``seq_idx``, ``token_type_ids`` …) is sliced.

An image-text row (:func:`slice_row` with ``whole=True``) keeps every model input whole — its tokens, positions
(Qwen's ``[4, 1, T]`` mRoPE rows too), modalities and media — and slices its targets alone: the model embeds the
whole row, runs the vision tower and merges the image features, and its language model takes this rank's slice of the
merged embeddings (:class:`~padfree_plugins.modeling.sequence_parallel.SliceRow`). Its per-rank rows join with the
rotary positions along their token axis and the media in rank order (the model fills the placeholders in that order).

A row whose targets are shifted already (``shift_labels``, no ``labels``: TRL's fused LM head) is sliced with
``pre_shifted=True``: its ``shift_labels`` are cut as they are, the padding segment's -100.

A row with shared prefixes (:mod:`padfree_plugins.packing.prefixes`) is joined and sliced alike: each rank's
structure travels as :data:`SEGMENT_PARENTS_KEY` (one parent per segment, a tensor the group exchanges like any
per-example key; :func:`segment_parents`), :func:`join_rows` offsets the parents by the segments of the rows before,
and :func:`slice_row` builds the joined row's :class:`~padfree_plugins.packing.prefixes.SharedPrefixes` (the padding
segment a root) for every slice alike: the structure describes the whole row, as the boundaries do, and attention
applies it after Ulysses' all-to-all, where every rank holds every token of its heads.

Nothing here communicates: the exchange of micro-batches is :func:`padfree_plugins.modeling.sequence_parallel.
gather_rows`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from padfree_plugins.errors import BatchError
from padfree_plugins.packing.batch import SHARED_PREFIXES_KEY, PackedBatch, packed_tokens
from padfree_plugins.packing.labelled_logits import HELD_KEY, LABELLED_LOGITS_KEYS
from padfree_plugins.packing.prefixes import SharedPrefixes

#: Keys that hold a packed row's boundaries (offset when rows are joined, kept whole when a row is sliced).
CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
#: Keys that hold the longest example (python ints).
MAX_KEYS = ("max_length_q", "max_length_k")
#: A row's shared prefixes as one parent per segment (int64 ``[S]``, ``-1``: none): what the ranks of a group
#: exchange and join (:func:`segment_parents`); :func:`slice_row` turns it into the joined row's structure.
SEGMENT_PARENTS_KEY = "segment_parents"
#: Keys never carried into a slice: the labelled logits of the rank's own micro-batch (recomputed on the slice).
DROPPED_KEYS = (HELD_KEY, *LABELLED_LOGITS_KEYS)


def is_token_key(value: Any, tokens: int) -> bool:
    """Whether ``value`` is a per-token tensor ``[1, T, ...]`` of a row of ``tokens`` tokens."""
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == 1 and value.shape[1] == tokens


def is_rotary_rows(key: str, value: Any, tokens: int) -> bool:
    """Whether ``value`` is a multimodal row's ``position_ids`` ``[R, 1, T]`` (Qwen-VL: the text row, then the three
    mRoPE rows), its token axis the last."""
    return key == "position_ids" and isinstance(value, torch.Tensor) and value.ndim == 3 and value.shape[1] == 1 \
        and value.shape[2] == tokens


def segment_parents(row: Mapping) -> torch.Tensor:
    """The parent of every segment of the packed ``row`` (int64 ``[S]``, on its boundaries' device): its
    :data:`~padfree_plugins.packing.batch.SHARED_PREFIXES_KEY` structure's, or ``-1`` for all without one."""
    cu = row["cu_seq_lens_q"]
    shared = row.get(SHARED_PREFIXES_KEY)
    if shared is None:
        return torch.full((cu.numel() - 1,), -1, dtype=torch.long, device=cu.device)
    if len(shared.parents) != cu.numel() - 1:
        raise BatchError(f"shared_prefixes names parents for {len(shared.parents)} segments, but cu_seq_lens_q "
                         f"holds {cu.numel() - 1}")
    return torch.tensor(shared.parents, dtype=torch.long, device=cu.device)


def join_rows(rows: Sequence[Mapping]) -> PackedBatch:
    """The packed rows ``rows`` (one per rank of a group, in rank order) as one packed row: per-token keys
    concatenated, the boundaries and ``seq_idx`` offset and joined, the max lengths the largest, per-example keys
    concatenated."""
    if not rows:
        raise BatchError("no packed rows to join")
    keys = list(rows[0])
    for rank, row in enumerate(rows[1:], 1):
        if list(row) != keys:
            raise BatchError(f"the ranks of a sequence-parallel group hold different batch keys: rank 0 {keys}, "
                             f"rank {rank} {list(row)}; every rank must use the same collator")
    sizes = [packed_tokens(row) for row in rows]
    joined = PackedBatch()
    joined.model_keys = getattr(rows[0], "model_keys", None)
    for key in keys:
        values = [row[key] for row in rows]
        if key in CU_KEYS:
            offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0)
            joined[key] = torch.cat([values[0][:1], *(v[1:] + int(o) for v, o in zip(values, offsets))])
        elif key in MAX_KEYS:
            joined[key] = max(int(v) for v in values)
        elif key == SEGMENT_PARENTS_KEY:  # segment indices: offset by the segments of the rows before
            joined[key] = torch.cat([_offset_parents(v, row) for v, row in zip(values, _rows_before(rows))])
        elif key == SHARED_PREFIXES_KEY:
            raise BatchError("rows with shared prefixes are joined by their segment_parents (segment_parents(row)), "
                             "not by their SharedPrefixes")
        elif key == "seq_idx":  # example indices: offset by the examples of the rows before
            offsets = torch.tensor([0, *(int(row["cu_seq_lens_q"].numel()) - 1 for row in rows[:-1])]).cumsum(0)
            joined[key] = torch.cat([v + int(o) for v, o in zip(values, offsets)], dim=1)
        elif all(is_token_key(v, size) for v, size in zip(values, sizes)):
            joined[key] = torch.cat(values, dim=1)
        elif all(is_rotary_rows(key, v, size) for v, size in zip(values, sizes)):
            joined[key] = torch.cat(values, dim=2)
        elif all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in values):
            joined[key] = torch.cat(values)
        elif all(v == values[0] for v in values):
            joined[key] = values[0]
        else:
            raise BatchError(f"batch key {key!r} differs between the ranks of a sequence-parallel group and cannot "
                             "be joined (neither per token nor per example)")
    return joined


def _rows_before(rows: Sequence[Mapping]) -> list[int]:
    """For every row, the segments of the rows before it."""
    counts = [int(row["cu_seq_lens_q"].numel()) - 1 for row in rows]
    return [sum(counts[:index]) for index in range(len(rows))]


def _offset_parents(parents: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.where(parents >= 0, parents + offset, parents)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The next token's label at every position of a packed row ``[1, T]`` (-100 after the last): a causal LM's
    targets, shifted over the whole row. Each example's first label is -100 (the collator masks it), so no
    position learns the next example's first token."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)


def padded_length(tokens: int, size: int) -> int:
    """``tokens`` rounded up to a multiple of ``size``."""
    return -(-tokens // size) * size


#: The per-token keys of a row that are targets, not model inputs: the ones an image-text row's slice cuts.
TARGET_KEYS = ("labels", "shift_labels")


def slice_row(row: Mapping, rank: int, size: int, pad_token_id: int = 0, *,
              pre_shifted: bool = False, whole: bool = False) -> PackedBatch:
    """Rank ``rank``'s slice of the packed ``row`` split ``size`` ways (see the module docstring); ``pre_shifted``:
    the row's ``shift_labels`` are its targets, sliced without shifting (and the row has no ``labels``); ``whole``:
    an image-text row, whose model inputs stay whole (padded) and whose targets alone are sliced."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} of a sequence-parallel group of {size}")
    tokens = packed_tokens(row)
    if tokens is None or "cu_seq_lens_q" not in row:
        raise BatchError("sequence parallelism needs a packed row (input_ids and cu_seq_lens_q), as "
                         "padfree_plugins' collator builds it")
    position_ids = row.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim != 2 and not (
            whole and is_rotary_rows("position_ids", position_ids, tokens)):
        raise BatchError(f"position_ids of shape {tuple(position_ids.shape)}: sequence parallelism slices a text row's "
                         "positions [1, T]; multimodal rotary positions [R, 1, T] only in an image-text row, which "
                         "the model slices after merging its image features (slice_row(..., whole=True))")
    padding = padded_length(tokens, size) - tokens
    local = padded_length(tokens, size) // size
    start = rank * local
    sliced = PackedBatch()
    sliced.model_keys = getattr(row, "model_keys", None)
    parents = row.get(SEGMENT_PARENTS_KEY)
    if parents is None and row.get(SHARED_PREFIXES_KEY) is not None:
        parents = segment_parents(row)
    for key, value in row.items():
        if key in (SEGMENT_PARENTS_KEY, SHARED_PREFIXES_KEY):
            continue
        if key in DROPPED_KEYS and not (pre_shifted and key == "shift_labels"):
            continue
        if key in CU_KEYS:
            sliced[key] = value if not padding else torch.cat([value, value.new_tensor([tokens + padding])])
        elif key in MAX_KEYS:
            sliced[key] = max(int(value), padding)
        elif is_token_key(value, tokens):
            if key == "labels":
                value = shifted_labels(value)
            value = _pad_tokens(key, value, padding, row, pad_token_id)
            sliced[key] = value if whole and key not in TARGET_KEYS else value[:, start:start + local]
        elif is_rotary_rows(key, value, tokens):  # whole: the model slices them with its merged embeddings
            sliced[key] = torch.cat([value, (value[..., :1] + torch.arange(padding, device=value.device)
                                             ).to(value.dtype)], dim=2) if padding else value
        else:
            sliced[key] = value
    if "labels" in sliced:
        sliced["shift_labels"] = sliced["labels"]
    if parents is not None and bool((parents >= 0).any()):
        sliced[SHARED_PREFIXES_KEY] = shared_structure(sliced["cu_seq_lens_q"], parents)
    return sliced


def shared_structure(cu_seq_lens: torch.Tensor, parents: torch.Tensor) -> SharedPrefixes:
    """The :class:`~padfree_plugins.packing.prefixes.SharedPrefixes` of a (padded) row of boundaries
    ``cu_seq_lens`` whose real segments have ``parents`` (the padding segment, if the boundaries hold one more, a
    root), on the boundaries' device; the same on every rank of a group (one read of both)."""
    bounds = cu_seq_lens.long().tolist()
    given = [int(parent) for parent in parents.tolist()]
    extra = len(bounds) - 1 - len(given)
    if extra not in (0, 1):
        raise BatchError(f"{len(given)} segment parents for a row of {len(bounds) - 1} segments")
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    return SharedPrefixes.build(lengths, given + [-1] * extra, cu_seq_lens.device)


def _pad_tokens(key: str, value: torch.Tensor, padding: int, row: Mapping, pad_token_id: int) -> torch.Tensor:
    """``value`` with ``padding`` tokens of the padding segment appended: the pad token, positions from the row's
    first position, the next example index, no label, zeros elsewhere."""
    if not padding:
        return value
    shape = (value.shape[0], padding, *value.shape[2:])
    if key == "input_ids":
        fill = value.new_full(shape, pad_token_id)
    elif key == "position_ids":
        fill = (value[:, :1] + torch.arange(padding, device=value.device)).to(value.dtype)
    elif key == "seq_idx":
        fill = value.new_full(shape, int(row["cu_seq_lens_q"].numel()) - 1)
    elif key in ("labels", "shift_labels"):
        fill = value.new_full(shape, -100)
    else:
        fill = value.new_zeros(shape)
    return torch.cat([value, fill], dim=1)
