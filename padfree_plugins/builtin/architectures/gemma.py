"""Gemma: a Llama-shaped decoder (embeddings scaled by sqrt(hidden), GeGLU); no window, no soft-capping."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("gemma", model_types=("gemma",), kind="decoder", default_pooling="last",
                         description="Gemma 2B / 7B decoders")]
