"""ELECTRA (the discriminator): a BERT-shaped encoder with token types; positions start at 0."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("electra", model_types=("electra",), kind="encoder", default_pooling="first",
                         description="ELECTRA discriminators and ELECTRA-shaped encoders")]
