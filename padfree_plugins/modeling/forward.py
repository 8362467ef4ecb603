"""How a patched model is called on a packed batch (the default ``task_forward``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from padfree_plugins.packing.batch import MODEL_INPUT_KEYS, mark_dynamic_lengths


@dataclass(frozen=True)
class ModelForward:
    """Call ``model`` with the packing keys plus ``model_keys`` that the batch has (e.g. ``labels``)."""

    model_keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, task: Any, architecture: Any) -> "ModelForward":
        """The forward for ``task`` on ``architecture``: the task's model keys and the architecture's model inputs
        (``Architecture.token_keys`` / ``example_keys``, e.g. X-MOD's ``lang_ids``)."""
        media = getattr(getattr(architecture, "wrap_collator", None), "model_keys", ())
        keys = (*task.model_keys, *getattr(architecture, "token_keys", ()), *getattr(architecture, "example_keys", ()),
                *media)
        return cls(tuple(dict.fromkeys(keys)))

    def inputs(self, batch: Mapping) -> dict[str, Any]:
        return mark_dynamic_lengths({key: batch[key] for key in (*MODEL_INPUT_KEYS, *self.model_keys) if key in batch})

    def __call__(self, model: Any, batch: Mapping, **loss_kwargs: Any) -> Any:
        return model(**self.inputs(batch), **loss_kwargs)
