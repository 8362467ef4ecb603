"""The plugin for TRL ``KTOTrainer`` (and subclasses that keep its ``compute_loss``, ``_compute_loss`` and
``prediction_step``): every log-probability forward — the policy's completions, the reference model's, the mismatched
KL completions — runs on the packed row (:mod:`.trl_fused`), with TRL's loss (``kto``, ``apo_zero_unpaired``), its
desirable / undesirable weights and metrics unchanged.

``precompute_ref_log_probs=True``: as for DPO, TRL's pass in ``__init__`` runs padded; later ones run packed.
"""

from __future__ import annotations

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.integrations.trl_fused import FusedTrainerPatch


class KTOTrainerPatch(FusedTrainerPatch):
    """TRL ``KTOTrainer``: its fused log-probability forwards on the packed row."""

    trainer_class = "KTOTrainer"
    kind = "kto"
    kept_methods = ("compute_loss", "_compute_loss", "prediction_step", "compute_ref_log_probs",
                    "_compute_kl_logps")


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``KTOTrainer``, and subclasses that keep its loss."""
    return KTOTrainerPatch.wrap(trainer, assembly)
