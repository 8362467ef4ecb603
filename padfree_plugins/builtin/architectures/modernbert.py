"""ModernBERT: a RoPE encoder alternating global and local (sliding-window) attention layers.

Local layers pass ``sliding_window = config.sliding_window + 1`` to the attention function, with
``config.sliding_window = local_attention // 2``: with the backends' window semantics (a token sees tokens at
distance ``< window`` on both sides when bidirectional) a token sees ``local_attention // 2`` tokens each side,
exactly as ModernBERT's own sliding-window mask. Positions start at 0 (RoPE).
"""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def local_attention(model_config) -> frozenset[str]:
    """Local layers use a sliding window (also read generically from ``config.sliding_window``)."""
    return frozenset({"sliding_window"}) if getattr(model_config, "local_attention", None) else frozenset()


@hookimpl
def register_architectures():
    return [Architecture("modernbert", model_types=("modernbert",), kind="encoder", features=local_attention,
                         default_pooling="first",
                         description="ModernBERT encoders; local (sliding-window) layers honoured")]
