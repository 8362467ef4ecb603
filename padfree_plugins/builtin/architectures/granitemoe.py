"""Granite MoE: Granite's multipliers with a token-wise mixture of experts; the load-balancing loss
(``output_router_logits``) is computed over the packed tokens, as padded it is over the real ones."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("granitemoe", model_types=("granitemoe",), kind="decoder", default_pooling="last",
                         description="IBM Granite 3.x MoE decoders")]
