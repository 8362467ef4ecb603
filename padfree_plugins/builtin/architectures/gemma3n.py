"""Gemma 3n text (``gemma3n_text``, the language model of Gemma 3n E2B / E4B): sliding-window layers
interleaved with global ones (``layer_types``), the last ``num_kv_shared_layers`` layers reusing the keys and
values of the last earlier layer of their type (KV sharing), per-layer embeddings (PLE) added in every layer,
AltUp / LAuReL blocks and activation sparsity in the first MLPs — all per token, so nothing but attention
crosses tokens, and attention gets the boundaries. Scores are not soft-capped (``final_logit_softcapping`` is on
the LM head)."""

from padfree_plugins.builtin.architectures._features import softcap_features, window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def gemma3n_features(model_config) -> frozenset[str]:
    return window_features(model_config) | softcap_features(model_config)


@hookimpl
def register_architectures():
    return [Architecture("gemma3n", model_types=("gemma3n_text",), kind="decoder", features=gemma3n_features,
                         default_pooling="last",
                         description="Gemma 3n text decoders (KV sharing, per-layer embeddings, sliding window)")]
