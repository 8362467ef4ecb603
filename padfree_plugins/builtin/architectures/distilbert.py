"""DistilBERT: a BERT-shaped encoder without token types (its forward takes no ``token_type_ids``).

Positions start at 0; ``DistilBertForSequenceClassification`` pools the first token, then ``pre_classifier``.
"""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("distilbert", model_types=("distilbert",), kind="encoder", default_pooling="first",
                         description="DistilBERT encoders (no token_type_ids)")]
