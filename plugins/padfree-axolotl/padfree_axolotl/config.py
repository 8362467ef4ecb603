"""The ``padfree:`` key of an axolotl config: read, checked, refused beside axolotl's own packing. No axolotl import.

``cfg`` is axolotl's config: a mapping (axolotl's ``DictDefault``, or the raw dict before validation).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from padfree_plugins.config.schema import PadfreeConfig, load_config
from padfree_plugins.errors import ConfigError

KEY = "padfree"

#: padfree-plugins' TRL plugins that pack TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``), which the
#: TRL that axolotl 0.21 pins (1.14.1) does not have; TRL 1.16, installed beside it, has.
FUSED_TRL_PLUGINS = ("trl_dpo", "trl_kto", "trl_grpo", "trl_rloo")

#: axolotl options that pack or flatten batches themselves, and why they cannot be combined with ``padfree:``.
OWN_PACKING = {
    "sample_packing": "axolotl's sample_packing packs several examples into each row with its own multipack sampler "
                      "and collator",
    "batch_flattening": "axolotl's batch_flattening flattens each batch into one row with its own collator",
}


def refuse_own_packing(cfg: Mapping[str, Any]) -> None:
    """A :class:`ConfigError` when ``padfree:`` is set beside ``sample_packing`` or ``batch_flattening``."""
    if cfg.get(KEY) is None:
        return
    for option, what in OWN_PACKING.items():
        if cfg.get(option):
            raise ConfigError(
                f"{option}: true and padfree: are both set. {what}, and padfree-plugins packs every batch itself "
                f"(its collator, its forward, its loss): the two cannot both pack a batch. Remove {option} (padfree "
                f"trains the same losses as padded, without padding) or remove padfree:")


def acceleration_config(cfg: Mapping[str, Any]) -> PadfreeConfig | None:
    """The acceleration config under ``padfree:`` (a mapping, or the path of a YAML file), or ``None`` when the key
    is absent (the plugin then does nothing). Bad values and axolotl's own packing are :class:`ConfigError`."""
    value = cfg.get(KEY)
    if value is None:
        return None
    refuse_own_packing(cfg)
    if isinstance(value, bool) or not isinstance(value, (Mapping, str, Path)):
        raise ConfigError(f"padfree: holds the acceleration config (a mapping of its keys, e.g. "
                          f"'padfree: {{attention: exact}}', or the path of its YAML file), not "
                          f"{type(value).__name__} {value!r}")
    try:
        return load_config(dict(value) if isinstance(value, Mapping) else value)
    except ConfigError as exc:
        raise ConfigError(f"padfree: {exc}") from None


def without_fused_trl_plugins(config: PadfreeConfig) -> PadfreeConfig:
    """A copy of ``config`` with :data:`FUSED_TRL_PLUGINS` blocked: TRL's DPO / KTO / GRPO trainers then train
    through the generic path (``any_trainer``: their padded batches packed inside the model, TRL's loss as it is)."""
    config = copy.deepcopy(config)
    config.plugins.block = [*config.plugins.block, *(name for name in FUSED_TRL_PLUGINS
                                                     if name not in config.plugins.block)]
    return config
