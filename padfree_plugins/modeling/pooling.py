"""Per-example pooling straight from a packed row: gather or segment reduction over ``cu_seq_lens``.

Every pooler is a small picklable callable ``(hidden_states [1, T, H] or [T, H], batch) -> [n, H]``; none
re-pads the batch.

Prompts / instructions: with ``include_prompt=False`` a pooler leaves out the first ``prompt_length`` tokens of
every example, as sentence-transformers' ``Pooling(include_prompt=False)`` does (INSTRUCTOR-style models). The
batch carries ``prompt_length`` as an int (the same prompt for every example) or one value per example
(tensor ``[n]``). Weighted mean keeps the original position weights of the tokens it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch

from padfree_plugins.errors import ConfigError, did_you_mean
from padfree_plugins.packing.batch import packed_tokens, token_examples

#: Batch key with the number of prompt tokens at the start of every example (an int or a tensor ``[n]``).
PROMPT_LENGTH_KEY = "prompt_length"


def _rows(hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
    if hidden_states.ndim == 3:
        if hidden_states.shape[0] != 1:
            raise ValueError(f"packed hidden states are [1, T, H]; got shape {tuple(hidden_states.shape)}")
        hidden_states = hidden_states[0]
    total = packed_tokens(batch)
    if total is not None and hidden_states.shape[0] != total:
        raise ValueError(
            f"the hidden states have {hidden_states.shape[0]} tokens but the packed batch has {total}: "
            "pool the outputs of this batch's forward, unshifted"
        )
    return hidden_states


def example_index(batch: Mapping, total: int, device: torch.device) -> torch.Tensor:
    """The example of every one of the ``total`` packed tokens, ``[T]`` int64 on ``device`` (no host sync)."""
    seq_idx = batch.get("seq_idx")
    if seq_idx is not None:
        return seq_idx.reshape(-1).to(device=device, dtype=torch.long)
    return token_examples(batch["cu_seq_lens_q"].to(device), total)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision values accumulate in float32 (as sentence-transformers does)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def prompt_lengths(batch: Mapping, n: int, device: torch.device) -> torch.Tensor | None:
    """The prompt length of every example as int64 ``[n]``, or ``None`` when the batch has no prompt."""
    value = batch.get(PROMPT_LENGTH_KEY)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return torch.full((n,), int(value), dtype=torch.long, device=device)
    value = value.reshape(-1).to(device=device, dtype=torch.long)
    if value.numel() == 1:
        return value.expand(n)
    if value.numel() != n:
        raise ValueError(
            f"{PROMPT_LENGTH_KEY!r} has {value.numel()} values for {n} examples: give one per example or a single int"
        )
    return value


@dataclass(frozen=True)
class _Segments:
    """Where every token of a packed row belongs: its example, its position in it, and whether it is pooled."""

    index: torch.Tensor  # int64 [T]: example of every token
    position: torch.Tensor | None  # int64 [T]: position inside its example (computed only when needed)
    keep: torch.Tensor | None  # bool [T]: False for prompt tokens that are left out; None keeps all
    lengths: torch.Tensor  # int64 [n]: pooled tokens per example

    @classmethod
    def of(cls, batch: Mapping, rows: torch.Tensor, include_prompt: bool, need_position: bool) -> "_Segments":
        cu = batch["cu_seq_lens_q"].to(rows.device, torch.long)
        lengths = cu.diff()
        index = example_index(batch, rows.shape[0], rows.device)
        prompt = None if include_prompt else prompt_lengths(batch, lengths.numel(), rows.device)
        position = keep = None
        if need_position or prompt is not None:
            position = torch.arange(rows.shape[0], device=rows.device) - cu[:-1].index_select(0, index)
        if prompt is not None:
            keep = position >= prompt.index_select(0, index)
            lengths = (lengths - prompt).clamp(min=0)
        return cls(index, position, keep, lengths)

    def masked(self, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``rows`` with left-out tokens set to ``fill`` (multiplication keeps it differentiable, no sync)."""
        if self.keep is None:
            return rows
        if fill == 0.0:
            return rows * self.keep.unsqueeze(-1).to(rows.dtype)
        return rows.masked_fill(~self.keep.unsqueeze(-1), fill)


@dataclass(frozen=True)
class FirstTokenPooler:
    """The first token of every example (BERT's CLS); the first token after the prompt with
    ``include_prompt=False`` (when the example is longer than its prompt)."""

    include_prompt: bool = True

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states, batch)
        cu = batch["cu_seq_lens_q"].to(rows.device, torch.long)
        first = cu[:-1]
        prompt = None if self.include_prompt else prompt_lengths(batch, first.numel(), rows.device)
        if prompt is not None:
            first = first + torch.where(cu.diff() > prompt, prompt, 0)
        return rows.index_select(0, first)


