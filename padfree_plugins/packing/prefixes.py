"""Shared prefixes: a packed row in which each distinct prompt appears once, followed by its completions.

A DPO pair packs ``prompt + chosen`` and ``prompt + rejected``, a GRPO group ``G`` copies of its prompt, each followed
by one completion: every prompt token is computed 2× or G×. A shared row holds each prompt once as a *prefix
segment*, then every completion as a segment of its own whose *parent* is that prefix:

* a completion's tokens attend to its parent's tokens and causally to its own, never to a sibling's;
* its positions continue from its parent's end, as in the padded row;
* the gradient of every completion reaches the one copy of the prompt (the keys are gathered from it).

The structure travels with the packed row as one model input, ``shared_prefixes`` (a :class:`SharedPrefixes`),
built once on the host where the row is packed. Attention reads it (each segment's queries over its key segment:
the parent's tokens, then its own; queries aligned to the end of their keys, as in a KV cache), the model's guard
checks it against the positions. A backend implements it only where it declares the ``shared_prefixes`` feature,
and sequence mixers (a recurrent state, conv taps) refuse it: their state at a prompt's end does not yet carry into
its completions.

Which rows share is decided by :func:`shared_layout`: rows whose shareable prefixes (the tokens before the first one
that predicts a label, with their positions) are equal. :func:`share_packed` turns a collator's packed batch of whole
examples into a shared one (a RewardTrainer's pairs).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from padfree_plugins.packing.batch import SHARED_PREFIXES_KEY, PackedBatch

#: The attention feature of backends that take it.
SHARED_PREFIXES_FEATURE = "shared_prefixes"
#: ``prefix_sharing`` settings a config may name.
PREFIX_SHARING_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SharedPrefixes:
    """The prefix structure of a packed row of ``len(parents)`` segments (its ``cu_seq_lens_q``).

    ``parents[i]``: the segment whose tokens segment ``i`` continues (an earlier prefix segment), or ``-1``.
    ``key_index`` (int64 ``[T_k]``): the packed tokens each segment attends to, segment after segment — its parent's,
    then its own; ``cu_seq_lens_k`` (int32 ``[S + 1]``) splits it by segment and ``max_length_k`` is its longest."""

    parents: tuple[int, ...]
    key_index: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_k: int

    @classmethod
    def build(cls, lengths: Sequence[int], parents: Sequence[int], device: torch.device | str | None = None
              ) -> SharedPrefixes:
        """The structure of segments of ``lengths`` with ``parents`` (see the class docstring). A parent comes
        before its children and has none itself (one prompt level); a segment is never empty."""
        if len(lengths) != len(parents):
            raise ValueError(f"{len(lengths)} segment lengths but {len(parents)} parents")
        starts = [0]
        for length in lengths:
            if length < 1:
                raise ValueError(f"a segment of {length} tokens: every segment holds at least one")
            starts.append(starts[-1] + length)
        keys, bounds = [], [0]
        for segment, (start, length, parent) in enumerate(zip(starts, lengths, parents)):
            if parent >= 0:
                if parent >= segment or parents[parent] != -1:
                    raise ValueError(f"segment {segment}'s parent {parent} is not an earlier segment without a "
                                     "parent of its own")
                keys.append(torch.arange(starts[parent], starts[parent] + lengths[parent]))
            keys.append(torch.arange(start, start + length))
            bounds.append(bounds[-1] + length + (lengths[parent] if parent >= 0 else 0))
        cu_k = torch.tensor(bounds, dtype=torch.int32)
        return cls(tuple(int(parent) for parent in parents), torch.cat(keys).to(device),
                   cu_k.to(device), int(cu_k.diff().max()))


    def to(self, device: torch.device | str) -> SharedPrefixes:
        """The structure with its index tensors on ``device`` (a batch moved to the model's device)."""
        return replace(self, key_index=self.key_index.to(device), cu_seq_lens_k=self.cu_seq_lens_k.to(device))

    @cached_property
    def roots(self) -> RootsAndChildren:
        """The row's tokens split into those of segments without a parent and those of segments with one (computed
        once per structure: one read of ``cu_seq_lens_k``), for attention with bidirectional blocks."""
        return RootsAndChildren.of(self)

    def whole(self, segments: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed positions of the tokens of ``segments``' examples whole (a completion's prompt, then its own
        tokens; a segment without a parent alone), one example after the other, and their boundaries (int32)."""
        bounds = self.cu_seq_lens_k.long().tolist()
        index = torch.cat([self.key_index[bounds[s]:bounds[s + 1]] for s in segments])
        sizes = torch.tensor([bounds[s + 1] - bounds[s] for s in segments])
        return index, torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32)


@dataclass(frozen=True)
class Segment:
    """One segment of a shared row: tokens ``[start, start + length)`` of padded row ``row``'s real tokens;
    ``parent``: the index of the prefix segment it continues, or ``-1``."""

    row: int
    start: int
    length: int
    parent: int = -1


def shared_layout(lengths: Sequence[int], prefixes: Sequence[tuple[int, Hashable] | None]) -> list[Segment]:
    """The segments of a shared row for rows of ``lengths`` real tokens (empty rows are left out).

    ``prefixes[r]``: ``(s, key)`` — row ``r``'s first ``s`` tokens may be shared with every row of an equal ``key``
    (their tokens and positions), ``0 < s < lengths[r]`` — or ``None``. Rows of one key (two or more) become one
    prefix segment (the first row's tokens) followed by each row's rest, in row order, where the first of them
    appears; every other row is one segment alone, in its place."""
    groups: dict[Hashable, list[int]] = {}
    for row, prefix in enumerate(prefixes):
        if prefix is not None and lengths[row]:
            length, key = prefix
            if not 0 < length < lengths[row]:
                raise ValueError(f"row {row}: a shared prefix of {length} tokens in a row of {lengths[row]}")
            groups.setdefault((length, key), []).append(row)
    group_of = {rows[0]: (length, rows) for (length, _), rows in groups.items() if len(rows) > 1}
    in_group = {row for _, rows in group_of.values() for row in rows}
    segments: list[Segment] = []
    for row, length in enumerate(lengths):
        if row in group_of:
            shared, rows = group_of[row]
            parent = len(segments)
            segments.append(Segment(row, 0, shared))
            segments.extend(Segment(member, shared, lengths[member] - shared, parent) for member in rows)
        elif row not in in_group and length:
            segments.append(Segment(row, 0, length))
    return segments


def tokens_saved(segments: Sequence[Segment]) -> int:
    """How many tokens fewer the shared row holds than the row of every example whole."""
    sizes = {index: segment.length for index, segment in enumerate(segments) if segment.parent < 0}
    return sum(sizes[segment.parent] for segment in segments if segment.parent >= 0) - \
        sum(sizes[index] for index in {segment.parent for segment in segments if segment.parent >= 0})


def share_packed(batch: Mapping, prefixes: Sequence[tuple[int, Hashable] | None]) -> tuple[PackedBatch, list[int]]:
    """``batch`` (a collator's packed batch of whole examples) with repeated prefixes held once, and for every example
    the segment that holds its end (its tokens after the shared prefix, or all of them).

    ``prefixes``: one per example, as :func:`shared_layout` takes them. Every per-token tensor (``[1, T, …]``) keeps
    the tokens the shared row holds, so a completion's ``position_ids`` go on from its prefix's end; ``seq_idx``
    numbers the segments; the structure is added as :data:`SHARED_PREFIXES_KEY`. Other values (per-example ones
    included: one per example, not per segment) are kept as they are. Without a repeated prefix the batch is
    returned as it is."""
    cu = batch["cu_seq_lens_q"].long().tolist()
    count, total = len(cu) - 1, cu[-1]
    segments = shared_layout([end - start for start, end in zip(cu, cu[1:])], prefixes)
    if not any(segment.parent >= 0 for segment in segments):
        return batch if isinstance(batch, PackedBatch) else PackedBatch(batch), list(range(count))
    ends = {segment.row: index for index, segment in enumerate(segments)}  # a row's last segment holds its end
    if len(ends) != count:
        raise ValueError("every example of a batch to share holds at least one token")
    index = torch.cat([torch.arange(segment.length) + cu[segment.row] + segment.start for segment in segments])
    shared = PackedBatch()
    for key, value in batch.items():
        per_token = isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (1, total)
        shared[key] = value.index_select(1, index.to(value.device)) if per_token else value
    sizes = [segment.length for segment in segments]
    bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    shared.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(sizes), max_length_k=max(sizes))
    if "seq_idx" in batch:
        shared["seq_idx"] = torch.repeat_interleave(torch.arange(len(sizes), dtype=batch["seq_idx"].dtype),
                                                    torch.tensor(sizes))[None]
    shared[SHARED_PREFIXES_KEY] = SharedPrefixes.build(sizes, [segment.parent for segment in segments])
    shared.model_keys = getattr(batch, "model_keys", None)
    return shared, [ends[row] for row in range(count)]


@dataclass(frozen=True)
class RootsAndChildren:
    """A shared row's tokens in two parts, for attention that must keep bidirectional blocks (Gemma 3's images)
    inside self-attended segments: ``roots`` (int64), the packed tokens of every segment without a parent, which
    attend to their own tokens only, split by ``roots_cu`` (int32); ``children``, those of every segment with a
    parent, split by ``children_cu_q``, whose keys are ``children_keys`` (their parent's tokens, then their own),
    split by ``children_cu_k``; ``order`` puts ``cat(roots, children)`` back in packed order."""

    roots: torch.Tensor
    roots_cu: torch.Tensor
    roots_max: int
    children: torch.Tensor
    children_cu_q: torch.Tensor
    children_keys: torch.Tensor
    children_cu_k: torch.Tensor
    children_max_q: int
    children_max_k: int
    order: torch.Tensor

    @classmethod
    def of(cls, shared: SharedPrefixes) -> RootsAndChildren:
        bounds_k = shared.cu_seq_lens_k.long().tolist()
        counts = [end - start for start, end in zip(bounds_k, bounds_k[1:])]  # a segment's keys: its parent's, its own
        lengths = [count - (counts[parent] if parent >= 0 else 0) for count, parent in zip(counts, shared.parents)]
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        device = shared.key_index.device
        parts: dict[bool, list] = {False: [], True: []}
        keys = []  # where the children's keys sit in key_index
        for segment, parent in enumerate(shared.parents):
            parts[parent >= 0].append(torch.arange(starts[segment], starts[segment + 1]))
            if parent >= 0:
                keys.append(torch.arange(bounds_k[segment], bounds_k[segment + 1]))
        roots_len = [lengths[s] for s, parent in enumerate(shared.parents) if parent < 0]
        child_q = [lengths[s] for s, parent in enumerate(shared.parents) if parent >= 0]
        child_k = [counts[s] for s, parent in enumerate(shared.parents) if parent >= 0]

        def cat(pieces: list) -> torch.Tensor:
            return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)

        def bounds(sizes: list[int]) -> torch.Tensor:
            return torch.tensor([0, *torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)

        roots, children = cat(parts[False]), cat(parts[True])
        return cls(roots.to(device), bounds(roots_len).to(device), max(roots_len, default=0), children.to(device),
                   bounds(child_q).to(device), shared.key_index.index_select(0, cat(keys).to(device)),
                   bounds(child_k).to(device),
                   max(child_q, default=0), max(child_k, default=0),
                   torch.argsort(torch.cat([roots, children])).to(device))
