"""ERNIE 4.5 MoE (21B-A3B, 300B-A47B): ERNIE 4.5 attention with a token-wise mixture of experts (shared experts,
a score-correction bias in the top-k choice, MoE from ``moe_layer_start_index``); the load-balancing loss
(``output_router_logits``) is computed over the packed tokens, as padded it is over the real ones."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("ernie4_5_moe", model_types=("ernie4_5_moe",), kind="decoder", features=window_features,
                         default_pooling="last", description="Baidu ERNIE 4.5 MoE decoders")]
