"""OLMo 2: post-norm decoder with RMSNorm on the full query / key projections (token-wise, packing-safe)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("olmo2", model_types=("olmo2",), kind="decoder", default_pooling="last",
                         description="AllenAI OLMo 2 decoders")]
