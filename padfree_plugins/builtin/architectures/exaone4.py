"""EXAONE 4.0: per-head q/k RMSNorm and hybrid attention — sliding-window layers with rotary embeddings
interleaved with global layers without them (NoPE), ``layer_types`` built from ``sliding_window_pattern``."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("exaone4", model_types=("exaone4",), kind="decoder", features=window_features,
                         default_pooling="last", description="LG AI EXAONE 4.0 decoders (sliding window, global NoPE)")]
