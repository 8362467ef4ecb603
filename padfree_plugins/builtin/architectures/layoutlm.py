"""LayoutLM (``layoutlm``, v1) on text: a BERT-shaped encoder whose embeddings add 2-D position embeddings of each
token's bounding box (``bbox``, ``[B, L, 4]``; zeros when absent). Positions start at 0.

Its self-attention modules (``LayoutLMSelfAttention``) have no ``is_causal`` attribute, and the packed attention
reads ``getattr(module, "is_causal", True)``: the patch sets ``is_causal = False`` on each of them (removed by undo),
so that packed LayoutLM is bidirectional like its own padded forward. ``bbox`` is a declared per-token model input
(``token_keys``): the collator packs every example's ``[L, 4]`` boxes into ``[1, T, 4]`` when the examples carry
them, and the forward passes them on; without them both runs embed all-zero boxes.
LayoutLMv2 / v3 (visual backbones, their own relative-position attention) are not covered.
"""

from __future__ import annotations

from dataclasses import dataclass

from padfree_plugins.builtin.architectures._own_attention import MethodPatch
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.modeling.patching import ModelPatch

LAYOUTLM = Architecture("layoutlm", model_types=("layoutlm",), kind="encoder", default_pooling="first",
                        token_keys=("bbox",),
                        description="LayoutLM (v1) encoders on text (bbox zeros unless the batch carries it); "
                        "bidirectional attention declared on its layers")


@hookimpl
def register_architectures():
    return [LAYOUTLM]


@dataclass
class Bidirectional(MethodPatch):
    """``is_causal = False`` on every attention module the model calls without one (LayoutLM's)."""

    def targets(self):
        return [(module, "is_causal", False) for module in self.model.modules()
                if type(module).__name__.endswith("SelfAttention") and not hasattr(module, "is_causal")]


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name != LAYOUTLM.name:
        return None
    patch = ModelPatch.apply(model, architecture, backend, fallback,
                             attention_dropout=config.attention_dropout == "keep")
    patch.handles.append(Bidirectional(patch.model).install())
    return patch
