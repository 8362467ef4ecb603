"""Llama: the decoder pattern (causal, RoPE, GQA). Positions start at 0."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("llama", model_types=("llama",), kind="decoder", default_pooling="last",
                         description="Llama 2/3 and Llama-shaped models (TinyLlama, SmolLM, …)")]
