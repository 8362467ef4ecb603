"""The axolotl plugin (entry-point group ``axolotl.plugins``): ``axolotl train`` padding-free when the config has a
``padfree:`` key.

axolotl loads every installed plugin of that group whatever the config says, so this one does nothing without the
key. With it, the key is checked when axolotl validates its config (:mod:`.args`), and ``post_trainer_create`` hands
the built trainer to :func:`padfree_plugins.accelerate`: ``AxolotlTrainer`` through :mod:`.trainer`, axolotl's
DPO / KTO / GRPO trainers (TRL's, subclassed) through padfree-plugins' TRL plugins where the installed TRL has
the fused LM head they pack (TRL >= 1.16, which axolotl 0.21 trains with beside its pin of 1.14.1), else, saying so,
through the generic path (``any_trainer``).
"""

from __future__ import annotations

import logging
from typing import Any

from axolotl.integrations.base import BasePlugin

from padfree_plugins import accelerate

from .config import FUSED_TRL_PLUGINS, acceleration_config, without_fused_trl_plugins

logger = logging.getLogger("padfree_plugins")


class PadfreePlugin(BasePlugin):
    """Padding-free training for axolotl, switched on by the ``padfree:`` key."""

    def get_input_args(self) -> str:
        return "padfree_axolotl.args.PadfreeArgs"

    def register(self, cfg: dict) -> None:
        """The raw config, before axolotl validates it: its own packing beside ``padfree:`` is refused here."""
        acceleration_config(cfg)

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        """``accelerate(trainer, cfg.padfree)``: nothing when the key is absent."""
        config = acceleration_config(cfg)
        if config is None:
            return
        if is_trl_trainer(trainer) and not has_fused_lm_head():
            import trl

            logger.warning("padfree-plugins: TRL %s has no fused LM head (trl.trainer.utils.add_fused_lm_head), "
                           "which the plugins %s pack: %s trains through the generic path (plugin any_trainer), its "
                           "padded batches packed inside the model and TRL's loss unchanged. For the packed path, "
                           "install TRL 1.16 beside axolotl: pip install 'trl==1.16.*' (axolotl 0.21 pins 1.14.1; "
                           "its SFT, DPO, KTO and GRPO train with 1.16)",
                           trl.__version__, ", ".join(FUSED_TRL_PLUGINS), type(trainer).__name__)
            config = without_fused_trl_plugins(config)
        acceleration = accelerate(trainer, config)
        logger.warning("padfree-plugins: %s trains padding-free (%s)", type(trainer).__name__,
                       acceleration.describe().get("wrapper"))


def is_trl_trainer(trainer: Any) -> bool:
    return any(cls.__module__.split(".")[0] == "trl" for cls in type(trainer).__mro__)


def has_fused_lm_head() -> bool:
    """Whether the installed TRL adds the fused LM head padfree-plugins' DPO / KTO / GRPO plugins pack."""
    import trl.trainer.utils

    return hasattr(trl.trainer.utils, "add_fused_lm_head")
