"""StarCoder2: GQA decoder with biases, LayerNorm and a sliding window (4096 in the released models)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("starcoder2", model_types=("starcoder2",), kind="decoder", features=window_features,
                         default_pooling="last", description="StarCoder2 code decoders (sliding window honoured)")]
