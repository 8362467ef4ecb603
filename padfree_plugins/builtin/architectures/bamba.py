"""Bamba (IBM): Mamba2 layers beside RoPE attention layers. Each Mamba2 mixer (a causal conv1d, then the chunked
selective scan) restarts at every example of a packed
row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA2_KERNELS, Hybrid

BAMBA = Hybrid(
    Architecture("bamba", model_types=("bamba",), kind="decoder", default_pooling="last",
                 description="Bamba: Mamba2 beside attention"),
    mixers=("BambaMixer",), kernels=MAMBA2_KERNELS, chunk="chunk_size")

register_architectures, patch_model = BAMBA.hooks()
