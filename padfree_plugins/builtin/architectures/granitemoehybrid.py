"""Granite 4.0-H (IBM, ``granitemoehybrid``): Mamba2 layers beside attention layers (NoPE or RoPE) and a MoE with a
shared MLP. Each Mamba2 mixer (a causal conv1d, then the chunked selective scan) restarts at every example of a packed
row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA2_KERNELS, Hybrid

GRANITEMOEHYBRID = Hybrid(
    Architecture("granitemoehybrid", model_types=("granitemoehybrid",), kind="decoder", default_pooling="last",
                 description="Granite 4.0-H: Mamba2 beside attention, MoE"),
    mixers=("GraniteMoeHybridMambaLayer",), kernels=MAMBA2_KERNELS, chunk="chunk_size")

register_architectures, patch_model = GRANITEMOEHYBRID.hooks()
