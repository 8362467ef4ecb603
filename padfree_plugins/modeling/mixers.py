"""Boundary-aware sequence mixers: the layers other than attention that carry taps or state along the sequence,
restarted at every example of a packed row.

A causal convolution over a packed row would reach from each example's first tokens into the previous example; a
state-space scan or a linear-attention recurrence would carry the previous example's state. Here each mixer reads
the collator's boundaries (``cu_seq_lens_q``, computed once) and computes exactly what every example computes
alone, on real tokens only:

* :func:`boundary_causal_conv1d` — a depthwise causal conv1d whose taps are masked where they would cross an
  example's start (vectorised: one shifted multiply-add per tap, no per-example loop), so that a token ``j``
  places into its example sees zeros before its start, as at the start of a row.

An architecture plugin routes a model's mixer modules here for packed calls (see ``builtin/architectures/lfm2.py``)
and leaves padded calls and ``generate()`` to the model's own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from padfree_plugins.packing.batch import token_examples


def positions_in_examples(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """Every packed token's position inside its example (int64 ``[T]``), from the boundaries; no host sync."""
    example = token_examples(cu_seq_lens, total)
    return torch.arange(total, device=cu_seq_lens.device) - cu_seq_lens.long()[example]


def boundary_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """A depthwise causal conv1d of a packed row ``x`` ``[1, C, T]`` with ``weight`` ``[C, K]`` (and ``bias``
    ``[C]``), restarted at every example boundary of ``cu_seq_lens``: equal to ``F.conv1d(x, weight[:, None],
    bias, padding=K - 1, groups=C)[..., :T]`` run on each example alone.

    Tap ``j`` (looking ``j`` tokens back) is multiplied in only where the token is at least ``j`` into its example.
    """
    if x.ndim != 3 or x.shape[0] != 1:
        raise ValueError(f"a packed row is [1, C, T]; got {tuple(x.shape)}")
    total, kernel = x.shape[-1], weight.shape[-1]
    position = positions_in_examples(cu_seq_lens.to(x.device), total)
    x = x.to(weight.dtype)
    out = x * weight[:, kernel - 1, None]
    for back in range(1, min(kernel, total)):
        shifted = F.pad(x, (back, 0))[..., :total] * (position >= back).to(x.dtype)
        out = out + shifted * weight[:, kernel - 1 - back, None]
    if bias is not None:
        out = out + bias[:, None]
    return out
