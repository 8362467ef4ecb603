"""StarCoder2: GQA decoder with biases, LayerNorm and a sliding window (4096 in the released models)."""

from ...hookspecs import hookimpl
from ...specs import Architecture
from ._features import window_features


@hookimpl
def register_architectures():
    return [Architecture("starcoder2", model_types=("starcoder2",), kind="decoder", features=window_features,
                         default_pooling="last", description="StarCoder2 code decoders (sliding window honoured)")]
