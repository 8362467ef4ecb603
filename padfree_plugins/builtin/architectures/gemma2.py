"""Gemma 2: attention-logit soft-capping on every layer and a sliding window on every other layer.

Soft-capping is applied by the attention backend (``softcap``), so ``attention: auto`` only picks backends that
implement it (``exact``, ``flash_attn``; not ``varlen``). The final-logit soft-capping is on the LM head and
needs nothing from packing.
"""

from padfree_plugins.builtin.architectures._features import softcap_features, window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def gemma2_features(model_config) -> frozenset[str]:
    return window_features(model_config) | softcap_features(model_config)


@hookimpl
def register_architectures():
    return [Architecture("gemma2", model_types=("gemma2",), kind="decoder", features=gemma2_features,
                         default_pooling="last", description="Gemma 2 decoders (soft-capping, sliding window)")]
