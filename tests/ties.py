"""Discontinuous quantities (a sort order, an accuracy, an argmax) compared only clear of ties.

Padded and padding-free runs agree to fp32 rounding (~1e-6), and that rounding differs between CPU kinds (oneDNN /
BLAS kernels on Intel and AMD). A rank, an accuracy or an argmax taken where two values lie closer than that flips
on one machine and not on another. So a test that compares one either builds data whose gaps are far above
rounding and asserts it (:func:`assert_clear`), or compares it only where the run's own gaps allow it
(:func:`allowed_flips`), with the continuous values behind it compared tightly everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: A gap that rounding cannot cross: ~1000x the largest padded / padding-free difference of a score or a logit.
CLEAR = 1e-3


def sorted_gaps(scores: torch.Tensor, groups: Sequence[int]) -> torch.Tensor:
    """The gaps between neighbours of each group's sorted scores (``groups``: the sizes of consecutive groups of the
    flat ``scores``), all groups together: where a sort could flip."""
    gaps = [part.detach().double().sort().values.diff() for part in scores.flatten().split(list(groups))]
    return torch.cat([torch.zeros(0, dtype=torch.float64), *gaps])


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """The gap between the largest and the second largest value along the last dimension: where an argmax could
    flip, one per position."""
    top = logits.detach().double().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def assert_clear(gaps: torch.Tensor, what: str, clear: float = CLEAR) -> None:
    """Every gap is at least ``clear``: no rounding can flip the discontinuous quantity built on them."""
    assert gaps.numel(), f"no {what} recorded: the check would prove nothing"
    smallest = gaps.abs().min().item()
    assert smallest >= clear, f"{what} {smallest:.2e} apart: rounding can flip them; use data with larger gaps"


def allowed_flips(margins: torch.Tensor, clear: float = CLEAR) -> int:
    """How many of ``margins`` (a sign or an argmax decided by each) rounding could flip: those within ``clear``."""
    return int((margins.detach().abs() < clear).sum())
