"""OLMoE: OLMo attention with q/k RMSNorm over all heads and optional ``clip_qkv``, and a token-wise mixture of
experts; the load-balancing loss (``output_router_logits``) is computed over the packed tokens, as padded it is
over the real ones."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("olmoe", model_types=("olmoe",), kind="decoder", features=window_features,
                         default_pooling="last", description="AllenAI OLMoE decoders")]
