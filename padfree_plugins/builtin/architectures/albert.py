"""ALBERT: a BERT-shaped encoder with factorised embeddings and shared layers; token types, positions from 0."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("albert", model_types=("albert",), kind="encoder", default_pooling="first",
                         description="ALBERT encoders")]
