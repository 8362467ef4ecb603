"""Granite: a Llama-shaped decoder with multipliers (embedding, residual, attention scale, logits); the
attention multiplier arrives as ``scaling``."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("granite", model_types=("granite",), kind="decoder", default_pooling="last",
                         description="IBM Granite 3.x dense decoders")]
