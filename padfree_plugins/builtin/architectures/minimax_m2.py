"""MiniMax-M2: full (softmax) attention on every layer with q/k RMSNorm over all heads together and partial
rotary embeddings, and a token-wise mixture of experts (sigmoid scores with a correction bias); the
load-balancing loss (``output_router_logits``) is computed over the packed tokens, as padded it is over the real
ones. (MiniMax-Text-01's lightning attention is another model type, not this one.)"""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("minimax_m2", model_types=("minimax_m2",), kind="decoder", features=window_features,
                         default_pooling="last", description="MiniMax-M2 MoE decoders")]
