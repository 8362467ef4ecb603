"""Qwen2 / Qwen2.5: a Llama-shaped decoder with q/k/v biases; a sliding window on the layers above
``max_window_layers`` when ``use_sliding_window`` is set."""

from ...hookspecs import hookimpl
from ...specs import Architecture
from ._features import window_features


@hookimpl
def register_architectures():
    return [Architecture("qwen2", model_types=("qwen2",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen2 / Qwen2.5 decoders (sliding window honoured)")]
