"""Falcon-H1 (TII): every layer runs attention and a Mamba2 mixer in parallel, with µP multipliers. Each Mamba2 mixer
(a causal conv1d, then the chunked selective scan) restarts at every example of a packed
row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA2_KERNELS, Hybrid

FALCON_H1 = Hybrid(
    Architecture("falcon_h1", model_types=("falcon_h1",), kind="decoder", default_pooling="last",
                 description="Falcon-H1: parallel attention and Mamba2"),
    mixers=("FalconH1Mixer",), kernels=MAMBA2_KERNELS, chunk="chunk_size")

register_architectures, patch_model = FALCON_H1.hooks()
