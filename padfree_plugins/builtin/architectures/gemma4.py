"""Gemma 4 text (``gemma4_text``): sliding-window layers interleaved with global ones (``layer_types``), and the
global layers with their own head dim (``global_head_dim``) and key/value heads (``num_global_key_value_heads``,
``attention_k_eq_v``: values are the keys before their norm); KV sharing in the last ``num_kv_shared_layers``
layers, per-layer embeddings (PLE), and optionally a mixture-of-experts block beside the MLP
(``enable_moe_block``, routed per token; transformers computes no load-balancing loss).

Gemma 4 drops the query positions before the KV-shared layers when ``logits_to_keep`` is set (``generate``): a
packed forward with it is refused by the attention (fewer queries than keys), never computed wrong.

``use_bidirectional_attention="all"`` (every layer bidirectional) is refused: in transformers 5.23 its sliding
layers pass ``sliding_window=w`` to attention, which flash attention and every padfree backend read as
``|i - j| < w``, while the sdpa / eager mask of the same model lets them see ``|i - j| <= w``; a packed run would
train another model than the padded sdpa one (measured: outputs differ by ~1 on the tiny model). Gemma 3's
bidirectional mode (EmbeddingGemma) builds ``|i - j| < w`` and runs packed (the ``gemma3`` plugin).
``"vision"`` concerns the image tokens of the multimodal model (``gemma4``), not this text model.
"""

from padfree_plugins.builtin.architectures._features import softcap_features, window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import UnsupportedArchitectureError

GEMMA4 = "gemma4"


def gemma4_features(model_config) -> frozenset[str]:
    return window_features(model_config) | softcap_features(model_config)


@hookimpl
def register_architectures():
    return [Architecture(GEMMA4, model_types=("gemma4_text",), kind="decoder", features=gemma4_features,
                         default_pooling="last",
                         description="Gemma 4 text decoders (sliding / global layers with their own head dims, "
                                     "KV sharing, per-layer embeddings, MoE)")]


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    """Refuses ``use_bidirectional_attention="all"`` with sliding layers; otherwise leaves the patch to the core."""
    if architecture.name != GEMMA4:
        return None
    model_config = model.config.get_text_config()
    layer_types = getattr(model_config, "layer_types", None) or ()
    if getattr(model_config, "use_bidirectional_attention", None) == "all" and "sliding_attention" in layer_types:
        raise UnsupportedArchitectureError(
            "Gemma 4 with use_bidirectional_attention='all' cannot run padding-free: transformers' sdpa / eager mask "
            f"lets its sliding layers see tokens at distance <= sliding_window ({model_config.sliding_window}), "
            "while the window its layers pass to attention (as flash attention reads it) means distance < "
            "sliding_window, so a packed run would not train the model a padded one trains. Use it padded, or "
            "causal (use_bidirectional_attention=None)"
        )
    return None
