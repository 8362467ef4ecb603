"""Qwen3: Qwen2 with per-head RMSNorm on queries and keys (applied token by token, so packing-safe)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("qwen3", model_types=("qwen3",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen3 dense decoders (and Qwen3-Embedding)")]
