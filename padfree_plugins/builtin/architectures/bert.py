"""BERT: the encoder pattern (bidirectional, absolute positions, token_type_ids). Positions start at 0."""

from ...hookspecs import hookimpl
from ...specs import Architecture


@hookimpl
def register_architectures():
    return [Architecture("bert", model_types=("bert",), kind="encoder", default_pooling="first",
                         description="BERT and BERT-shaped encoders (MiniLM, BGE, E5, …)")]
