"""SmolLM3: a Llama-shaped GQA decoder with NoPE layers (``no_rope_layers``: every fourth layer has no rotary
embedding) and, with ``use_sliding_window``, a sliding window on those NoPE layers (``layer_types``)."""

from ...hookspecs import hookimpl
from ...specs import Architecture
from ._features import window_features


@hookimpl
def register_architectures():
    return [Architecture("smollm3", model_types=("smollm3",), kind="decoder", features=window_features,
                         default_pooling="last", description="Hugging Face SmolLM3 decoders (NoPE layers)")]
