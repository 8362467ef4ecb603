"""Builtin ``wrap_trainer``: HF ``transformers.Trainer`` and TRL ``SFTTrainer`` / ``RewardTrainer`` (see
:mod:`padfree_plugins.integrations.accelerate`), and the task a ``RewardTrainer`` implies (``seq_cls``: it trains a classifier).

``trylast``: a plugin that knows a trainer better (e.g. a sentence-transformers integration) is asked first.
"""

from __future__ import annotations

import dataclasses

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError


@hookimpl(trylast=True)
def trainer_config(trainer, config):
    from padfree_plugins.integrations.accelerate import trainer_kind

    if trainer_kind(trainer) != "reward" or config.task == "seq_cls":
        return None
    if config.task != "causal_lm":  # the default: a config that never named a task
        raise ConfigError(f"task: {config.task} in the config, but a RewardTrainer trains a sequence classifier: "
                          "set task: seq_cls, or leave task out")
    return dataclasses.replace(config, task="seq_cls")


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    from padfree_plugins.integrations.accelerate import TrainerPatch, trainer_kind

    if trainer_kind(trainer) is None:
        return None
    return TrainerPatch.apply(trainer, assembly)
