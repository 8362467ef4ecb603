"""Loss normalisation across ranks: every rank divides by the global token count, so training equals one process.

One process training on a global batch (the ``N`` micro-batches of a step) minimises
``sum of token losses / tokens in the global batch``. Under data parallelism each rank holds one micro-batch with
its own token count, so a per-rank mean would weight a token of a light rank more than one of a heavy rank. The
fix, the same as HF ``Trainer``'s ``num_items_in_batch`` with ``average_tokens_across_devices``:

1. count the loss tokens of the local micro-batch(es) of this step: :func:`num_label_tokens`;
2. sum the counts over the ranks: :func:`global_token_count` (one all-reduce of a scalar per step);
3. per rank, ``loss = sum of local token losses / global count`` — pass ``num_items_in_batch=count`` to a
   transformers model, whose loss then sums instead of averaging;
4. multiply by ``accelerator.num_processes`` before ``backward``: DDP (and FSDP, DeepSpeed) *average* gradients
   over ranks, and ``N × mean over ranks`` is the sum the single process computes.

The reported step loss is the sum over ranks of the unscaled per-rank losses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def num_label_tokens(batch: Mapping[str, Any], *, shift: bool = True, ignore_index: int = -100) -> torch.Tensor:
    """Label tokens a loss counts in a packed micro-batch: ``labels[..., 1:]`` when the loss shifts (causal LM),
    else ``labels``; positions equal to ``ignore_index`` do not count."""
    labels = batch["labels"]
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


def global_token_count(accelerator: Any, count: torch.Tensor | int) -> torch.Tensor:
    """``count`` summed over all ranks of ``accelerator`` (the same value on every rank)."""
    count = torch.as_tensor(count, device=accelerator.device).detach().clone()
    return accelerator.reduce(count, reduction="sum")
