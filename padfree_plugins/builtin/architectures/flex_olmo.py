"""FlexOlmo: OLMo 2's post-norm decoder with q/k RMSNorm over all heads and a token-wise mixture of experts
(independently trained expert modules); the load-balancing loss (``output_router_logits``) is computed over the
packed tokens, as padded it is over the real ones."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("flex_olmo", model_types=("flex_olmo",), kind="decoder", features=window_features,
                         default_pooling="last", description="AllenAI FlexOlmo MoE decoders")]
