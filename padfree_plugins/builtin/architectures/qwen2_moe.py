"""Qwen2-MoE: Qwen2 attention with a token-wise mixture of experts plus a shared expert."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("qwen2_moe", model_types=("qwen2_moe",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen1.5-MoE / Qwen2-MoE decoders")]
