"""Losses that read the tokenized features themselves: made to work on packed features, or refused.

Most sentence-transformers losses only see what the model returns (embeddings, scores), which padding-free
computes per text. A few read the features directly, and a packed column is one ``[1, T]`` row with boundaries,
not a padded ``[n, L]`` batch:

* ``ContrastiveTensionLoss`` without a label column labels a pair 1 when both texts have the same tokens, comparing
  padded rows: :class:`TensionLabelsPerText` compares the packed texts instead (the same labels).
* ``DenoisingAutoEncoderLoss`` feeds its decoder the padded token ids of the target column: refused before training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.errors import PadfreeError
from padfree_plugins.modeling.patching import own_attribute, restore_attributes
from padfree_plugins.packing.batch import token_examples


def loss_modules(trainer: Any) -> list[torch.nn.Module]:
    """Every module inside the trainer's loss (or losses, one per dataset), wrapped losses included."""
    losses = trainer.loss.values() if isinstance(trainer.loss, dict) else [trainer.loss]
    return [module for loss in losses if isinstance(loss, torch.nn.Module) for module in loss.modules()]


def texts(features: dict[str, Any]) -> list[torch.Tensor]:
    """The token ids of every text of a packed column."""
    cu = features["cu_seq_lens_q"].tolist()
    return [features["input_ids"][0, start:end] for start, end in zip(cu[:-1], cu[1:])]


def same_texts(first: dict[str, Any], second: dict[str, Any]) -> torch.Tensor:
    """1.0 where text ``i`` of two packed columns (as many texts each) has the same tokens, else 0.0 (float32
    ``[n]``): computed on the device, with nothing read back to the host (no per-text ``torch.equal``)."""
    ids, other = first["input_ids"].reshape(-1), second["input_ids"].reshape(-1)
    cu, other_cu = (features["cu_seq_lens_q"].to(ids.device, torch.long) for features in (first, second))
    lengths = cu.diff()
    text = token_examples(cu, ids.numel())
    position = torch.arange(ids.numel(), device=ids.device) - cu[:-1][text]
    # where the lengths differ the partner may lie in another text (clamped into the row): the label is 0 anyway
    partner = (other_cu[:-1][text] + position).clamp(max=other.numel() - 1)
    mismatches = torch.zeros_like(lengths).index_add_(0, text, (ids != other[partner]).long())
    return ((lengths == other_cu.diff()) & (mismatches == 0)).float()


@dataclass
class TensionLabelsPerText:
    """``ContrastiveTensionLoss.forward`` that, on packed features without labels, labels each pair 1 when its two
    texts have the same tokens (what the loss derives from padded rows itself)."""

    loss: Any

    def __call__(self, sentence_features: Any, labels: torch.Tensor | None = None) -> torch.Tensor:
        sentence_features = list(sentence_features)
        if labels is None and all("cu_seq_lens_q" in features for features in sentence_features):
            first, second = sentence_features
            if first["cu_seq_lens_q"].shape == second["cu_seq_lens_q"].shape:
                labels = same_texts(first, second)
            else:  # columns with different numbers of texts: pairs as zip makes them
                labels = torch.tensor([torch.equal(a, b) for a, b in zip(texts(first), texts(second))],
                                      dtype=torch.float32, device=first["input_ids"].device)
        return type(self.loss).forward(self.loss, sentence_features, labels)


@dataclass
class LossPatches:
    """The loss forwards :func:`patch_losses` replaced; :meth:`undo` restores them."""

    saved: list[tuple[Any, dict[str, Any]]]
    active: bool = True

    def undo(self) -> None:
        if not self.active:
            return
        for loss, saved in self.saved:
            restore_attributes(loss, saved)
        self.active = False


def patch_losses(trainer: Any) -> LossPatches:
    """Refuse the losses that cannot read packed features; give ``ContrastiveTensionLoss`` per-text labels."""
    from sentence_transformers.sentence_transformer.losses import ContrastiveTensionLoss, DenoisingAutoEncoderLoss

    modules = loss_modules(trainer)
    for module in modules:
        if isinstance(module, DenoisingAutoEncoderLoss):
            raise PadfreeError(
                "DenoisingAutoEncoderLoss feeds its decoder the padded token ids of the target column, which "
                "padding-free training packs into one row: train this loss without padfree_plugins.accelerate()"
            )
    saved = []
    for module in modules:
        if type(module).forward is ContrastiveTensionLoss.forward:
            saved.append((module, {"forward": own_attribute(module, "forward")}))
            module.forward = TensionLabelsPerText(module)
    return LossPatches(saved)
