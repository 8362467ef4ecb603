"""Phi (Phi-1, Phi-1.5, Phi-2): parallel attention and MLP, partial rotary embeddings, optional q/k LayerNorm."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("phi", model_types=("phi",), kind="decoder", default_pooling="last",
                         description="Microsoft Phi-1 / 1.5 / 2 decoders")]
