"""OLMo-hybrid (Ai2): gated-DeltaNet layers beside OLMo attention layers. Each gated DeltaNet restarts at every
example of a packed row (:mod:`~padfree_plugins.modeling.hybrids`)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.modeling.hybrids import GATED_DELTA_CHUNK, GATED_DELTA_KERNELS, Hybrid

OLMO_HYBRID = Hybrid(
    Architecture("olmo_hybrid", model_types=("olmo_hybrid",), kind="decoder", default_pooling="last",
                 description="OLMo-hybrid: gated DeltaNet beside attention"),
    mixers=("OlmoHybridGatedDeltaNet",), kernels=GATED_DELTA_KERNELS,
    chunk=GATED_DELTA_CHUNK)

register_architectures, patch_model = OLMO_HYBRID.hooks()
