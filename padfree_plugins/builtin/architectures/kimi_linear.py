"""Kimi-Linear (Moonshot): Kimi Delta Attention (KDA: short convolutions over q, k, v, then a delta rule with a
per-channel forget gate) beside MLA attention layers without positional encoding, and a DeepSeek-style MoE.
transformers hands KDA no boundaries on its kernel path, so every packed call runs it per example (``exact``,
:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import GATED_DELTA_CHUNK, Hybrid

KIMI_LINEAR = Hybrid(
    Architecture("kimi_linear", model_types=("kimi_linear",), kind="decoder", default_pooling="last",
                 description="Kimi-Linear: Kimi Delta Attention beside MLA, MoE"),
    mixers=("KimiLinearDeltaAttention",), chunk=GATED_DELTA_CHUNK)

register_architectures, patch_model = KIMI_LINEAR.hooks()
