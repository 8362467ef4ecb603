"""Mamba2: attention-free, every layer a Mamba2 mixer. Each Mamba2 mixer (a causal conv1d, then the chunked selective
scan) restarts at every example of a packed
row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA2_KERNELS, Hybrid

MAMBA2 = Hybrid(
    Architecture("mamba2", model_types=("mamba2",), kind="decoder", default_pooling="last",
                 description="Mamba2 (attention-free)"),
    mixers=("Mamba2Mixer",), kernels=MAMBA2_KERNELS, chunk="chunk_size", has_attention=False)

register_architectures, patch_model = MAMBA2.hooks()
