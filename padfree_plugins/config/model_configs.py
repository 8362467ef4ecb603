"""Model configs from local files, offline: a ``config.json`` (or a directory holding one), checked so that a
wrong path or model type is a clear :class:`~padfree_plugins.errors.ConfigError` (used by ``train``, ``check``
and the benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from padfree_plugins.errors import ConfigError, did_you_mean


def local_directory(path: str, flag: str) -> str:
    """``path`` if it is a directory; otherwise a clear error (nothing is downloaded: there may be no hub)."""
    if not Path(path).is_dir():
        raise ConfigError(f"{flag} {path!r}: no such directory (give a local directory; nothing is downloaded)")
    return path


def check_model_type(model_type: Any, where: str) -> None:
    """A :class:`ConfigError` with the closest known model type when transformers does not know ``model_type``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        hint = did_you_mean(str(model_type), CONFIG_MAPPING.keys()) or " Give a transformers model type, e.g. 'llama'."
        raise ConfigError(f"{where}: unknown model_type {model_type!r}.{hint}")


def load_model_config(source: str, flag: str = "--model_config") -> Any:
    """A transformers config from a ``config.json`` file or a directory holding one (offline)."""
    from transformers import AutoConfig

    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{flag} {source!r} does not exist (give a config.json or a directory holding one)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(data, dict) or ("model_type" not in data and not path.is_dir()):
        raise ConfigError(f"{file}: a model config needs a model_type (e.g. \"llama\")")
    if "model_type" in data:
        check_model_type(data["model_type"], str(file))
    try:
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path))
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except ValueError as error:  # a value the config class refuses
        raise ConfigError(f"{file}: {str(error).splitlines()[0]}") from error


def layer_values(model_config: Any, name: str) -> list[Any]:
    """Every layer's ``name`` in a transformers config: one value per layer for a heterogeneous config (its
    ``per_layer_config``, where reading a per-layer attribute globally raises), else the config's one value
    (``None`` when it has none). The config's text config is read for a multimodal one."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if getattr(text, "is_heterogeneous", False):
        return [getattr(layer, name, None) for layer in text.per_layer_config]
    try:
        return [getattr(text, name, None)]
    except RuntimeError:  # a per-layer attribute read globally on a config that declares per-layer values
        return [getattr(layer, name, None) for layer in text.per_layer_config]


def uses_sliding_window(model_config: Any) -> bool:
    """Whether some layer attends through a window: a ``sliding_window`` that is not switched off
    (``use_sliding_window: false``, Qwen2) and, when ``layer_types`` are given, a sliding layer among them."""
    if not any(layer_values(model_config, "sliding_window")):
        return False
    if False in layer_values(model_config, "use_sliding_window"):
        return False
    kinds = [kind for layers in layer_values(model_config, "layer_types") for kind in (layers or ())]
    return not kinds or any("sliding" in str(kind) for kind in kinds)
