"""Qwen3: Qwen2 with per-head RMSNorm on queries and keys (applied token by token, so packing-safe)."""

from ...hookspecs import hookimpl
from ...specs import Architecture
from ._features import window_features


@hookimpl
def register_architectures():
    return [Architecture("qwen3", model_types=("qwen3",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen3 dense decoders (and Qwen3-Embedding)")]
