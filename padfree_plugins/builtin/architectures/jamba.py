"""Jamba (AI21): Mamba1 layers beside attention layers without positional encoding, and MoE layers. The Mamba
mixer gets no boundaries from its layer, so it reads the packed row from the forward, and every packed call runs
it per example (``exact``; mamba-ssm's Mamba1 kernels take no boundaries). Prompts are not shared: its scan
takes no initial state;
:mod:`~padfree_plugins.modeling.hybrids`."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA1_NO_PROMPT_STATE, Hybrid

JAMBA = Hybrid(
    Architecture("jamba", model_types=("jamba",), kind="decoder", default_pooling="last",
                 description="Jamba: Mamba1 beside attention, MoE"),
    mixers=("JambaMambaMixer",), no_prompt_state=MAMBA1_NO_PROMPT_STATE)

register_architectures, patch_model = JAMBA.hooks()
