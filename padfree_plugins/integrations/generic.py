"""The fallback trainer plugin (``any_trainer``): any ``transformers.Trainer`` subclass no other plugin knows — one
with its own ``compute_loss`` or ``prediction_step`` (a weighted or label-smoothed loss of your own, TRL's trainers
beyond ``SFTTrainer`` / ``RewardTrainer``) — trains padding-free through ``unpad``
(:mod:`padfree_plugins.modeling.unpad`).

Nothing of the trainer's is replaced: its collator pads as before, its ``compute_loss`` and ``prediction_step`` run
as written, and the model, patched at assembly, packs every padded training forward inside its body and returns
the padded shape, so the trainer's own loss sees what it always saw. What this costs against a trainer plugin of
its own (:mod:`.hf_trainer`): the collator still pads (the batch's padding travels to the model) and the LM head
runs at every position; the layers, where the time goes, run on real tokens only.

One thing the model cannot see on its own: a ``compute_loss`` that takes the ``labels`` out of the batch before
calling the model (``labels = inputs.pop("labels")``, transformers' own example) and computes the loss from the
logits. A left-padded row whose first token has a label is predicted, padded, from the pad before it, which a packed
row does not hold; ``unpad`` runs such a call padded when the model's head gets the labels. Here the batch's
``labels`` are shown to ``unpad`` for the calls during ``compute_loss`` / ``prediction_step`` whose head gets none
(:meth:`~padfree_plugins.modeling.unpad.UnpadPatch.labels_for_loss`), so such a batch runs padded too, whoever
computes its loss.

Refused, while the trainer is unchanged: ``unpad: off`` (this path is ``unpad``), a model ``unpad`` does not pack
(encoders), ``batching.strategy: tokens`` (budgets are planned for packed batches, and the trainer's collator pads),
NEFTune (the trainer's hook would scale its noise by the packed row's length), and parallelism that splits rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from padfree_plugins.assembly import Assembly
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.base import library_class, own_attribute, restore_attributes
from padfree_plugins.integrations.checks import check_parallelism, refuse_own_batches_options, refuse_prefix_sharing
from padfree_plugins.integrations.hf_trainer import HFTrainerPatch
from padfree_plugins.integrations.trl_dpo import DPOTrainerPatch
from padfree_plugins.integrations.trl_grpo import GRPOTrainerPatch
from padfree_plugins.integrations.trl_kto import KTOTrainerPatch
from padfree_plugins.integrations.trl_reward import RewardTrainerPatch
from padfree_plugins.integrations.trl_rloo import RLOOTrainerPatch
from padfree_plugins.integrations.trl_sft import SFTTrainerPatch
from padfree_plugins.modeling.patching import unwrap_model
from padfree_plugins.modeling.unpad import UnpadPatch

logger = logging.getLogger("padfree_plugins")

#: The trainer patches of the builtin plugins (by plugin name), which win for the trainers they claim whatever the
#: order of asking, unless the config blocks them (``plugins: {block: [trl_dpo]}`` trains a DPOTrainer through here).
SPECIFIC_PATCHES = {"hf_trainer": HFTrainerPatch, "trl_sft": SFTTrainerPatch, "trl_reward": RewardTrainerPatch,
                    "trl_dpo": DPOTrainerPatch, "trl_grpo": GRPOTrainerPatch, "trl_rloo": RLOOTrainerPatch,
                    "trl_kto": KTOTrainerPatch}


def own_methods(trainer: Any) -> list[str]:
    """``compute_loss`` / ``prediction_step`` as the trainer's class defines them, where not transformers' own:
    ``"compute_loss (MyTrainer)"``, for the message that says why the generic path is taken."""
    owner = library_class(trainer, "transformers", "Trainer")
    said = []
    for name in ("compute_loss", "prediction_step"):
        method = getattr(type(trainer), name)
        if owner is not None and method is not getattr(owner, name):
            said.append(f"{name} ({method.__qualname__.rsplit('.', 1)[0]})")
    return said


@dataclass
class AnyTrainerPatch:
    """A ``transformers.Trainer`` subclass trained padding-free through ``unpad``: its collator, ``compute_loss``
    and ``prediction_step`` kept (run with the batch's labels shown to ``unpad``: :meth:`UnpadPatch.labels_for_loss`).
    :meth:`undo` restores them."""

    kind: ClassVar[str] = "any"

    trainer: Any
    assembly: Assembly
    saved: dict[str, Any] = field(default_factory=dict)
    active: bool = True

    @classmethod
    def claims(cls, trainer: Any, blocked: tuple[str, ...] = ()) -> bool:
        """A ``transformers.Trainer`` (subclass) that no builtin trainer plugin claims (but those ``blocked``)."""
        if library_class(trainer, "transformers", "Trainer") is None:
            return False
        return not any(patch.claims(trainer) for name, patch in SPECIFIC_PATCHES.items() if name not in blocked)

    @classmethod
    def wrap(cls, trainer: Any, assembly: Assembly) -> AnyTrainerPatch | None:
        """Installed on ``trainer``, or ``None`` when :meth:`claims` says no; refusals leave the trainer unchanged."""
        if not cls.claims(trainer, tuple(assembly.config.plugins.block)):
            return None
        name = type(trainer).__name__
        check_parallelism(trainer, assembly.config,
                          f"its own {' and '.join(own_methods(trainer)) or 'methods'} run on padded batches (plugin "
                          "any_trainer), which padfree-plugins does not split across ranks")
        if trainer.model is None or unwrap_model(trainer.model) is not assembly.model:
            raise PadfreeError("the assembly was built for another model than trainer.model")
        config = assembly.config
        refuse_prefix_sharing(trainer, config, "any_trainer")
        unpad = next((handle for handle in assembly.patch.handles if isinstance(handle, UnpadPatch)), None)
        if config.unpad == "off":
            raise ConfigError(
                f"{name} has its own {' and '.join(own_methods(trainer)) or 'methods'}, so padfree-plugins keeps its "
                "padded batches and packs them inside the model (unpad); the config says unpad: off. Set unpad: auto "
                "(or always), or write a trainer plugin for it (docs/writing-a-plugin.md)")
        if unpad is None:
            raise PadfreeError(
                f"{name} has its own {' and '.join(own_methods(trainer)) or 'methods'}, so padfree-plugins would keep "
                f"its padded batches and pack them inside the model (unpad), which it does for decoders only; "
                f"{type(assembly.model).__name__} is an {assembly.plan.architecture.kind}. Write a trainer plugin for "
                "it (docs/writing-a-plugin.md), or train it padded")
        refuse_own_batches_options(
            trainer, config, name,
            batches="its own collator (its own compute_loss), which pads every batch to its longest example",
            noise="inside an unpadded forward is the packed row of every example (far weaker noise than padded): "
                  "train without NEFTune, or with a trainer whose compute_loss is the library's")
        patch = cls(trainer, assembly)
        try:
            patch.install(unpad)
        except BaseException:
            patch.undo()
            raise
        logger.warning(
            "padfree-plugins: %s trains through the generic path (plugin any_trainer) because of its own %s: its "
            "collator pads as before and the model packs every padded training forward inside its body (unpad: %s); "
            "the loss is the trainer's own. A trainer plugin for it would save more (packed batches, the LM head on "
            "labelled tokens only): docs/writing-a-plugin.md", name, " and ".join(own_methods(trainer)) or "methods",
            config.unpad)
        return patch

    def install(self, unpad: UnpadPatch) -> None:
        trainer = self.trainer
        for name in ("compute_loss", "prediction_step"):
            self.saved[name] = own_attribute(trainer, name)
        own_loss, own_prediction = trainer.compute_loss, trainer.prediction_step

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            with unpad.labels_for_loss(inputs.get("labels") if hasattr(inputs, "get") else None):
                return own_loss(model, inputs, *args, **kwargs)

        def prediction_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            with unpad.labels_for_loss(inputs.get("labels") if hasattr(inputs, "get") else None):
                return own_prediction(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
        trainer.prediction_step = prediction_step

    def undo(self) -> None:
        """Restore ``compute_loss`` and ``prediction_step`` and remove the labels hook. Safe twice."""
        if not self.active:
            return
        restore_attributes(self.trainer, self.saved)
        self.active = False


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """Any ``transformers.Trainer`` subclass no other plugin claims (its own ``compute_loss`` or
    ``prediction_step``): its padded batches packed inside the model (``unpad``)."""
    return AnyTrainerPatch.wrap(trainer, assembly)
