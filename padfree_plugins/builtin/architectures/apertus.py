"""Apertus (Swiss AI): a Llama-shaped GQA decoder with per-head q/k RMSNorm and an xIELU MLP (no gate)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("apertus", model_types=("apertus",), kind="decoder", features=window_features,
                         default_pooling="last", description="Swiss AI Apertus decoders")]