@dataclass(frozen=True)
class LastTokenPooler:
    """The last token of every example (decoder embedders, rerankers and classifiers)."""

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states, batch)
        return rows.index_select(0, batch["cu_seq_lens_q"][1:].to(rows.device, torch.long) - 1)


@dataclass(frozen=True)
class MeanPooler:
    """The mean over every example's tokens (``sqrt_len``: the sum divided by the square root of the length)."""

    include_prompt: bool = True
    sqrt_len: bool = False

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states, batch)
        segments = _Segments.of(batch, rows, self.include_prompt, need_position=False)
        accumulate = _accumulation_dtype(rows.dtype)
        sums = rows.new_zeros(segments.lengths.numel(), rows.shape[-1], dtype=accumulate)
        sums = sums.index_add(0, segments.index, segments.masked(rows).to(accumulate))
        counts = segments.lengths.unsqueeze(-1).to(accumulate).clamp(min=1e-9)
        return (sums / (counts.sqrt() if self.sqrt_len else counts)).to(rows.dtype)


@dataclass(frozen=True)
class MaxPooler:
    """The element-wise maximum over every example's tokens."""

    include_prompt: bool = True

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states, batch)
        n = batch["cu_seq_lens_q"].numel() - 1
        segments = _Segments.of(batch, rows, self.include_prompt, need_position=False)
        index = segments.index.unsqueeze(-1).expand_as(rows)
        values = segments.masked(rows, float("-inf"))
        return rows.new_zeros(n, rows.shape[-1]).scatter_reduce(0, index, values, reduce="amax", include_self=False)


@dataclass(frozen=True)
class WeightedMeanPooler:
    """Position-weighted mean (SGPT; sentence-transformers' ``weightedmean``): token ``i`` of an example
    (counting from 1) has weight ``i``, so later tokens — which have seen more of a causal decoder's input —
    count more."""

    include_prompt: bool = True

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states, batch)
        segments = _Segments.of(batch, rows, self.include_prompt, need_position=True)
        accumulate = _accumulation_dtype(rows.dtype)
        weights = (segments.position + 1).to(accumulate)
        if segments.keep is not None:
            weights = weights * segments.keep.to(accumulate)
        n = segments.lengths.numel()
        sums = rows.new_zeros(n, rows.shape[-1], dtype=accumulate).index_add(
            0, segments.index, rows.to(accumulate) * weights.unsqueeze(-1))
        totals = weights.new_zeros(n).index_add(0, segments.index, weights).clamp(min=1e-9)
        return (sums / totals.unsqueeze(-1)).to(rows.dtype)


#: The plain modes: one token, or an unweighted reduction over every token.
POOLERS = {"first": FirstTokenPooler, "cls": FirstTokenPooler, "last": LastTokenPooler, "mean": MeanPooler,
           "max": MaxPooler}
#: Every builtin mode: the plain ones plus the weighted reductions.
POOLING_MODES = {**POOLERS, "weighted_mean": WeightedMeanPooler,
                 "mean_sqrt_len": partial(MeanPooler, sqrt_len=True)}  # sentence-transformers' mean_sqrt_len_tokens


#: Other names of the builtin modes (sentence-transformers' ``pooling_mode_*_tokens``, common spellings): suggested
#: for an unknown mode, never accepted in its place.
POOLING_ALIASES = {"avg": "mean", "average": "mean", "mean_tokens": "mean", "max_tokens": "max", "cls_token": "cls",
                   "last_token": "last", "lasttoken": "last", "eos": "last", "weightedmean": "weighted_mean",
                   "mean_sqrt_len_tokens": "mean_sqrt_len"}


def unknown_mode_hint(mode: str) -> str:
    """``" Did you mean 'mean'? Builtin modes: …"`` for a pooling mode nothing provides: its builtin name when it
    is another name of one (``avg``) or a likely typo, then the builtin modes."""
    alias = POOLING_ALIASES.get(mode.lower())
    hint = f" Did you mean {alias!r}?" if alias else did_you_mean(mode, POOLING_MODES)
    return f"{hint} Builtin modes: {', '.join(POOLING_MODES)} (and any a plugin provides)."


def make_pooler(mode: str, *, include_prompt: bool = True):
    """The builtin pooler for ``mode``; a :class:`ConfigError` naming the modes otherwise.

    ``include_prompt=False`` leaves each example's ``prompt_length`` first tokens out (not for ``last``).
    """
    try:
        pooler = POOLING_MODES[mode]
    except KeyError:
        raise ConfigError(f"unknown pooling mode {mode!r}.{unknown_mode_hint(mode)}") from None
    if include_prompt or pooler is LastTokenPooler:
        return pooler()
    return pooler(include_prompt=False)
