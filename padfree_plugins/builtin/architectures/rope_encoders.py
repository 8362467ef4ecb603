"""Encoders with rotary positions (RoPE), so every example's positions simply restart at 0: Nomic BERT
(nomic-embed-text), GTE (gte-multilingual, gte-*-v1.5) and EuroBERT (grouped-query attention)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [
        Architecture("nomic_bert", model_types=("nomic_bert",), kind="encoder", default_pooling="first",
                     description="Nomic BERT encoders (nomic-embed-text)"),
        Architecture("gte", model_types=("gte",), kind="encoder", default_pooling="first",
                     description="GTE encoders (gte-multilingual-base, gte-*-en-v1.5)"),
        Architecture("eurobert", model_types=("eurobert",), kind="encoder", default_pooling="first",
                     description="EuroBERT encoders"),
    ]
