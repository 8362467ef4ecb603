"""gpt-oss (20B, 120B): attention sinks (a learned logit per head in every softmax), sliding-window layers
alternating with full ones, YaRN rope, a mixture of experts.

The sinks reach attention as ``s_aux``; the ``exact`` and ``repad`` backends implement them (declared feature
``sinks``), so ``attention: auto`` picks one of those and an explicit ``varlen`` / ``flash_attn`` is refused with
the reason. YaRN works on the positions, which restart at every example: nothing to do for packing.
"""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def gpt_oss_features(model_config) -> frozenset[str]:
    return window_features(model_config) | {"sinks"}


@hookimpl
def register_architectures():
    return [Architecture("gpt_oss", model_types=("gpt_oss",), kind="decoder", features=gpt_oss_features,
                         default_pooling="last", description="gpt-oss decoders (attention sinks, sliding window, MoE)")]
