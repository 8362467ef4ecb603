"""The ``padfree:`` key in axolotl's config schema (``BasePlugin.get_input_args``): checked when axolotl validates
its config, before any dataset or model is loaded. Needs only pydantic."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

from .config import KEY, acceleration_config


class PadfreeArgs(BaseModel):
    """``padfree:``: the acceleration config (a mapping of its keys) or the path of its YAML file."""

    padfree: dict[str, Any] | str | None = None

    @model_validator(mode="before")
    @classmethod
    def check_padfree(cls, data: Any) -> Any:
        """The acceleration config loads, and axolotl's own packing is not set beside it (a ``ConfigError``, which
        pydantic reports as the config's validation error)."""
        if isinstance(data, dict) and data.get(KEY) is not None:
            try:
                acceleration_config(data)
            except ValueError as exc:  # ConfigError is a ValueError: pydantic shows it with the message
                raise ValueError(str(exc)) from None
        return data
