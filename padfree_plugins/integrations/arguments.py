"""``--acceleration_config padfree.yaml`` for any Hugging Face training script, in two lines.

::

    parser = HfArgumentParser((ScriptArguments, TrainingArguments, AccelerationArguments))   # 1. add the dataclass
    script_args, training_args, acceleration_args = parser.parse_args_into_dataclasses()
    trainer = Trainer(model=model, args=training_args, ...)                                  # (or SFTTrainer)
    acceleration_args.accelerate(trainer)                                                    # 2. no-op without the flag

The config is read and validated when the arguments are parsed, so a bad file fails before any model loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from padfree_plugins.config.schema import PadfreeConfig, load_config
from padfree_plugins.errors import ConfigError


def read_acceleration_config(value: str | Mapping[str, Any]) -> PadfreeConfig:
    """A config from a YAML path, from inline JSON (``'{"attention": "exact"}'``) for quick experiments, or from a
    mapping (an ``acceleration_config:`` mapping in a TRL YAML config)."""
    if isinstance(value, Mapping):
        return PadfreeConfig.from_dict(dict(value), source="acceleration_config")
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--acceleration_config: not valid inline JSON: {exc}") from None
        return PadfreeConfig.from_dict(data, source="--acceleration_config")
    return load_config(value)


@dataclass
class AccelerationArguments:
    """The ``--acceleration_config`` flag (a dataclass for ``transformers.HfArgumentParser``)."""

    acceleration_config: str | None = field(
        default=None,
        metadata={"help": "Train padding-free with this padfree-plugins config (a padfree.yaml path, or inline "
                          "JSON such as '{\"attention\": \"exact\"}'). Default: ordinary padded training."},
    )

    def __post_init__(self) -> None:
        self._config = read_acceleration_config(self.acceleration_config) if self.acceleration_config else None

    @property
    def config(self) -> PadfreeConfig | None:
        """The validated config, or ``None`` when the flag was not given."""
        return self._config

    def accelerate(self, trainer: Any) -> Any:
        """``padfree_plugins.accelerate(trainer, config)`` when the flag was given; ``None`` (and nothing done)
        otherwise. Returns the :class:`~padfree_plugins.integrations.accelerate.Acceleration` (``.undo()`` reverts
        it)."""
        if self._config is None:
            return None
        from padfree_plugins.integrations.accelerate import accelerate

        return accelerate(trainer, self._config)
