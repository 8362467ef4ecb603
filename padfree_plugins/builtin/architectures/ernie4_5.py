"""ERNIE 4.5 dense (0.3B): a Llama-shaped GQA decoder with interleaved rotary embeddings and optional biases."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("ernie4_5", model_types=("ernie4_5",), kind="decoder", features=window_features,
                         default_pooling="last", description="Baidu ERNIE 4.5 dense decoders")]
