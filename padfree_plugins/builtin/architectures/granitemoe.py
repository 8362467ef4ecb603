"""Granite MoE: Granite's multipliers with a token-wise mixture of experts; the load-balancing loss
(``output_router_logits``) is computed over the packed tokens, as padded it is over the real ones."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("granitemoe", model_types=("granitemoe",), kind="decoder", default_pooling="last",
                         description="IBM Granite 3.x MoE decoders")]
