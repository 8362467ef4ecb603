"""BERT: the encoder pattern (bidirectional, absolute positions, token_type_ids). Positions start at 0.

ERNIE is BERT plus optional task-type embeddings (``use_task_id``; ``task_type_ids`` default to zeros, packed or not).
"""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("bert", model_types=("bert", "ernie"), kind="encoder", default_pooling="first",
                         description="BERT and BERT-shaped encoders (MiniLM, BGE, E5, ERNIE …)")]
