"""The plugin for TRL ``KTOTrainer`` (and subclasses that keep its ``compute_loss``, ``_compute_loss`` and
``prediction_step``): every log-probability forward — the policy's completions, the reference model's, the mismatched
KL completions — runs on the packed row (:mod:`.trl_fused`), with TRL's loss (``kto``, ``apo_zero_unpaired``), its
desirable / undesirable weights and metrics unchanged.

Under ``sequence_parallel.size: N`` (text only) every one of those forwards goes through the group as DPO's
(:func:`~padfree_plugins.integrations.trl_fused.fused_on_slice`): each rank keeps its own rows' log-probabilities.
``compute_metrics`` / ``predict`` get the logits of TRL's extra forward without the fused head, TRL's own padded
forward of the rank's own rows (said in a warning), as under data parallelism.

``precompute_ref_log_probs=True``: as for DPO, TRL's pass in ``__init__`` runs padded; later ones run packed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from padfree_plugins.batching.sampler import column_lengths
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError
from padfree_plugins.integrations.trl_fused import FusedTrainerPatch


class KTOTrainerPatch(FusedTrainerPatch):
    """TRL ``KTOTrainer``: its fused log-probability forwards on the packed row."""

    trainer_class = "KTOTrainer"
    kind = "kto"
    packs_media = True
    sequence_parallel = True
    metrics_forward = True
    kept_methods = ("compute_loss", "_compute_loss", "prediction_step", "compute_ref_log_probs",
                    "_compute_kl_logps")
    budgets_rows = True
    image_budget_refusal = (
        "TRL's vision KTO collator builds each row's KL completion from another row of the same micro-batch (it "
        "cycles the completions), so a row's tokens depend on which rows meet and cannot be counted before planning")

    def check_budget(self, vision: bool) -> None:
        """As every row budget; and with the KL term, at least two rows: TRL gives each row the completion of another
        row for its KL term, and a dataset of one row would pair a completion with itself (the KL term would be the
        implied reward)."""
        dataset = self.trainer.train_dataset
        if getattr(self.trainer, "calculate_KL", False) and dataset is not None and hasattr(dataset, "__len__") \
                and len(dataset) < 2:
            raise ConfigError(
                f"KTOTrainer with batching.strategy: tokens on a dataset of {len(dataset)} row(s): too small for its "
                "KL term, which pairs each prompt with another row's completion. Add rows, or train without the KL "
                "term (a loss_type that does not use it)")
        super().check_budget(vision)

    def row_lengths(self) -> np.ndarray:
        """Every row's tokens as its forwards compute them: prompt + completion, and prompt + its mismatched KL
        completion when TRL computes the KL term (TRL builds it into the row, rotating completions within chunks of
        ``per_device_train_batch_size`` of the dataset), each cut to ``max_length`` as TRL's collator cuts it."""
        return kto_row_lengths(self.trainer.train_dataset, self.trainer.args.max_length,
                               bool(getattr(self.trainer, "calculate_KL", False)))


def kto_row_lengths(dataset: Any, max_length: int | None, with_kl: bool) -> np.ndarray:
    """See :meth:`KTOTrainerPatch.row_lengths`: ``dataset`` tokenized by TRL (``prompt_ids``, ``completion_ids``,
    ``KL_completion_ids``)."""
    keys = ("prompt_ids", "completion_ids", *(("KL_completion_ids",) if with_kl else ()))
    lengths = column_lengths(dataset, keys, "KTO rows")
    limit = np.iinfo(np.int64).max if max_length is None else max_length
    tokens = np.minimum(lengths["prompt_ids"] + lengths["completion_ids"], limit)
    if with_kl:
        tokens = tokens + np.minimum(lengths["prompt_ids"] + lengths["KL_completion_ids"], limit)
    return tokens


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``KTOTrainer``, and subclasses that keep its loss."""
    return KTOTrainerPatch.wrap(trainer, assembly)
