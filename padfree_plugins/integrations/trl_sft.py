"""TRL ``SFTTrainer`` specifics, as TRL does them: rows TRL packed itself split back into their examples, the loss
from the fused LM head's log-probabilities (``fused_lm_head=True``: no logits materialised), the MoE ``aux_loss``
term, and TRL's metrics (``mean_token_accuracy``, ``entropy``, ``num_tokens``, ``aux_loss``) recorded as TRL records
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from padfree_plugins.errors import PadfreeError


def split_packed_row(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A row that TRL packed (``seq_lengths``) -> its examples; per-token lists are cut, other values copied."""
    lengths = [int(n) for n in row["seq_lengths"]]
    total = len(row["input_ids"])
    if sum(lengths) != total:
        raise PadfreeError(f"a packed row has {total} tokens but its seq_lengths add up to {sum(lengths)}")
    per_token = {k: v for k, v in row.items() if k != "seq_lengths" and hasattr(v, "__len__") and not isinstance(v, str)
                 and len(v) == total}
    other = {k: v for k, v in row.items() if k != "seq_lengths" and k not in per_token}
    examples, start = [], 0
    for n in lengths:
        examples.append({**other, **{k: v[start : start + n] for k, v in per_token.items()}})
        start += n
    return examples


def sft_loss(trainer: Any, outputs: Any, num_items_in_batch: Any) -> torch.Tensor:
    """The loss TRL's ``compute_loss`` makes from the fused LM head's per-token log-probabilities: NLL, or DFT
    (``loss_type: dft``, each token's loss weighted by its detached probability), over ``num_items_in_batch``
    (else the batch's labelled tokens)."""
    per_token = -outputs.log_probs
    if getattr(trainer.args, "loss_type", "nll") == "dft":
        per_token = per_token * outputs.log_probs.exp().detach()
    count = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    return per_token.sum() / torch.as_tensor(count).clamp(min=1)


def sft_aux_loss(trainer: Any, outputs: Any, num_items_in_batch: Any) -> torch.Tensor | float:
    """TRL's MoE load-balancing term: ``router_aux_loss_coef × aux_loss`` per micro-batch, spread over the
    accumulation steps when the trainer counts ``num_items_in_batch`` (added after the rank scaling, as TRL)."""
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss is None or not getattr(trainer, "aux_loss_enabled", False):
        return 0.0
    steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
    return trainer.router_aux_loss_coef * aux_loss / steps


def record_sft_metrics(trainer: Any, outputs: Any, inputs: Mapping) -> None:
    """TRL's bookkeeping around the fused loss: entropy, token accuracy, tokens seen, MoE aux loss."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    mode = "train" if trainer.model.training else "eval"
    gather = trainer.accelerator.gather_for_metrics
    label_mask = getattr(outputs, "label_mask", None)
    if label_mask is not None:
        num_valid = gather(label_mask.sum()).sum()
        for name, value in (("entropy", getattr(outputs, "entropy", None)),
                            ("mean_token_accuracy", getattr(outputs, "is_top1", None))):
            if value is not None:
                total = gather(value.detach().sum()).sum()
                metrics[mode][name].append((total / num_valid).item() if num_valid > 0 else 0.0)
    if mode == "train" and hasattr(trainer, "_total_train_tokens"):
        tokens = inputs["input_ids"].shape[-1]
        multiple = trainer.args.pad_to_multiple_of if getattr(trainer, "padding_free", False) else None
        if multiple:  # TRL's padding-free collator pads the row to a multiple, and counts that padding
            tokens = -(-tokens // multiple) * multiple
        tokens = torch.tensor(tokens, device=inputs["input_ids"].device)
        trainer._total_train_tokens += gather(tokens).sum().item() // getattr(trainer, "_tp_size", 1)
    if hasattr(trainer, "_total_train_tokens"):
        metrics[mode]["num_tokens"] = [trainer._total_train_tokens]
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss is not None:
        metrics[mode]["aux_loss"].append(gather(aux_loss.detach()).mean().item())
