"""GPT-NeoX: fused qkv, partial rotary embeddings, parallel residual (Pythia, GPT-NeoX-20B)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("gpt_neox", model_types=("gpt_neox",), kind="decoder", default_pooling="last",
                         description="GPT-NeoX and Pythia decoders")]
