"""Qwen2 / Qwen2.5: a Llama-shaped decoder with q/k/v biases; a sliding window on the layers above
``max_window_layers`` when ``use_sliding_window`` is set."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("qwen2", model_types=("qwen2",), kind="decoder", features=window_features,
                         default_pooling="last", description="Qwen2 / Qwen2.5 decoders (sliding window honoured)")]
