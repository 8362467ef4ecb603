"""Mixtral: a Mistral-shaped sparse mixture of experts (router per token, optional sliding window).

The router and the experts work token by token, so packing changes nothing for them; the load-balancing loss
(``output_router_logits``) averages over the real tokens, which in a packed row are all of them.
"""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("mixtral", model_types=("mixtral",), kind="decoder", features=window_features,
                         default_pooling="last", description="Mixtral 8x7B / 8x22B and Mixtral-shaped MoE decoders")]
