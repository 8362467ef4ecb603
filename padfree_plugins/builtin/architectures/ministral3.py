"""Ministral 3 (3B / 8B / 14B, the text model of Mistral 3): a Mistral decoder with Llama 4's position-dependent
query scaling (``llama_4_scaling_beta``, read from ``position_ids``, so it restarts with every packed example) and
an optional sliding window on every layer (``sliding_window``)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("ministral3", model_types=("ministral3",), kind="decoder", features=window_features,
                         default_pooling="last", description="Mistral AI Ministral 3 decoders")]
