"""The text towers of vision–text encoders: CLIP (``clip_text_model``) and SigLIP / SigLIP 2 (``siglip_text_model``,
``siglip2_text_model``), for text embeddings (``embedding``, ``hidden_states``: they have no sequence-classification
class). Learned absolute positions restart at 0 for every example.

* **CLIP**'s text tower is causal (it passes ``is_causal=True`` to attention) and pools the EOS token
  (``pooler_output``; ``CLIPTextModelWithProjection`` then applies ``text_projection``): packed, pool ``last`` —
  the EOS token when every text ends with it, as CLIP's tokenizer writes it.
* **SigLIP**'s is bidirectional and pools the row's *last* token (then ``head``): packed, pool ``last`` gives each
  text's last token. Its attention (``SiglipAttention`` / ``Siglip2Attention``) does not pass its ``**kwargs`` on
  to the attention function, so the boundaries never reached it (the guard refuses such a call): the patch replaces
  each attention's forward on the instance with one that passes them (the same projections and call otherwise).
  SigLIP was trained on texts padded to 64 tokens *without* a mask (pads are content): texts tokenized with
  ``padding="max_length"`` pack exactly as SigLIP runs them (and save nothing); unpadded texts pack exactly as each
  runs alone, which is not how the checkpoints were trained.

The embedding task pools the hidden states after ``final_layer_norm``; the towers' projections (``text_projection``,
SigLIP's ``head``) are linear maps applied after pooling, left to the caller.

Both towers' embeddings refuse an input longer than ``max_position_embeddings`` (77 for CLIP, 64 for SigLIP), a
limit of each *example*, which a packed row of many exceeds: the patch replaces the embeddings' forward on the
instance so that a packed row (one row with its position ids, longer than the table) is embedded as each example
is — token embedding plus the position embedding of its own positions; the collator keeps every example within the
limit. Anything else runs the towers' own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from padfree_plugins.builtin.architectures._own_attention import MethodPatch
from padfree_plugins.builtin.architectures._packed_rows import is_packed_row
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.modeling.patching import ModelPatch
from padfree_plugins.packing.batch import BOUNDARY_KEYS

CLIP_TEXT = Architecture("clip_text", model_types=("clip_text_model",), kind="decoder", default_pooling="last",
                         description="CLIP text towers (causal, EOS = last token); embedding / hidden_states")
SIGLIP_TEXT = Architecture("siglip_text", model_types=("siglip_text_model", "siglip2_text_model"), kind="encoder",
                           default_pooling="last", description="SigLIP / SigLIP 2 text towers (bidirectional, last "
                           "token); embedding / hidden_states")
TOWERS = (CLIP_TEXT.name, SIGLIP_TEXT.name)


@hookimpl
def register_architectures():
    return [CLIP_TEXT, SIGLIP_TEXT]


@dataclass
class PerExamplePositions(MethodPatch):
    """The patch's change to a text tower: its embeddings' forward takes a packed row longer than its table."""

    def targets(self):
        embeddings = self.model.base_model.embeddings
        targets = [(embeddings, "forward", partial(self.embed, embeddings))]
        if self.model.config.model_type in SIGLIP_TEXT.model_types:
            targets += [(layer.self_attn, "forward", partial(attend_with_boundaries, layer.self_attn))
                        for layer in self.model.base_model.encoder.layers]
        return targets

    def embed(self, module, input_ids=None, position_ids=None, inputs_embeds=None):
        """The tower's own forward, but a packed row longer than the position table (each example within it) is
        embedded without the length check: token embeddings plus the embeddings of the row's own positions."""
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if length <= module.position_embedding.num_embeddings or not is_packed_row(position_ids, input_ids,
                                                                                   inputs_embeds):
            return type(module).forward(module, input_ids=input_ids, position_ids=position_ids,
                                        inputs_embeds=inputs_embeds)
        if inputs_embeds is None:
            inputs_embeds = module.token_embedding(input_ids)
        return inputs_embeds + module.position_embedding(position_ids)


def attend_with_boundaries(module, hidden_states, attention_mask=None, **kwargs):
    """``SiglipAttention.forward`` (SigLIP 2's too) that hands the packed row's boundaries to the attention function;
    without them, SigLIP's own forward."""
    boundaries = {key: kwargs[key] for key in BOUNDARY_KEYS if key in kwargs}
    if not boundaries:
        return type(module).forward(module, hidden_states, attention_mask, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    queries, keys, values = (proj(hidden_states).view(hidden_shape).transpose(1, 2)
                             for proj in (module.q_proj, module.k_proj, module.v_proj))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    output, weights = attention(module, queries, keys, values, attention_mask, is_causal=module.is_causal,
                                scaling=module.scale, dropout=0.0 if not module.training else module.dropout,
                                **boundaries)
    return module.out_proj(output.reshape(*input_shape, -1).contiguous()), weights


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name not in TOWERS:
        return None
    patch = ModelPatch.apply(model, architecture, backend, fallback,
                             attention_dropout=config.attention_dropout == "keep")
    patch.handles.append(PerExamplePositions(patch.model).install())
    return patch
