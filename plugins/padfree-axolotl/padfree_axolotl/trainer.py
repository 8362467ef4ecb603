"""The padfree-plugins trainer plugin for axolotl's ``AxolotlTrainer`` (SFT and pretraining; entry point
``axolotl_trainer`` of the ``padfree_plugins`` group).

``AxolotlTrainer`` overrides ``compute_loss`` and ``prediction_step``, so padfree-plugins' HF ``Trainer`` plugin does
not claim it and it would train through the generic path (padded batches unpadded inside the model). What the
overrides add to ``transformers.Trainer`` is known: the tokens-per-second counters (``include_tkps``), ORPO's loss,
Gemma 4's ``mm_token_type_ids``, and a DeepSpeed sequence-parallel scaling. This plugin keeps the counters (counted
on the packed batch, so its "total" holds no padding), refuses the rest, and otherwise trains as the HF ``Trainer``
plugin does: packed batches, the LM head on labelled tokens only, the model's loss. axolotl evaluates with a
collator of its own (``eval_data_collator``), which is replaced by the packing collator too and restored by
``undo()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from padfree_plugins import hookimpl
from padfree_plugins.errors import ConfigError
from padfree_plugins.integrations.base import keeps_methods, library_class
from padfree_plugins.integrations.checks import check_collator
from padfree_plugins.integrations.hf_trainer import HFTrainerPatch
from padfree_plugins.modeling.patching import own_attribute

#: AxolotlTrainer options whose batches padfree-plugins cannot train packed, and what to do instead.
REFUSED = {
    "orpo_alpha": "ORPO concatenates chosen and rejected rows and computes its own loss from padded logits: use "
                  "axolotl's rl: orpo trainer, or remove padfree:",
    "sample_packing": "axolotl packs rows itself (multipack): remove sample_packing, padfree packs every batch",
    "batch_flattening": "axolotl flattens batches itself: remove batch_flattening, padfree packs every batch",
}


def only_pads(collator: Any) -> bool:
    """axolotl's ``DataCollatorForSeq2Seq`` as axolotl builds it without sample packing: it pads ``input_ids``,
    ``labels`` (-100) and ``position_ids`` and builds nothing else (no context-parallel shard, no decoder inputs),
    so the packing collator replaces it."""
    kind = type(collator)
    return (kind.__name__ == "DataCollatorForSeq2Seq" and kind.__module__ == "axolotl.utils.collators.batching"
            and getattr(collator, "cp_shard", None) is None
            and not hasattr(getattr(collator, "model", None), "prepare_decoder_input_ids_from_labels"))


class AxolotlTrainerPatch(HFTrainerPatch):
    """axolotl's ``AxolotlTrainer`` trained padding-free: the HF ``Trainer`` plugin, with axolotl's eval collator
    and its token counters."""

    kind = "axolotl"
    sequence_parallel = False

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        """``AxolotlTrainer``, or a subclass that keeps its ``compute_loss`` and ``prediction_step``."""
        return keeps_methods(trainer, library_class(trainer, "axolotl", "AxolotlTrainer"))

    @classmethod
    def runs_trainer_collator(cls, trainer: Any) -> bool:
        """Not that: axolotl's padding collator is replaced, so the generic refusal of a collator padfree-plugins
        does not know is skipped for it (:func:`only_pads`); any other collator is refused as usual."""
        return only_pads(trainer.data_collator)

    def check(self) -> None:
        args, name = self.trainer.args, type(self.trainer).__name__
        evaluation = getattr(self.trainer, "eval_data_collator", None)
        if evaluation is not None and not only_pads(evaluation):
            check_collator(evaluation)  # replaced by the packing collator too
        for option, why in REFUSED.items():
            if getattr(args, option, None):
                raise ConfigError(f"{name} with {option}: {why}")
        if getattr(self.trainer, "_inject_mm_token_type_ids", False):
            raise ConfigError(f"{name} adds Gemma 4's mm_token_type_ids to every padded batch, which a packed batch "
                              "does not carry: train this model without padfree:")
        super().check()

    def install(self, collator: Any) -> None:
        self.saved["eval_data_collator"] = own_attribute(self.trainer, "eval_data_collator")
        super().install(collator)
        self.trainer.eval_data_collator = collator

    def compute_loss(self, model: Any, inputs: Mapping, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """axolotl's token counters (``include_tkps``), then the HF ``Trainer`` plugin's loss of the packed batch."""
        if getattr(self.trainer.args, "include_tkps", False) and model.training:
            self.trainer._accumulate_token_counts(inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@hookimpl
def wrap_trainer(trainer, assembly, config):
    """axolotl's ``AxolotlTrainer`` (and subclasses that keep its loss); any other trainer: ``None``."""
    return AxolotlTrainerPatch.wrap(trainer, assembly)
