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
from padfree_plugins.packing.collator import DEFAULT_TOKEN_KEYS, PackingCollator
from padfree_plugins.packing.repad import Reverter


def model_token_limit(model_config, position_start: int = 0) -> int | None:
    """The longest example the model's position table takes (``None`` when the config states no limit)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(text_config, "max_position_embeddings", None)
    return int(limit) - int(position_start) if isinstance(limit, int) and limit > 0 else None


def packing_collator(task, architecture, model_config, config) -> PackingCollator:
    """The core packing collator for a task and a model: positions from the architecture, keys from the task,
    and ``max_length`` from the config or else the model's own limit (so that an over-long example is a clear
    error, not an index error deep inside the position embeddings)."""
    start = int(architecture.position_start(model_config))
    limit = model_token_limit(model_config, start)
    source = f"{type(model_config).__name__}.max_position_embeddings={limit + start}" if limit else ""
    if config.max_length is not None and limit is not None and config.max_length > limit:
        raise ConfigError(
            f"max_length: {config.max_length} is more than the model takes ({limit} tokens, {source}); "
            f"set max_length to at most {limit}"
        )
    return PackingCollator(
        position_start=start,
        token_keys=tuple(dict.fromkeys((*DEFAULT_TOKEN_KEYS, *task.token_keys))),
        example_keys=task.example_keys,
        required_keys=task.required_keys,
        max_length=config.max_length if config.max_length is not None else limit,
        on_overlong=config.on_overlong,
        masked_first_keys=task.masked_first_keys,
        limit_source="" if config.max_length is not None or limit is None else source,
        vocab_size=getattr(getattr(model_config, "get_text_config", lambda: model_config)(), "vocab_size", None),
    )


@hookimpl(trylast=True)
def collate(task, architecture, model_config, config):
    if task.name == "causal_lm":  # labels default to input_ids
        from padfree_plugins.builtin.tasks.causal_lm import causal_lm_collator

        return causal_lm_collator(task, architecture, model_config, config)
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
    if task.name == "causal_lm":
        from padfree_plugins.builtin.tasks.causal_lm import CausalLMForward

        return CausalLMForward(task.model_keys)
    return ModelForward(task.model_keys)
