"""Mistral: a Llama-shaped decoder with an optional sliding window (``config.sliding_window``)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("mistral", model_types=("mistral",), kind="decoder", default_pooling="last",
                         description="Mistral 7B and Mistral-shaped decoders; sliding window honoured")]
