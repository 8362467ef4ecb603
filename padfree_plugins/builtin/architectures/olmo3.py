"""OLMo 3: OLMo 2's post-norm decoder with sliding-window layers interleaved with full ones (``layer_types``,
3:1 in the released models)."""

from ...hookspecs import hookimpl
from ...specs import Architecture
from ._features import window_features


@hookimpl
def register_architectures():
    return [Architecture("olmo3", model_types=("olmo3",), kind="decoder", features=window_features,
                         default_pooling="last", description="AllenAI OLMo 3 decoders (sliding window honoured)")]
