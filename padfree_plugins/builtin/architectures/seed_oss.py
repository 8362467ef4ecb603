"""Seed-OSS (ByteDance Seed-OSS-36B): a Llama-shaped GQA decoder with q/k/v biases (``attention_bias``) and a
separate output-projection bias (``attention_out_bias``)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("seed_oss", model_types=("seed_oss",), kind="decoder", features=window_features,
                         default_pooling="last", description="ByteDance Seed-OSS decoders")]
