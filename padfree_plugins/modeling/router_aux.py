"""The MoE load-balancing loss (``output_router_logits``) of a sequence-parallel group's row.

transformers' ``load_balancing_loss_func`` (Switch Transformer, the one of Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss,
GraniteMoE, Jamba …: the families that compute one, Doge aside) is, over the rows ``R`` of every MoE layer's router
logits::

    aux = E × Σ_e (C_e / R) × (P_e / R)

with ``C_e`` the top-k picks of expert ``e`` and ``P_e`` the sum of its router probabilities. Each rank of a group
routes only its slice, so the model's own ``aux_loss`` is the slice's. The group's one is exact from sums over
tokens: the picks ``C`` and the rows ``R`` (no gradient) all-reduced over the group, then each rank's **share**
``E × Σ_e (C_e / R) × (P_e,rank / R)`` from its own probabilities. The shares sum to the row's loss (the loss is
linear in ``P`` once ``C`` and ``R`` are known), and each share's gradient is the row loss's through this rank's
tokens: summed over the group (the project's convention for every per-token loss, see
:mod:`padfree_plugins.modeling.sequence_parallel`), they give one process's value and gradient. The padding
segment of the row is left out, as a process without it never routes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from padfree_plugins.errors import PadfreeError

__all__ = ["RouterAux", "group_statistics", "router_statistics", "switch_loss"]


def router_statistics(router_logits: Sequence[torch.Tensor], top_k: int,
                      rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert, the top-k picks and the summed router probabilities (with gradient) over the first ``rows`` rows
    of every layer's router logits (``None``: all), and the number of rows counted, as transformers computes them."""
    counts = probabilities = None
    total = 0
    for layer in router_logits:
        layer = layer.reshape(-1, layer.shape[-1])
        layer = layer if rows is None else layer[:rows]
        weights = torch.nn.functional.softmax(layer, dim=-1)
        picked = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        layer_counts = torch.zeros(layer.shape[-1], dtype=torch.float32, device=layer.device)
        layer_counts.index_add_(0, picked, torch.ones_like(picked, dtype=torch.float32))
        layer_sums = weights.float().sum(dim=0)
        counts = layer_counts if counts is None else counts + layer_counts
        probabilities = layer_sums if probabilities is None else probabilities + layer_sums
        total += layer.shape[0]
    if counts is None or probabilities is None:
        raise PadfreeError("output_router_logits: the model returned no router logits")
    return counts, probabilities, torch.tensor(float(total), device=counts.device)


def switch_loss(counts: torch.Tensor, probabilities: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``E × Σ_e (counts_e / rows) × (probabilities_e / rows)``: transformers' load-balancing loss from its sums."""
    return counts.numel() * torch.sum((counts / rows) * (probabilities / rows))


def group_statistics(counts: torch.Tensor, rows: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks and rows of the whole row: this rank's summed over the sequence-parallel ``group`` (no gradient)."""
    summed = torch.cat([counts.detach(), rows.detach().reshape(1)])
    dist.all_reduce(summed, group=group.group)
    return summed[:-1], summed[-1]


@dataclass(frozen=True)
class RouterAux:
    """What the model's own load-balancing term used: its experts, its top-k and its coefficient."""

    top_k: int
    coefficient: float

    @classmethod
    def of(cls, model: Any) -> RouterAux | None:
        """The model's top-k and ``router_aux_loss_coef`` as its forward reads them (the model's attributes, else
        its text config's); ``None`` for a model without routed experts."""
        text = model.config.get_text_config()
        top_k = getattr(model, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
        coefficient = getattr(model, "router_aux_loss_coef", None)
        if coefficient is None:
            coefficient = getattr(text, "router_aux_loss_coef", None)
        if not isinstance(top_k, int) or coefficient is None:
            return None
        return cls(top_k, float(coefficient))

    def check(self, outputs: Mapping, name: str) -> None:
        """Refuse a family whose ``aux_loss`` is not transformers' load-balancing loss of its router logits (its
        slice's, as the model computed it): the group's could not be made from sums over tokens."""
        with torch.no_grad():
            mine = switch_loss(*router_statistics(outputs["router_logits"], self.top_k))
        theirs = outputs["aux_loss"].detach().float()
        if not torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6):
            raise PadfreeError(
                f"{name}'s router aux loss ({theirs.item():.6g}) is not the load-balancing loss of its router logits "
                f"that sequence parallelism reduces over the group ({mine.item():.6g}, top-{self.top_k}): its ranks "
                "would each train their slice's. Set output_router_logits=False (or router_aux_loss_coef=0.0), or "
                "train with sequence_parallel.size: 1")

    def share(self, router_logits: Sequence[torch.Tensor], real: int, group: Any) -> torch.Tensor:
        """This rank's share of the group row's load-balancing loss, from its first ``real`` tokens (the rest is
        the padding segment)."""
        counts, probabilities, rows = router_statistics(router_logits, self.top_k, real)
        counts, rows = group_statistics(counts, rows, group)
        return switch_loss(counts, probabilities, rows)
