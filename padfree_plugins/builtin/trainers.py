"""Builtin ``wrap_trainer``: HF ``transformers.Trainer`` and TRL ``SFTTrainer`` (see :mod:`padfree_plugins.trainer`).

``trylast``: a plugin that knows a trainer better (e.g. a sentence-transformers integration) is asked first.
"""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    from ..trainer import TrainerPatch, trainer_kind

    if trainer_kind(trainer) is None:
        return None
    return TrainerPatch.apply(trainer, assembly)
