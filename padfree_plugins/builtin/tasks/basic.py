"""Builtin tasks."""

from __future__ import annotations

from padfree_plugins.builtin.tasks.causal_lm import OPTIONS as CAUSAL_LM_OPTIONS
from padfree_plugins.contract.declarations import Task
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_tasks():
    return [
        Task(
            "hidden_states",
            pools=True,
            options={},
            description="pack examples and run the model; outputs stay per token (features, custom heads)",
        ),
        Task(
            "causal_lm",
            token_keys=("labels",),
            masked_first_keys=("labels",),
            model_keys=("labels", "token_type_ids", "logits_to_keep", "shift_labels"),
            options=CAUSAL_LM_OPTIONS,
            description="causal language modelling / SFT: labels travel per token, each example's first label "
            "is ignored so no example learns from the one before it",
        ),
    ]
