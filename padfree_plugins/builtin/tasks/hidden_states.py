"""The ``hidden_states`` task plugin: pack examples and run the model; outputs stay per token (features, custom
heads). The core plugin's collator and forward serve it; it pools only when the config sets ``pooling``."""

from __future__ import annotations

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
    ]
