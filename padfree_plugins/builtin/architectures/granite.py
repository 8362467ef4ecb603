"""Granite: a Llama-shaped decoder with multipliers (embedding, residual, attention scale, logits); the
attention multiplier arrives as ``scaling``."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("granite", model_types=("granite",), kind="decoder", default_pooling="last",
                         description="IBM Granite 3.x dense decoders")]
