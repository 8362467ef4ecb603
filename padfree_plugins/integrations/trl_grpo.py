"""The plugin for TRL ``GRPOTrainer`` (and subclasses that keep its ``compute_loss``, ``_compute_loss`` and
``_get_per_token_logps_and_entropies``): generation is TRL's (``model.generate``, padded, as always; vLLM on a GPU),
and every log-probability forward — the policy's in the loss, the old policy's over several iterations, the reference
model's when ``beta > 0`` — runs on the packed row of left-padded prompts and right-padded completions
(:mod:`.trl_fused`), with TRL's advantages, loss types (``grpo``, ``dr_grpo``, ``dapo``, ``bnpo`` …), clipping,
importance sampling and metrics unchanged.
"""

from __future__ import annotations

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.integrations.trl_fused import FusedTrainerPatch, refuse_vllm_without_cuda


class GRPOTrainerPatch(FusedTrainerPatch):
    """TRL ``GRPOTrainer``: its fused log-probability forwards on the packed row."""

    trainer_class = "GRPOTrainer"
    kind = "grpo"
    kept_methods = ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies")

    def check(self) -> None:
        refuse_vllm_without_cuda(self.trainer)
        super().check()


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``GRPOTrainer``, and subclasses that keep its loss and log-probabilities."""
    return GRPOTrainerPatch.wrap(trainer, assembly)
