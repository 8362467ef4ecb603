"""Shared prefixes: a packed row in which each distinct prompt appears once, followed by its completions.

A DPO pair packs ``prompt + chosen`` and ``prompt + rejected``, a GRPO group ``G`` copies of its prompt, each followed
by one completion: every prompt token is computed 2× or G×. A shared row holds each prompt once as a *prefix
segment*, then every completion as a segment of its own whose *parent* is that prefix. Prefixes nest: a segment's
parent may have a parent of its own (a prefix *tree*: the turns of a multi-turn episode that its rollouts share, under
the system prompt that every episode shares):

* a segment's tokens attend to its ancestors' tokens (root first) and causally to its own, never to a sibling's;
* its positions continue from its parent's end, as in the padded row;
* the gradient of every completion reaches the one copy of each prefix (the keys are gathered from it).

The structure travels with the packed row as one model input, ``shared_prefixes`` (a :class:`SharedPrefixes`),
built once on the host where the row is packed. Attention reads it (each segment's queries over its key segment:
the parent's tokens, then its own; queries aligned to the end of their keys, as in a KV cache), the model's guard
checks it against the positions. A backend implements it only where it declares the ``shared_prefixes`` feature,
and sequence mixers (a recurrent state, conv taps) refuse it: their state at a prompt's end does not yet carry into
its completions.

Which rows share is decided by :func:`prefix_tree`: the trie of the rows' shareable prefixes (the tokens before the
first one that predicts a label, with their positions), each branch point a segment; :func:`shared_layout` is its one
level form (rows whose whole prefixes are equal). A shared row never keeps more activations than its examples packed
whole (:func:`gathered_keys`).
:func:`share_packed` and :func:`share_segments` turn a collator's packed batch of whole examples into a shared one (a
RewardTrainer's pairs, an SFT batch).
"""

from __future__ import annotations

