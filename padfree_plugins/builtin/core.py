"""Builtin assembly hooks: the packing collator, model patch, poolers and reverter.

All are ``trylast`` so that any other plugin implementing the same hook is asked first.
"""

from __future__ import annotations

from typing import Any

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError
from padfree_plugins.modeling.forward import ModelForward
from padfree_plugins.modeling.patching import ModelPatch
from padfree_plugins.modeling.pooling import POOLING_MODES, make_pooler
from padfree_plugins.packing.collator import packing_collator
from padfree_plugins.packing.repad import Reverter


@hookimpl(trylast=True)
def collate(task, architecture, model_config, config):
    return packing_collator(task, architecture, model_config, config)


@hookimpl(trylast=True)
def patch_model(model, architecture, backend, fallback, config):
    return ModelPatch.apply(model, architecture, backend, fallback,
                            attention_dropout=config.attention_dropout == "keep")


@hookimpl(trylast=True)
def pool(task, architecture, mode, config):
    """Every builtin mode (``pooling.POOLING_MODES``), with prompt exclusion (``task_options.include_prompt``)."""
    if mode not in POOLING_MODES:
        return None
    return choose_pooler(architecture, mode, config.task_options.get("include_prompt", True))


FIRST_TOKEN_MODES = ("first", "cls")


def choose_pooler(architecture: Architecture, mode: str, include_prompt: bool = True) -> Any:
    """The pooler for ``mode`` on ``architecture``; a :class:`ConfigError` for a mode the model cannot do."""
    if architecture.kind == "decoder" and mode in FIRST_TOKEN_MODES:
        raise ConfigError(
            f"pooling {mode!r} cannot work with {architecture.name}: in a causal decoder the first token attends "
            "to nothing but itself, so it carries no information about the text. Use last (the usual choice for "
            "decoder embedders), mean or weighted_mean"
        )
    if not isinstance(include_prompt, bool):
        raise ConfigError(f"task_options: include_prompt must be true or false, got {include_prompt!r}")
    return make_pooler(mode, include_prompt=include_prompt)


@hookimpl(trylast=True)
def revert_output(task, architecture, config):
    return Reverter()


@hookimpl(trylast=True)
def task_forward(task, architecture, config):
    return ModelForward.of(task, architecture)
