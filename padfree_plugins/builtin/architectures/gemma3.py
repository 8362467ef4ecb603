"""Gemma 3 text: sliding-window layers interleaved with global ones (5:1); optionally bidirectional
(``use_bidirectional_attention``, as in EmbeddingGemma), which the attention reads from each layer's
``is_causal``."""

from padfree_plugins.builtin.architectures._features import softcap_features, window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def gemma3_features(model_config) -> frozenset[str]:
    features = window_features(model_config) | softcap_features(model_config)
    if getattr(model_config, "use_bidirectional_attention", False):
        features |= {"bidirectional"}
    return features


@hookimpl
def register_architectures():
    return [Architecture("gemma3", model_types=("gemma3_text",), kind="decoder", features=gemma3_features,
                         default_pooling="last", description="Gemma 3 text decoders (Gemma3ForCausalLM)")]
