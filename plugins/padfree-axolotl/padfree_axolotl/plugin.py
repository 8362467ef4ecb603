"""The axolotl plugin (entry-point group ``axolotl.plugins``): ``axolotl train`` padding-free when the config has a
``padfree:`` key.

axolotl loads every installed plugin of that group whatever the config says, so this one does nothing without the
key. With it, the key is checked when axolotl validates its config (:mod:`.args`), and ``post_trainer_create`` hands
the built trainer to :func:`padfree_plugins.accelerate`: ``AxolotlTrainer`` through :mod:`.trainer`, axolotl's
DPO / KTO / GRPO trainers (TRL's, subclassed) through padfree-plugins' TRL plugins.
"""

from __future__ import annotations

import logging
from typing import Any

from axolotl.integrations.base import BasePlugin

from padfree_plugins import accelerate

from .config import acceleration_config

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
        acceleration = accelerate(trainer, config)
        logger.warning("padfree-plugins: %s trains padding-free (%s)", type(trainer).__name__,
                       acceleration.describe().get("wrapper"))
