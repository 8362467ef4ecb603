"""Per-example pooling straight from a packed row: gather or segment reduction over ``cu_seq_lens``.

Every pooler is a small picklable callable ``(hidden_states [1, T, H] or [T, H], batch) -> [n, H]``; none
re-pads the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import ConfigError, did_you_mean


def _rows(hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.ndim == 3:
        if hidden_states.shape[0] != 1:
            raise ValueError(f"packed hidden states are [1, T, H]; got shape {tuple(hidden_states.shape)}")
        return hidden_states[0]
    return hidden_states


def _example_index(batch: Mapping, total: int, device: torch.device) -> torch.Tensor:
    seq_idx = batch.get("seq_idx")
    if seq_idx is not None:
        return seq_idx.reshape(-1).to(device=device, dtype=torch.long)
    lengths = batch["cu_seq_lens_q"].diff().to(device)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)


@dataclass(frozen=True)
class FirstTokenPooler:
    """The first token of every example (BERT's CLS)."""

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states)
        return rows.index_select(0, batch["cu_seq_lens_q"][:-1].to(rows.device, torch.long))


@dataclass(frozen=True)
class LastTokenPooler:
    """The last token of every example (decoder embedders, rerankers and classifiers)."""

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states)
        return rows.index_select(0, batch["cu_seq_lens_q"][1:].to(rows.device, torch.long) - 1)


@dataclass(frozen=True)
class MeanPooler:
    """The mean over every example's tokens."""

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states)
        cu = batch["cu_seq_lens_q"].to(rows.device)
        index = _example_index(batch, rows.shape[0], rows.device)
        sums = rows.new_zeros(cu.numel() - 1, rows.shape[-1]).index_add(0, index, rows)
        return sums / cu.diff().unsqueeze(-1).to(rows.dtype)


@dataclass(frozen=True)
class MaxPooler:
    """The element-wise maximum over every example's tokens."""

    def __call__(self, hidden_states: torch.Tensor, batch: Mapping) -> torch.Tensor:
        rows = _rows(hidden_states)
        n = batch["cu_seq_lens_q"].numel() - 1
        index = _example_index(batch, rows.shape[0], rows.device).unsqueeze(-1).expand_as(rows)
        return rows.new_zeros(n, rows.shape[-1]).scatter_reduce(0, index, rows, reduce="amax", include_self=False)


POOLERS = {"first": FirstTokenPooler, "cls": FirstTokenPooler, "last": LastTokenPooler, "mean": MeanPooler,
           "max": MaxPooler}


def make_pooler(mode: str):
    """The builtin pooler for ``mode``; a :class:`ConfigError` naming the modes otherwise."""
    try:
        return POOLERS[mode]()
    except KeyError:
        raise ConfigError(
            f"unknown pooling mode {mode!r}.{did_you_mean(mode, POOLERS)} Builtin modes: {', '.join(POOLERS)}"
        ) from None
