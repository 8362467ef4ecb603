"""Builtin assembly hooks: the packing collator, model patch, poolers and reverter.

All are ``trylast`` so that any other plugin implementing the same hook is asked first.
"""

from __future__ import annotations

from ..collator import DEFAULT_TOKEN_KEYS, PackingCollator
from ..forward import ModelForward
from ..hookspecs import hookimpl
from ..patching import ModelPatch
from ..pooling import POOLERS
from ..revert import Reverter


@hookimpl(trylast=True)
def collate(task, architecture, model_config, config):
    if task.name == "causal_lm":  # labels default to input_ids; examples must fit the model's positions
        from ..causal_lm import causal_lm_collator

        return causal_lm_collator(task, architecture, model_config, config)
    token_keys = tuple(dict.fromkeys((*DEFAULT_TOKEN_KEYS, *task.token_keys)))
    return PackingCollator(
        position_start=int(architecture.position_start(model_config)),
        token_keys=token_keys,
        example_keys=task.example_keys,
        required_keys=task.required_keys,
        max_length=config.max_length,
        on_overlong=config.on_overlong,
        masked_first_keys=task.masked_first_keys,
    )


@hookimpl(trylast=True)
def patch_model(model, architecture, backend, fallback, config):
    return ModelPatch.apply(model, architecture, backend, fallback,
                            attention_dropout=config.attention_dropout == "keep")


@hookimpl(trylast=True)
def pool(task, architecture, mode, config):
    pooler = POOLERS.get(mode)
    return pooler() if pooler else None


@hookimpl(trylast=True)
def revert_output(task, architecture, config):
    return Reverter()


@hookimpl(trylast=True)
def task_forward(task, architecture, config):
    return ModelForward(task.model_keys)
