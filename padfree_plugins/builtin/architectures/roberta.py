"""RoBERTa family: BERT-shaped encoders whose positions start at ``pad_token_id + 1`` (usually 2)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


def after_padding_idx(model_config) -> int:
    """RoBERTa numbers positions from ``padding_idx + 1``."""
    return int(model_config.pad_token_id) + 1


#: Model types with RoBERTa's embeddings (positions from ``padding_idx + 1``) and its classification head.
ROBERTA_FAMILY = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "roberta-prelayernorm")


@hookimpl
def register_architectures():
    return [Architecture("roberta", model_types=ROBERTA_FAMILY, kind="encoder", position_start=after_padding_idx,
                         default_pooling="first",
                         description="RoBERTa, XLM-RoBERTa (-XL), CamemBERT, Data2Vec-Text, RoBERTa-PreLayerNorm "
                         "encoders (positions start at pad_token_id + 1)")]
