"""OLMo 2: post-norm decoder with RMSNorm on the full query / key projections (token-wise, packing-safe)."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("olmo2", model_types=("olmo2",), kind="decoder", default_pooling="last",
                         description="AllenAI OLMo 2 decoders")]