import warnings
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
    ``key_index`` (int64 ``[T_k]``): the packed tokens each segment attends to, segment after segment — its
    ancestors', root first, then its own; ``cu_seq_lens_k`` (int32 ``[S + 1]``) splits it by segment and ``max_length_k`` is its longest."""

    parents: tuple[int, ...]
    key_index: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_k: int

    @classmethod
    def build(cls, lengths: Sequence[int], parents: Sequence[int], device: torch.device | str | None = None
              ) -> SharedPrefixes:
        """The structure of segments of ``lengths`` with ``parents`` (see the class docstring). A parent comes
        before its children and may have a parent itself (a prefix tree); a segment is never empty."""
        if len(lengths) != len(parents):
            raise ValueError(f"{len(lengths)} segment lengths but {len(parents)} parents")
        starts = [0]
        for length in lengths:
            if length < 1:
                raise ValueError(f"a segment of {length} tokens: every segment holds at least one")
            starts.append(starts[-1] + length)
        chains: list[list[int]] = []  # per segment: its ancestors root first, then itself
        keys, bounds = [], [0]
        for segment, parent in enumerate(parents):
            if parent >= 0 and parent >= segment:
                raise ValueError(f"segment {segment}'s parent {parent} is not an earlier segment")
            chains.append((chains[parent] if parent >= 0 else []) + [segment])
            keys.extend(torch.arange(starts[s], starts[s] + lengths[s]) for s in chains[-1])
            bounds.append(bounds[-1] + sum(lengths[s] for s in chains[-1]))
        cu_k = torch.tensor(bounds, dtype=torch.int32)
        return cls(tuple(int(parent) for parent in parents), torch.cat(keys).to(device),
                   cu_k.to(device), int(cu_k.diff().max()))

    @property
    def depth(self) -> int:
        """The most prefixes above one segment: 1 where completions continue one prompt, more in a prefix tree."""
        levels: list[int] = []
        for parent in self.parents:
            levels.append(levels[parent] + 1 if parent >= 0 else 0)
        return max(levels, default=0)

    def to(self, device: torch.device | str) -> SharedPrefixes:
        """The structure with its index tensors on ``device`` (a batch moved to the model's device)."""
        return replace(self, key_index=self.key_index.to(device), cu_seq_lens_k=self.cu_seq_lens_k.to(device))

    @cached_property
    def roots(self) -> RootsAndChildren:
        """The row's tokens split into those of segments without a parent and those of segments with one (computed
        once per structure: one read of ``cu_seq_lens_k``), for attention with bidirectional blocks."""
        return RootsAndChildren.of(self)

    def slice_keys(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For the queries ``[start, end)`` of the row (one rank's slice, against the row's keys: all-gather sequence
        parallelism): each segment's keys — its ancestors', then its own up to ``end`` (none for a segment that
        starts at ``end`` or later) — as packed positions (int64), their boundaries (int32) and the longest, so that
        every query of the slice stays aligned to the end of its segment's keys."""
        bounds = self.cu_seq_lens_k.long().tolist()
        counts = [finish - begin for begin, finish in zip(bounds, bounds[1:])]
        pieces, sizes, own_start = [], [], 0
        for segment, parent in enumerate(self.parents):
            length = counts[segment] - (counts[parent] if parent >= 0 else 0)
            kept = 0 if own_start >= end else counts[segment] - length + min(length, end - own_start)
            pieces.append(self.key_index[bounds[segment]:bounds[segment] + kept])
            sizes.append(kept)
            own_start += length
        cu = torch.tensor([0, *torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
        return torch.cat(pieces), cu.to(self.key_index.device), max(sizes, default=0)

    def whole(self, segments: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed positions of the tokens of ``segments``' examples whole (a segment's ancestors, root first,
        then its own tokens; a segment without a parent alone), one example after the other, and their boundaries
        (int32)."""
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


def prefix_tree(lengths: Sequence[int], shareable: Sequence[Sequence[Hashable] | None], chunk: int = 1,
                declined: list | None = None) -> list[Segment]:
    """The segments of a shared row for rows of ``lengths`` real tokens (empty rows are left out): the trie of the
    rows' shareable prefixes, no layout assumed.

    ``shareable[r]``: one hashable per token of row ``r``'s first tokens that may be shared (a token with its
    position), fewer than ``lengths[r]`` (every row keeps a token of its own), or ``None``. Rows that begin with the
    same items share them: every branch point of the trie closes a prefix segment whose children are the rows'
    continuations (further prefixes, or each row's rest). Segments come depth first, each tree where its first row
    appears, children in row order; a row alone is one segment in its place.

    Every prefix segment has two children or more, which bounds what the row keeps (:func:`gathered_keys`).
    ``chunk``: the chunk a model's sequence mixers pad every run to (1: none, or no mixers; see
    :func:`~padfree_plugins.modeling.mixers.run_shared`). A prefix is shared only where its children save at least
    the chunks it costs, and a tree whose segments would pad to more chunks than the rows whole
    (:func:`padded_tokens`) is not shared at all (every row one segment alone): so the mixers keep no more either.
    ``declined`` (a list) is appended to each time the chunk keeps a common prefix in every row, so that the caller
    can say so."""
    items = [list(prefix) if prefix is not None and length else [] for prefix, length in zip(shareable, lengths)]
    for row, (prefix, length) in enumerate(zip(items, lengths)):
        if len(prefix) >= length > 0:
            raise ValueError(f"row {row}: a shared prefix of {len(prefix)} tokens in a row of {length}")
    segments: list[Segment] = []

    def branches(rows: list[int], depth: int) -> list[list[int]]:
        """``rows`` split by their item at ``depth`` (a row without one alone), in order of first appearance."""
        split: dict[Hashable, list[int]] = {}
        for row in rows:
            split.setdefault((True, items[row][depth]) if len(items[row]) > depth else (False, row), []).append(row)
        return list(split.values())

    def place(rows: list[int], depth: int, parent: int) -> None:
        if len(rows) == 1:
            segments.append(Segment(rows[0], depth, lengths[rows[0]] - depth, parent))
            return
        end = depth + common(rows, depth)  # the rows share their item at depth, and maybe more
        children = branches(rows, end)
        if chunk > 1 and not pays(children, depth, end):
            if declined is not None:
                declined.append((rows[0], depth, end))
            for child in children:  # each child holds the prefix's tokens itself
                place(child, depth, parent)
            return
        node = len(segments)
        segments.append(Segment(rows[0], depth, end - depth, parent))
        for child in children:
            place(child, end, node)

    def pays(children: list[list[int]], depth: int, end: int) -> bool:
        """Whether a prefix ``[depth, end)`` saves its children at least the chunks it costs (each child's segment:
        its own prefix, or its row's rest)."""
        sizes = [common(child, end) if len(child) > 1 else lengths[child[0]] - end for child in children]
        return padded(end - depth) + sum(map(padded, sizes)) <= sum(padded(end - depth + size) for size in sizes)

    def common(rows: list[int], depth: int) -> int:
        first, end = items[rows[0]], depth + 1
        while end < len(first) and all(len(items[row]) > end and items[row][end] == first[end] for row in rows[1:]):
            end += 1
        return end - depth

    def padded(size: int) -> int:
        return -(-size // chunk) * chunk

    for rows in branches([row for row, length in enumerate(lengths) if length], 0):
        place(rows, 0, -1)
    if chunk > 1 and padded_tokens(segments, chunk) > sum(padded(length) for length in lengths if length):
        if declined is not None and any(segment.parent >= 0 for segment in segments):
            declined.append(None)
        return [Segment(row, 0, length) for row, length in enumerate(lengths) if length]
    return segments


def padded_tokens(segments: Sequence[Segment], chunk: int) -> int:
    """The tokens the sequence mixers of a model that pads every run to ``chunk`` compute for ``segments``."""
    return sum(-(-segment.length // chunk) * chunk for segment in segments)


def shared_layout(lengths: Sequence[int], prefixes: Sequence[tuple[int, Hashable] | None], chunk: int = 1,
                  declined: list | None = None) -> list[Segment]:
    """The one-level :func:`prefix_tree`: ``prefixes[r]``: ``(s, key)`` — row ``r``'s first ``s`` tokens may be
    shared with every row of an equal ``key`` (their tokens and positions), ``0 < s < lengths[r]`` — or ``None``.
    Rows of one key (two or more) become one prefix segment (the first row's tokens) followed by each row's rest, in
    row order, where the first of them appears; every other row is one segment alone, in its place. ``declined``: as
    :func:`prefix_tree`'s."""
    shareable, numbers = [], {}  # each (length, key) numbered once: the trie compares small ints, not the keys
    for row, prefix in enumerate(prefixes):
        if prefix is not None and lengths[row]:
            length, key = prefix
            if not 0 < length < lengths[row]:
                raise ValueError(f"row {row}: a shared prefix of {length} tokens in a row of {lengths[row]}")
            number = numbers.setdefault((length, key), len(numbers))
            shareable.append([(number, index) for index in range(length)])
        else:
            shareable.append(None)
    return prefix_tree(lengths, shareable, chunk, declined)


def gathered_keys(segments: Sequence[Segment]) -> int:
    """How many keys attention gathers for the shared row of ``segments`` (each segment's ancestors' and its own).

    The bound on a shared row's memory: the segments that end an example gather exactly the keys of the examples
    whole, and each prefix segment gathers its ancestors' and its own once more. A prefix's tokens are thereby
    gathered once per prefix in its subtree (itself included), and a tree whose prefixes each have two children or
    more (:func:`prefix_tree`'s) has fewer prefixes than rows under each: so the keys gathered beyond the whole rows'
    never exceed the tokens sharing saves (:func:`tokens_saved`). A shared row keeps, per layer, its tokens'
    activations and these keys and values; the rows whole keep every token's activations, keys and values
    included — so the shared row keeps no more as long as a token's other saved activations (its queries alone, in a
    model with grouped keys and values; with its normed inputs and feed-forward projections, in every decoder layer)
    outweigh its keys and values."""
    reach: list[int] = []
    for segment in segments:
        reach.append(segment.length + (reach[segment.parent] if segment.parent >= 0 else 0))
    return sum(reach)


def tokens_saved(segments: Sequence[Segment]) -> int:
    """How many tokens fewer the shared row holds than the row of every example whole."""
    reach: list[int] = []  # per segment: its tokens and its ancestors'
    for segment in segments:
        reach.append(segment.length + (reach[segment.parent] if segment.parent >= 0 else 0))
    parents = {segment.parent for segment in segments}
    return sum(reach[index] for index in range(len(segments)) if index not in parents) - \
        sum(segment.length for segment in segments)


def share_packed(batch: Mapping, prefixes: Sequence[tuple[int, Hashable] | None], chunk: int = 1
                 ) -> tuple[PackedBatch, list[int]]:
    """``batch`` (a collator's packed batch of whole examples) with repeated prefixes held once (``prefixes``: one
    per example, as :func:`shared_layout` takes them), and for every example the segment that holds its end; see
    :func:`share_segments`. Where ``chunk`` keeps a prefix in every example, a warning says so
    (:func:`warn_kept_in_every_example`)."""
    cu = batch["cu_seq_lens_q"].long().tolist()
    declined: list = []
    segments = shared_layout([end - start for start, end in zip(cu, cu[1:])], prefixes, chunk, declined)
    if declined:
        warn_kept_in_every_example(chunk)
    return share_segments(batch, segments)


def warn_kept_in_every_example(chunk: int) -> None:
    """Say, in a warning, that a packed batch holds some of its common prefixes in every example, not once: the
    sequence mixers' ``chunk`` rule kept them (:func:`prefix_tree`'s ``declined``)."""
    warnings.warn(f"a packed batch holds some common prefixes in every example, not once: its sequence mixers pad "
                  f"every segment to {chunk} tokens, and sharing those (prefixes or continuations shorter than a "
                  "chunk) would keep more activations than the examples whole", UserWarning, stacklevel=3)


def share_segments(batch: Mapping, segments: Sequence[Segment]) -> tuple[PackedBatch, list[int]]:
    """``batch`` (a collator's packed batch of whole examples) as the shared row of ``segments`` (their ``row`` an
    example of the batch: :func:`prefix_tree`, :func:`shared_layout`), and for every example the segment that holds
    its end (its tokens after its shared prefixes, or all of them).

    Every per-token tensor (``[1, T, …]``) keeps the tokens the shared row holds, so a segment's ``position_ids`` go
    on from its parent's end; ``seq_idx`` numbers the segments; the structure is added as
    :data:`SHARED_PREFIXES_KEY`. Other values (per-example ones included: one per example, not per segment) are kept
    as they are. Without a shared prefix the batch is returned as it is."""
    cu = batch["cu_seq_lens_q"].long().tolist()
    count, total = len(cu) - 1, cu[-1]
    if not any(segment.parent >= 0 for segment in segments):
        return batch if isinstance(batch, PackedBatch) else PackedBatch(batch), list(range(count))
    parents = {segment.parent for segment in segments}
    ends = {segment.row: index for index, segment in enumerate(segments) if index not in parents}
    if len(ends) != count:
        raise ValueError("every example of a batch to share holds at least one token of its own")
    index = torch.cat([torch.arange(segment.length) + cu[segment.row] + segment.start for segment in segments])
    shared = PackedBatch()
    for key, value in batch.items():
        per_token = isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (1, total)
        shared[key] = value.index_select(1, index.to(value.device)) if per_token else value
    set_segments(shared, batch, segments)
    return shared, [ends[row] for row in range(count)]


def set_segments(shared: PackedBatch, batch: Mapping, segments: Sequence[Segment]) -> None:
    """Give ``shared`` (a batch cut to the tokens of ``segments``, from ``batch``) the segments' boundaries, their
    ``seq_idx`` where ``batch`` has one, their structure (:data:`SHARED_PREFIXES_KEY`) and ``batch``'s model keys."""
    sizes = [segment.length for segment in segments]
    bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    shared.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(sizes), max_length_k=max(sizes))
    if "seq_idx" in batch:
        shared["seq_idx"] = torch.repeat_interleave(torch.arange(len(sizes), dtype=batch["seq_idx"].dtype),
                                                    torch.tensor(sizes))[None]
    shared[SHARED_PREFIXES_KEY] = SharedPrefixes.build(sizes, [segment.parent for segment in segments])
    shared.model_keys = getattr(batch, "model_keys", None)


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


#: Keys a batch shared by :func:`share_unlabelled` carries besides the model's: for every example the segment that
#: holds its end (int64 ``[n]``), and the tokens of its examples whole (an int).
EXAMPLE_SEGMENTS_KEY, WHOLE_TOKENS_KEY = "example_segments", "whole_tokens"
#: Per-token keys that are targets, not inputs: two rows whose inputs agree share their tokens whatever these hold.
TARGET_KEYS = ("labels", "shift_labels")


def unlabelled_prefixes(batch: Mapping) -> list[list[tuple]]:
    """Each example's shareable prefix in a packed causal-LM batch (as :func:`prefix_tree` takes it): its tokens before
    the first one that predicts a label (token ``i`` predicts label ``i + 1``; at most all but its last token), each
    as the tuple of its per-token model inputs (token id, position, token type …)."""
    cu = batch["cu_seq_lens_q"].long().tolist()
    total = cu[-1]
    columns = [value.reshape(total, -1).tolist() for key, value in batch.items()
               if key not in TARGET_KEYS and key != "seq_idx" and isinstance(value, torch.Tensor)
               and value.ndim >= 2 and tuple(value.shape[:2]) == (1, total)]
    labelled = (batch["labels"].reshape(-1) != -100).tolist()
    prefixes = []
    for start, end in zip(cu, cu[1:]):  # tuples for the prefixes' tokens only (the answers' are never compared)
        first = next((index for index in range(start + 1, end) if labelled[index]), end)
        prefixes.append([tuple(tuple(column[index]) for column in columns)
                         for index in range(start, max(start, first - 1))])
    return prefixes


def share_unlabelled(batch: Mapping, chunk: int = 1, min_saved: int = 1) -> PackedBatch:
    """A packed causal-LM batch of whole examples with the unlabelled prefixes its examples begin with held once
    (:func:`unlabelled_prefixes`, :func:`prefix_tree`, :func:`share_segments`): the loss, its count of labels and every
    labelled token's logits are the batch's own, since a shared token predicts no label. A shared batch says which
    segment ends each example (:data:`EXAMPLE_SEGMENTS_KEY`) and how many tokens its examples hold whole
    (:data:`WHOLE_TOKENS_KEY`); a batch with nothing to share, or whose sharing would save fewer than ``min_saved``
    tokens (a common first token alone is not worth the segments), is returned as it is."""
    cu = batch["cu_seq_lens_q"].long().tolist()
    tokens = int(batch["input_ids"].shape[-1])
    lengths = [end - start for start, end in zip(cu, cu[1:])]
    declined: list = []
    segments = prefix_tree(lengths, unlabelled_prefixes(batch), chunk, declined)
    if declined:
        warn_kept_in_every_example(chunk)
    if tokens_saved(segments) < min_saved:
        return batch if isinstance(batch, PackedBatch) else PackedBatch(batch)
    shared, ends = share_segments(batch, segments)
    if SHARED_PREFIXES_KEY in shared:
        shared[EXAMPLE_SEGMENTS_KEY], shared[WHOLE_TOKENS_KEY] = torch.tensor(ends), tokens
    return shared


def whole_examples(batch: Mapping) -> Mapping:
    """A batch shared by :func:`share_unlabelled` with every example whole again (its per-token values in the
    order and with the boundaries of the batch before sharing); any other batch as it is."""
    shared = batch.get(SHARED_PREFIXES_KEY)
    if shared is None or EXAMPLE_SEGMENTS_KEY not in batch:
        return batch
    total = int(batch["input_ids"].shape[1])
    index, bounds = shared.whole(batch[EXAMPLE_SEGMENTS_KEY].tolist())
    whole = PackedBatch()
    for key, value in batch.items():
        if key in (SHARED_PREFIXES_KEY, EXAMPLE_SEGMENTS_KEY, WHOLE_TOKENS_KEY):
            continue
        per_token = isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (1, total)
        whole[key] = value.index_select(1, index.to(value.device)) if per_token else value
    device = batch["input_ids"].device
    sizes = bounds.diff()
    whole.update(cu_seq_lens_q=bounds.to(device), cu_seq_lens_k=bounds.to(device), max_length_q=int(sizes.max()),
                 max_length_k=int(sizes.max()))
    if "seq_idx" in batch:
        whole["seq_idx"] = torch.repeat_interleave(torch.arange(sizes.numel(), dtype=batch["seq_idx"].dtype),
                                                   sizes.long()).to(device)[None]
    whole.model_keys = getattr(batch, "model_keys", None)
    return whole


def on_device(batch: Mapping, device: torch.device | str) -> Mapping:
    """``batch`` with its :data:`SHARED_PREFIXES_KEY` structure on ``device`` (a trainer moves tensors only)."""
    shared = batch.get(SHARED_PREFIXES_KEY)
    if shared is None or shared.key_index.device == torch.device(device):
        return batch
    moved = type(batch)({**batch, SHARED_PREFIXES_KEY: shared.to(device)})
    if getattr(batch, "model_keys", None) is not None:
        moved.model_keys = batch.model_keys
    return moved
