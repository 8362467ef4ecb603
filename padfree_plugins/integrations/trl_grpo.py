"""The plugin for TRL ``GRPOTrainer`` (and subclasses that keep its ``compute_loss``, ``_compute_loss`` and
``_get_per_token_logps_and_entropies``): generation is TRL's (``model.generate``, padded, as always; vLLM on a GPU),
and every log-probability forward — the policy's in the loss, the old policy's over several iterations, the reference
model's when ``beta > 0`` — runs on the packed row of left-padded prompts and right-padded completions
(:mod:`.trl_fused`), with TRL's advantages, loss types (``grpo``, ``dr_grpo``, ``dapo``, ``bnpo`` …), clipping,
importance sampling and metrics unchanged.

Under ``sequence_parallel.size: N`` (text only) every one of those forwards goes through the group as DPO's
(:func:`~padfree_plugins.integrations.trl_fused.fused_on_slice`): each rank keeps its own completions'
log-probabilities. Generation stays TRL's, per rank and unsliced.
"""

from __future__ import annotations

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError
from padfree_plugins.integrations.trl_fused import FusedTrainerPatch, refuse_vllm_without_cuda


class GRPOTrainerPatch(FusedTrainerPatch):
    """TRL ``GRPOTrainer``: its fused log-probability forwards on the packed row."""

    trainer_class = "GRPOTrainer"
    kind = "grpo"
    packs_media = True
    sequence_parallel = True
    kept_methods = ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies")

    def check(self) -> None:
        refuse_vllm_without_cuda(self.trainer)
        if self.assembly.config.batching.strategy == "tokens":
            name = type(self.trainer).__name__
            raise ConfigError(
                f"batching.strategy: tokens with {name}: TRL samples a fixed number of prompts per generation "
                "(its RepeatSampler repeats each num_generations times), fills a rollout buffer of "
                "generation_batch_size completions, computes the advantages over each group, then cuts the buffer "
                "into steps_per_generation equal micro-batches. A token budget would change those sizes, which TRL's "
                "schedule and advantage code assume fixed, so it is not planned for this trainer: use "
                "batching.strategy: examples (every log-probability forward is still packed). To bound the memory "
                "of long completions, lower per_device_train_batch_size or max_completion_length.")
        super().check()


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``GRPOTrainer``, and subclasses that keep its loss and log-probabilities."""
    return GRPOTrainerPatch.wrap(trainer, assembly)
