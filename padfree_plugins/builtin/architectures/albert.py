"""ALBERT: a BERT-shaped encoder with factorised embeddings and shared layers; token types, positions from 0."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("albert", model_types=("albert",), kind="encoder", default_pooling="first",
                         description="ALBERT encoders")]
