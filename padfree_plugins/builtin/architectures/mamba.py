"""Mamba and FalconMamba: attention-free, every layer a Mamba1 mixer (a causal conv1d, then the selective scan).
The mixers get no boundaries from their layers, so they read the packed row from the forward, and every packed
call runs them per example (``exact``; mamba-ssm's Mamba1 kernels take no boundaries). Prompts are not shared:
their scan takes no initial state;
:mod:`~padfree_plugins.modeling.hybrids`."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import MAMBA1_NO_PROMPT_STATE, Hybrid

MAMBA = Hybrid(
    Architecture("mamba", model_types=("mamba", "falcon_mamba"), kind="decoder", default_pooling="last",
                 description="Mamba / FalconMamba (attention-free Mamba1)"),
    mixers=("MambaMixer", "FalconMambaMixer"), has_attention=False, no_prompt_state=MAMBA1_NO_PROMPT_STATE)

register_architectures, patch_model = MAMBA.hooks()
