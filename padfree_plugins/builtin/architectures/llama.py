"""Llama: the decoder pattern (causal, RoPE, GQA). Positions start at 0."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("llama", model_types=("llama",), kind="decoder", default_pooling="last",
                         description="Llama 2/3 and Llama-shaped models (TinyLlama, SmolLM, …)")]
