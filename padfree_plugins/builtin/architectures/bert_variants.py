"""BERT-shaped encoders with their own model types: RoCBert and BertGeneration. Positions start at 0; attention goes
through the attention interface.

* **RoCBert** (``roc_bert``, robust Chinese BERT): besides token ids, per-token glyph-shape and pronunciation ids
  (``input_shape_ids``, ``input_pronunciation_ids``), declared per-token model inputs (``token_keys``): the
  collator concatenates them like ``input_ids`` when the examples carry them, and the forward passes them on; without
  them the model embeds zeros for both (``concat_input``) or leaves them out, as transformers does for a call without
  them. Its classifier is BERT's (pooler, dropout,
  classifier).
* **BertGeneration** (``bert-generation``): BERT without token types or pooler, as an encoder
  (``BertGenerationEncoder``) — there is no sequence-classification class: ``embedding`` and ``hidden_states``.
  Configured as a decoder (``is_decoder``, ``BertGenerationDecoder``) its attention is causal, which the attention
  reads from every layer's ``is_causal``.
"""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [
        Architecture("roc_bert", model_types=("roc_bert",), kind="encoder", default_pooling="first",
                     token_keys=("input_shape_ids", "input_pronunciation_ids"),
                     description="RoCBert encoders (shape / pronunciation ids when the batch carries them)"),
        Architecture("bert-generation", model_types=("bert-generation",), kind="encoder", default_pooling="mean",
                     description="BertGeneration encoders (no sequence-classification head)"),
    ]
