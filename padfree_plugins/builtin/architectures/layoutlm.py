"""LayoutLM (``layoutlm``, v1) on text: a BERT-shaped encoder whose embeddings add 2-D position embeddings of each
token's bounding box (``bbox``, ``[B, L, 4]``; zeros when absent). Positions start at 0.

Its self-attention modules (``LayoutLMSelfAttention``) have no ``is_causal`` attribute; packed attention then takes
the architecture's kind (an encoder: bidirectional, like its own padded forward), so the core patch serves it.
``bbox`` is a declared per-token model input
(``token_keys``): the collator packs every example's ``[L, 4]`` boxes into ``[1, T, 4]`` when the examples carry
them, and the forward passes them on; without them both runs embed all-zero boxes.
LayoutLMv2 / v3 (visual backbones, their own relative-position attention) are not covered.
"""

from __future__ import annotations

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl

LAYOUTLM = Architecture("layoutlm", model_types=("layoutlm",), kind="encoder", default_pooling="first",
                        token_keys=("bbox",),
                        description="LayoutLM (v1) encoders on text (bbox zeros unless the batch carries it); "
                        "bidirectional")


@hookimpl
def register_architectures():
    return [LAYOUTLM]
