"""GLM-4 (0414): a GQA decoder with partial, interleaved rotary embeddings and extra post-attention / post-MLP
norms."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("glm4", model_types=("glm4",), kind="decoder", default_pooling="last",
                         description="THUDM / Z.ai GLM-4-0414 decoders")]
