"""RoBERTa family: BERT-shaped encoders whose positions start at ``pad_token_id + 1`` (usually 2)."""

from ...hookspecs import hookimpl
from ...specs import Architecture


def after_padding_idx(model_config) -> int:
    """RoBERTa numbers positions from ``padding_idx + 1``."""
    return int(model_config.pad_token_id) + 1


@hookimpl
def register_architectures():
    return [Architecture("roberta", model_types=("roberta", "xlm-roberta"), kind="encoder",
                         position_start=after_padding_idx, default_pooling="first",
                         description="RoBERTa and XLM-RoBERTa encoders (positions start at pad_token_id + 1)")]
