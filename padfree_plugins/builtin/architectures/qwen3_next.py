"""Qwen3-Next: gated-DeltaNet layers (q, k, v and the gates projected together, a causal conv1d, the gated delta
rule) beside gated attention with partial rotary embeddings, and a high-sparsity MoE with a shared expert. Each
gated DeltaNet restarts at every example of a packed row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import GATED_DELTA_CHUNK, GATED_DELTA_KERNELS, Hybrid

QWEN3_NEXT = Hybrid(
    Architecture("qwen3_next", model_types=("qwen3_next",), kind="decoder", default_pooling="last",
                 description="Qwen3-Next: gated DeltaNet beside gated attention, sparse MoE"),
    mixers=("Qwen3NextGatedDeltaNet",), kernels=GATED_DELTA_KERNELS,
    chunk=GATED_DELTA_CHUNK)

register_architectures, patch_model = QWEN3_NEXT.hooks()
