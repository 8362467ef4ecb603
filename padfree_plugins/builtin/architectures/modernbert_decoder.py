"""ModernBERT-decoder (``modernbert-decoder``, Ettin decoders): ModernBERT's body trained causally — RoPE (positions
restart at 0), causal attention through the attention interface, local (sliding-window, ``local_attention // 2``
tokens back) layers interleaved with global ones. Its classifier runs ``head`` -> ``drop`` -> ``classifier`` on every
token and reads each row's last token that is not the pad id; per example the same token is read first."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("modernbert-decoder", model_types=("modernbert-decoder",), kind="decoder",
                         features=window_features, default_pooling="last",
                         description="ModernBERT-decoder (Ettin) causal decoders; local (sliding-window) layers")]
