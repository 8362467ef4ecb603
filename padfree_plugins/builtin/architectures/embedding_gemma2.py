"""EmbeddingGemma 2 (``embedding_gemma2`` and its text backbone ``embedding_gemma2_text``): a Gemma-shaped encoder.

Every layer is bidirectional (``is_causal = False``); sliding layers attend within an inclusive radius
``config.sliding_window`` (they pass ``sliding_window + 1`` to attention, and the backends' bidirectional window
is ``distance < window``), global layers everywhere; RoPE positions restart at 0 for every example. Global layers
have their own head size and number of key / value heads (``per_layer_config``: 1 key / value head by default,
GQA), and the per-layer embeddings (PLE) are projected from each token's input embedding alone, so nothing but
attention crosses tokens. The final ``embedding_projection`` is applied per token inside the model (the hidden
states are ``embedding_dim`` wide). There is no sequence-classification head: ``embedding`` and ``hidden_states``.

The composite ``EmbeddingGemma2Model`` runs packed on text; its image / audio placeholders are not packed (the
collators never pass ``pixel_values`` / ``input_features``).

EmbeddingGemma (v1) is ``gemma3_text`` with ``use_bidirectional_attention``: the ``gemma3`` plugin.

**Per-layer attributes.** ``num_key_value_heads`` and ``head_dim`` of the text config are per layer (reading them
on the config raises ``AmbiguousGlobalPerLayerAttributeError``): the features declared here are read per layer.
"""

from __future__ import annotations

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def per_layer_values(text_config, name: str) -> set:
    """``name`` of every layer (``per_layer_config``), or the global value of a homogeneous config."""
    layers = getattr(text_config, "per_layer_config", None)
    if layers is None:
        return {getattr(text_config, name, None)}
    return {getattr(layers[i], name, None) for i in range(text_config.num_hidden_layers)}


def embedding_gemma2_features(model_config) -> frozenset[str]:
    """Sliding windows and GQA, read per layer."""
    text = model_config.get_text_config()
    features = set(window_features(text))
    heads = text.num_attention_heads
    if any(kv and kv < heads for kv in per_layer_values(text, "num_key_value_heads")):
        features.add("gqa")
    return frozenset(features)


EMBEDDING_GEMMA2 = Architecture(
    "embedding_gemma2", model_types=("embedding_gemma2", "embedding_gemma2_text"), kind="encoder",
    features=embedding_gemma2_features, default_pooling="mean",
    description="EmbeddingGemma 2 encoders (bidirectional, sliding and global layers, per-layer GQA); text only")


@hookimpl
def register_architectures():
    return [EMBEDDING_GEMMA2]
