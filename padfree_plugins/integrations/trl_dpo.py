"""The plugin for TRL ``DPOTrainer`` (and subclasses that keep its ``compute_loss``, ``_compute_loss`` and
``prediction_step``): prompt + chosen and prompt + rejected of every pair packed into one row at each log-probability
forward, the policy's and the reference model's (:mod:`.trl_fused`), with TRL's loss code unchanged — every loss type
(sigmoid, IPO, hinge, robust, …, several at once with weights), ``ld_alpha``, WPO weighting, the MoE aux loss, and
TRL's metrics.

``precompute_ref_log_probs=True``: TRL computes the reference log-probabilities in the trainer's ``__init__``, before
``accelerate()`` can patch anything, so that pass runs padded; the reference passes of an ``evaluate()`` on a new
dataset, and every reference forward without precomputation, run packed.

Image-text preference data (TRL's ``DataCollatorForVisionPreference``) for every vision-language family: every fused
call is split into its rows, each row's media with it (the family's ``split_call``), and packed by the family's
multimodal collator (:func:`~padfree_plugins.integrations.trl_fused.pack_media_call`). Under ``batching.strategy:
tokens`` each pair's tokens and pixels are counted once by TRL's collator on the pair alone
(:meth:`~padfree_plugins.integrations.trl_fused.FusedTrainerPatch.image_text_sizes`), and
``batching.max_pixels_per_batch`` is kept beside the token budget.

Under ``sequence_parallel.size: N`` (text only) every fused call's packed row is split across the group and each rank
keeps its own examples' log-probabilities (:func:`~padfree_plugins.integrations.trl_fused.fused_on_slice`): the loss,
its normalisation and the metrics are TRL's, as under data parallelism. ``compute_metrics`` / ``predict`` get the
logits of TRL's extra forward without the fused head, which runs TRL's own padded forward of the rank's own batch
(said in a warning): each rank's own examples, as one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from padfree_plugins.batching.sampler import column_lengths
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.integrations.trl_fused import FusedTrainerPatch
from padfree_plugins.modeling.mixers import mixer_chunk


class DPOTrainerPatch(FusedTrainerPatch):
    """TRL ``DPOTrainer``: its fused log-probability forwards on the packed row."""

    trainer_class = "DPOTrainer"
    kind = "dpo"
    kept_methods = ("compute_loss", "_compute_loss", "prediction_step", "compute_ref_log_probs")
    packs_media = True
    sequence_parallel = True
    metrics_forward = True
    budgets_rows = True
    image_budget_refusal = None

    def row_lengths(self) -> np.ndarray:
        """Every pair's tokens as its forwards compute them: prompt + chosen and prompt + rejected, each cut to
        ``max_length`` as TRL's collator cuts it, the prompt counted once when the pair shares it (and neither text
        was cut: otherwise twice, an upper bound)."""
        return pair_lengths(self.trainer.train_dataset, self.trainer.args.max_length, self.shares_prefixes,
                            mixer_chunk(self.assembly.model))


def pair_lengths(dataset: Any, max_length: int | None, shared: bool, chunk: int = 1) -> np.ndarray:
    """The tokens of every row of a tokenized DPO dataset (``prompt_ids``, ``chosen_ids``, ``rejected_ids``): see
    :meth:`DPOTrainerPatch.row_lengths`; with sequence mixers that pad each run to ``chunk``, a prompt counted once
    only where sharing it pays (:func:`~padfree_plugins.packing.prefixes.prefix_tree`)."""
    columns = column_lengths(dataset, ("prompt_ids", "chosen_ids", "rejected_ids"), "DPO pairs")
    prompt, chosen, rejected = columns["prompt_ids"], columns["chosen_ids"], columns["rejected_ids"]
    limit = np.iinfo(np.int64).max if max_length is None else max_length
    with_chosen, with_rejected = np.minimum(prompt + chosen, limit), np.minimum(prompt + rejected, limit)
    whole = (prompt + chosen <= limit) & (prompt + rejected <= limit)
    once = np.minimum(prompt, np.minimum(with_chosen, with_rejected) - 1) if shared else np.zeros_like(prompt)
    if chunk > 1:
        padded = lambda size: -(-size // chunk) * chunk  # noqa: E731
        pays = padded(once) + padded(with_chosen - once) + padded(with_rejected - once) <= \
            padded(with_chosen) + padded(with_rejected)
        once = np.where(pays, once, 0)
    return with_chosen + with_rejected - np.where(whole, once, 0)


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``DPOTrainer``, and subclasses that keep its loss."""
    return DPOTrainerPatch.wrap(trainer, assembly)
