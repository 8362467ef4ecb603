"""Bamba (IBM): Mamba2 layers beside RoPE attention layers. Each Mamba2 mixer (a causal conv1d, then the chunked
selective scan) restarts at every example of a packed
row (:mod:`~padfree_plugins.builtin.architectures._hybrid`)."""

from padfree_plugins.builtin.architectures._hybrid import MAMBA2_KERNELS, Hybrid
from padfree_plugins.contract.declarations import Architecture

BAMBA = Hybrid(
    Architecture("bamba", model_types=("bamba",), kind="decoder", default_pooling="last",
                 description="Bamba: Mamba2 beside attention"),
    mixers=("BambaMixer",), kernels=MAMBA2_KERNELS)

register_architectures, patch_model = BAMBA.hooks()
