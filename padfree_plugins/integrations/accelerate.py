"""``accelerate(trainer, "padfree.yaml")``: make a trainer train padding-free, through whichever plugin knows it.

Build the trainer as usual (no flag to change, ``remove_unused_columns`` left as it is), then::

    acceleration = padfree_plugins.accelerate(trainer, "padfree.yaml")
    trainer.train()                 # packed batches, same loss as padded
    acceleration.undo()             # optional: the trainer and the model are as before

What happens, in order (see docs/writing-a-plugin.md, *Lifecycle*):

1. the ``trainer_config`` hook may change the config the trainer implies (a RewardTrainer's ``seq_cls`` task,
   a sentence-transformers model's task);
2. the model is assembled (:func:`~padfree_plugins.assembly.assemble`: plugins resolved, the model patched);
3. the ``wrap_trainer`` hook: the first plugin that knows the trainer patches it (the builtin ones:
   :mod:`.hf_trainer`, :mod:`.trl_sft`, :mod:`.trl_reward`, each on :class:`~.base.TrainerPatch`, and last
   :mod:`.generic` (``any_trainer``) for any other ``transformers.Trainer`` subclass, through ``unpad``). None
   knowing it is an error, and the model is restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from padfree_plugins.assembly import Assembly, assemble
from padfree_plugins.config.schema import PadfreeConfig, load_config
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.errors import ConfigError, PadfreeError, PluginError
from padfree_plugins.integrations.checks import check_model_given

ACCELERATION_ATTRIBUTE = "_padfree_acceleration"


@dataclass
class Acceleration:
    """A trainer made padding-free: the assembly (model, collator, …) and the trainer patch. ``undo()`` reverts."""

    trainer: Any
    assembly: Assembly
    trainer_patch: Any
    trainer_plugin: str = ""
    active: bool = True

    def undo(self) -> None:
        """Restore the trainer (collator, compute_loss, prediction_step, columns) and the model. Safe twice."""
        if not self.active:
            return
        self.trainer_patch.undo()
        self.assembly.undo()
        if getattr(self.trainer, ACCELERATION_ATTRIBUTE, None) is self:
            delattr(self.trainer, ACCELERATION_ATTRIBUTE)
        self.active = False

    def describe(self) -> dict[str, Any]:
        wrapper = type(self.trainer_patch).__name__
        reported = getattr(self.trainer_patch, "describe", None)  # what it did so far (fused calls run padded …)
        return {"trainer": type(self.trainer).__name__,
                "wrapper": f"{wrapper} (plugin {self.trainer_plugin})" if self.trainer_plugin else wrapper,
                **self.assembly.describe(), **(reported() if callable(reported) else {})}


def refuse_unplanned_pixels(trainer: Any, trainer_patch: Any, config: PadfreeConfig) -> None:
    """``batching.max_pixels_per_batch`` where the trainer's plugin does not plan pixels: a ConfigError, the trainer
    patch undone (a budget that is not kept is never ignored)."""
    if config.batching.max_pixels_per_batch is None or getattr(trainer_patch, "budgets_pixels", False):
        return
    trainer_patch.undo()
    raise ConfigError(f"batching.max_pixels_per_batch is set, but {type(trainer).__name__}'s plugin plans token "
                      "budgets without pixels: a pixel budget is planned for image-text examples (HF Trainer and "
                      "SFTTrainer on a vision-language model, DPOTrainer on a vision dataset). Remove "
                      "max_pixels_per_batch")


def accelerate(trainer: Any, config: PadfreeConfig | dict | str | None = None, *,
               host: PluginHost | None = None) -> Acceleration:
    """Make ``trainer`` (HF ``Trainer``, TRL ``SFTTrainer`` / ``RewardTrainer``, any other ``Trainer`` subclass
    through ``unpad``, or any a plugin knows) train padding-free.

    The trainer is changed in place; the returned :class:`Acceleration` undoes it. Bad datasets (examples too long
    for the model, labels not aligned with input_ids), unsupported architectures and unusable attention backends
    are errors here, before training starts.
    """
    config = load_config(config)
    previous = getattr(trainer, ACCELERATION_ATTRIBUTE, None)
    if previous is not None and previous.active:
        raise PadfreeError(f"{type(trainer).__name__} is already padding-free; call .undo() on the first acceleration "
                           "before accelerating it again")
    check_model_given(trainer)
    host = host or PluginHost(block=config.plugins.block)
    config = host.call_first("trainer_config", trainer=trainer, config=config) or config
    assembly = assemble(trainer.model, config, host=host)
    try:
        trainer_patch = host.call_first("wrap_trainer", trainer=trainer, assembly=assembly, config=config)
        if trainer_patch is None:
            raise PluginError(
                f"no plugin knows how to make {type(trainer).__name__} padding-free. The builtin plugins take "
                "transformers.Trainer, trl.SFTTrainer and trl.RewardTrainer (and subclasses that keep their "
                "compute_loss and prediction_step), and any other transformers.Trainer subclass through its padded "
                "batches, unpadded inside the model (plugin any_trainer, unless blocked); for another trainer "
                "install a plugin implementing wrap_trainer (docs/writing-a-plugin.md), or use "
                "padfree_plugins.assemble() and feed its collator and forward yourself."
            )
        refuse_unplanned_pixels(trainer, trainer_patch, config)
    except BaseException:
        assembly.undo()
        raise
    acceleration = Acceleration(trainer, assembly, trainer_patch, host.answered.get("wrap_trainer", ""))
    setattr(trainer, ACCELERATION_ATTRIBUTE, acceleration)
    return acceleration
