"""Builtin pooling modes for every task (``pooling:`` in padfree.yaml): first / cls, last, mean, max,
weighted_mean (position-weighted, SGPT), mean_sqrt_len — with prompt exclusion (``task_options.include_prompt``).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..hookspecs import hookimpl
from ..pooling import POOLING_MODES, make_pooler
from ..specs import Architecture

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


# Plain, not trylast: asked before the core plugin's trylast default (which knows the plain modes only and no
# prompt exclusion). Returns None for modes it does not know, so a plugin's own modes still work.
@hookimpl
def pool(task, architecture, mode, config):
    if mode not in POOLING_MODES:
        return None
    return choose_pooler(architecture, mode, config.task_options.get("include_prompt", True))
