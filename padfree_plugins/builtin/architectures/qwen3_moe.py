"""Qwen3-MoE: Qwen3 attention with a token-wise mixture of experts."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("qwen3_moe", model_types=("qwen3_moe",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen3-MoE decoders (30B-A3B, 235B-A22B)")]
