"""ELECTRA (the discriminator): a BERT-shaped encoder with token types; positions start at 0."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("electra", model_types=("electra",), kind="encoder", default_pooling="first",
                         description="ELECTRA discriminators and ELECTRA-shaped encoders")]
