"""Discontinuous quantities (a sort order, an accuracy, an argmax) compared only clear of ties.

Padded and padding-free runs agree to fp32 rounding (~1e-6), and that rounding differs between CPU kinds (oneDNN /
BLAS kernels on Intel and AMD). A rank, an accuracy or an argmax taken where two values lie closer than that flips
on one machine and not on another. So a test that compares one either builds data whose gaps are far above
rounding and asserts it (:func:`assert_clear`), or compares it only where the run's own gaps allow it
(:func:`allowed_flips`), with the continuous values behind it compared tightly everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from padfree_plugins.modeling.patching import unwrap_model

#: A gap that rounding cannot cross: 10x the loosest tolerance on a continuous value (1e-4), ~1000x the padded /
#: padding-free difference of a score or a logit (~1e-6).
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


def flip_shares(margins: Sequence[torch.Tensor], calls: int) -> list[float]:
    """Per group of ``calls`` consecutive forwards (a logged step, an evaluation), the mean share of the items whose
    discontinuous value rounding could flip (``margins``: one tensor per forward): how far a logged mean may move."""
    assert margins and len(margins) % calls == 0, (len(margins), calls)
    return [sum(allowed_flips(m) / max(m.numel(), 1) for m in margins[start:start + calls]) / calls
            for start in range(0, len(margins), calls)]


def excess_over_flips(got: Sequence[float], want: Sequence[float], shares: Sequence[float], what: str) -> float:
    """How far ``got`` (a discontinuous value per step: an accuracy) differs from ``want`` beyond what rounding could
    flip: ``shares``, per step, the share of its items within :data:`CLEAR` (:func:`allowed_flips`); <= 0 if within.
    Asserts first that the shares leave a real comparison: on average at most a quarter of the items near a tie."""
    assert len(got) == len(want) == len(shares)
    assert sum(shares) <= len(shares) / 4, f"{what}: too many near-ties ({list(shares)}); use data with larger margins"
    return max(abs(g - w) - share for g, w, share in zip(got, want, shares))


def label_margins(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each counted position's logit of its label over the best other one (``labels`` aligned with ``logits``,
    ``-100`` not counted): an argmax-equals-label test flips only where this is near 0. One value per counted token."""
    counted = labels != -100
    logits, targets = logits[counted].double(), labels[counted].long()
    label = logits.gather(1, targets[:, None])[:, 0]
    return label - logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values


@contextmanager
def recording_token_margins(model) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of the (padded) causal LM ``model`` given ``labels`` (or ``shift_labels``)
    appends to the list it yields the :func:`label_margins` of its counted tokens, per row (a list of tensors), from
    the decoder's last hidden state and the output embeddings (a fused LM head gives no logits). Only the first
    decoder call of each labelled forward counts (a reference run of the same model, adapters off, follows it)."""
    inner = unwrap_model(model)
    margins: list[list[torch.Tensor]] = []
    state: dict = {}

    def labels_of(module, args, kwargs):
        if kwargs.get("shift_labels") is not None:
            state["labels"] = kwargs["shift_labels"]
        elif kwargs.get("labels") is not None:
            state["labels"] = torch.nn.functional.pad(kwargs["labels"][:, 1:], (0, 1), value=-100)

    def record(module, args, output):
        labels = state.pop("labels", None)
        if labels is None:
            return
        logits = output.last_hidden_state.detach() @ inner.get_output_embeddings().weight.detach().T
        margins.append([label_margins(row_logits, row_labels) for row_logits, row_labels in zip(logits, labels)])

    handles = [inner.register_forward_pre_hook(labels_of, with_kwargs=True),
               inner.get_decoder().register_forward_hook(record)]
    try:
        yield margins
    finally:
        for handle in handles:
            handle.remove()


def greedy(model, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.generate(*args, do_sample=False, **kwargs)``: the sequences, and the :func:`top2_gaps` of every new
    token's scores (``[rows, new tokens]``): where greedy decoding could take another token."""
    out = model.generate(*args, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack([top2_gaps(scores) for scores in out.scores], dim=1)


def assert_same_greedy(got: torch.Tensor, want: torch.Tensor, gaps: torch.Tensor, clear: float = CLEAR) -> None:
    """``got`` decodes ``want`` (``want``, ``gaps``: :func:`greedy`'s), or a row parts from it first at a token whose
    top two scores lay within ``clear`` (a near-tie rounding can decide; after it the rows cannot be compared)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    new, compared = gaps.shape[1], 0
    for row, (mine, theirs) in enumerate(zip(got[:, -new:], want[:, -new:])):
        differ = (mine != theirs).nonzero()
        step = int(differ[0]) if len(differ) else new
        assert step == new or gaps[row, step] < clear, f"row {row} decodes another token at {step}, clear of any tie"
        compared += step
    assert torch.equal(got[:, :-new], want[:, :-new])
    assert compared >= gaps.numel() / 2, "near-ties early in most rows: the comparison would prove little"
