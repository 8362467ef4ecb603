"""Qwen3-MoE: Qwen3 attention with a token-wise mixture of experts."""

from ...hookspecs import hookimpl
from ...specs import Architecture
from ._features import window_features


@hookimpl
def register_architectures():
    return [Architecture("qwen3_moe", model_types=("qwen3_moe",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen3-MoE decoders (30B-A3B, 235B-A22B)")]
