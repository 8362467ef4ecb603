"""Hunyuan dense (Hunyuan-0.5B … 7B, ``hunyuan_v1_dense``): a GQA decoder with q/k RMSNorm applied after the
rotary embedding."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("hunyuan_v1_dense", model_types=("hunyuan_v1_dense",), kind="decoder",
                         features=window_features, default_pooling="last",
                         description="Tencent Hunyuan dense decoders")]
