"""OLMo (1, 1.7): a Llama-shaped decoder with non-parametric LayerNorm and optional q/k/v clipping (``clip_qkv``,
token-wise)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("olmo", model_types=("olmo",), kind="decoder", default_pooling="last",
                         description="AllenAI OLMo 1 / 1.7 decoders")]
