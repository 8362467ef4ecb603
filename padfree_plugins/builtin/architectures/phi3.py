"""Phi-3 / Phi-3.5 / Phi-4: fused qkv projection, partial RoPE variants, optional sliding window."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("phi3", model_types=("phi3",), kind="decoder", features=window_features,
                         default_pooling="last", description="Phi-3, Phi-3.5-mini and Phi-4 decoders")]
