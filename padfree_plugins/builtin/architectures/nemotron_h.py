"""Nemotron-H (NVIDIA): Mamba2 layers beside attention layers without positional encoding and MLP or MoE layers. Each
Mamba2 mixer (a causal conv1d, then the chunked selective scan) restarts at every example of a packed
row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA2_KERNELS, Hybrid

NEMOTRON_H = Hybrid(
    Architecture("nemotron_h", model_types=("nemotron_h",), kind="decoder", default_pooling="last",
                 description="Nemotron-H: Mamba2, attention (NoPE), MLP / MoE"),
    mixers=("NemotronHMamba2Mixer",), kernels=MAMBA2_KERNELS, chunk="chunk_size")

register_architectures, patch_model = NEMOTRON_H.hooks()
