"""SmolLM3: a Llama-shaped GQA decoder with NoPE layers (``no_rope_layers``: every fourth layer has no rotary
embedding) and, with ``use_sliding_window``, a sliding window on those NoPE layers (``layer_types``)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("smollm3", model_types=("smollm3",), kind="decoder", features=window_features,
                         default_pooling="last", description="Hugging Face SmolLM3 decoders (NoPE layers)")]
