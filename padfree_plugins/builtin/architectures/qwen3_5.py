"""Qwen3.5 text models, dense and MoE: three gated-DeltaNet layers (a causal conv1d over q, k, v, then the gated
delta rule) for every gated-attention layer (partial rotary embeddings, an output gate, q/k RMSNorm); the MoE
models route per token with a shared expert. Each gated DeltaNet restarts at every example of a packed row
(:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import GATED_DELTA_CHUNK, GATED_DELTA_KERNELS, Hybrid

QWEN3_5 = Hybrid(
    Architecture("qwen3_5", model_types=("qwen3_5_text", "qwen3_5_moe_text"), kind="decoder", default_pooling="last",
                 description="Qwen3.5 dense and MoE text models: gated DeltaNet beside gated attention"),
    mixers=("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), kernels=GATED_DELTA_KERNELS,
    chunk=GATED_DELTA_CHUNK)

register_architectures, patch_model = QWEN3_5.hooks()
