"""OLMo 3: OLMo 2's post-norm decoder with sliding-window layers interleaved with full ones (``layer_types``,
3:1 in the released models)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("olmo3", model_types=("olmo3",), kind="decoder", features=window_features,
                         default_pooling="last", description="AllenAI OLMo 3 decoders (sliding window honoured)")]
