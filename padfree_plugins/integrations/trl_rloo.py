"""The plugin for TRL ``RLOOTrainer`` (and subclasses that keep its ``compute_loss``, ``_compute_loss`` and
``_get_per_token_logps_and_entropies``): generation is TRL's (``model.generate``, padded, as always; vLLM on a GPU),
and every log-probability forward — the policy's in the loss, the old policy's over several iterations, the reference
model's when ``beta > 0`` — runs on the packed row of left-padded prompts and right-padded completions
(:mod:`.trl_fused`), with TRL's leave-one-out advantages, KL in the reward or in the loss, clipping, importance
sampling and metrics unchanged.
"""

from __future__ import annotations

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.integrations.trl_grpo import GRPOTrainerPatch


class RLOOTrainerPatch(GRPOTrainerPatch):
    """TRL ``RLOOTrainer``: its fused log-probability forwards on the packed row (as GRPO's: the same methods
    kept, vLLM refused without CUDA)."""

    trainer_class = "RLOOTrainer"
    kind = "rloo"


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``RLOOTrainer``, and subclasses that keep its loss and log-probabilities."""
    return RLOOTrainerPatch.wrap(trainer, assembly)
