"""Jamba (AI21): Mamba1 layers beside attention layers without positional encoding, and MoE layers. The Mamba
mixer gets no boundaries from its layer, so it reads the packed row from the forward, and every packed call runs
it per example (``exact``; mamba-ssm's Mamba1 kernels take no boundaries);
:mod:`~padfree_plugins.modeling.hybrids`."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import Hybrid

JAMBA = Hybrid(
    Architecture("jamba", model_types=("jamba",), kind="decoder", default_pooling="last",
                 description="Jamba: Mamba1 beside attention, MoE"),
    mixers=("JambaMambaMixer",))

register_architectures, patch_model = JAMBA.hooks()
