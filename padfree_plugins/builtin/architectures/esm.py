"""Protein language models: ESM-2 (``esm``) and ESM C (``esmc``).

**ESM-2** is a BERT-shaped encoder whose attention goes through transformers' ``AttentionInterface``. Two things
of its embeddings matter for a packed row:

* *positions*: absolute ones (``position_embedding_type="absolute"``, ESM-1b style) are numbered from
  ``padding_idx + 1`` like RoBERTa's; rotary ones (ESM-2's real setting) from 0, as ``EsmModel`` numbers them when
  it is given none;
* *token dropout* (``token_dropout=True``, every ESM-2 checkpoint): ``<mask>`` embeddings are zeroed and the whole
  row is rescaled by ``(1 - 0.15 * 0.8) / (1 - masks / length)``, with the share of masks counted over the *row*
  (``EsmEmbeddings.forward``). On a packed row one example's masks would rescale every other example (0.1–0.55 in
  the hidden states of a tiny model, exactly in masked-LM training). The patch replaces the embeddings' forward on
  the instance: for a packed row it counts masks and tokens per example — examples found where the position ids
  restart, on the device, with no read back to the host — zeroes the mask embeddings and scales every token by its
  own example's factor, then hands the scaled embeddings to ESM's own forward (which adds positions and the layer
  norm, and skips its own token dropout because it is given embeddings). A padded batch, a batch with an
  ``attention_mask`` and one example alone go through ESM's own code unchanged.

**ESM C** (``esmc``, ESM C 300M / 600M) is a RoPE encoder (QK layer norms, SwiGLU; attention through the
attention interface; transformers refuses GQA for it) without token dropout; positions restart at 0 for every
example. Its ``sequence_id`` (several chains in one input, masked from each other) cannot be combined with packing
(the attention backends take example boundaries, not an extra mask inside an example): a packed call with
``sequence_id`` is refused; a padded one gets its chain mask as a 4-D ``attention_mask`` (see :func:`chains`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

import torch

from padfree_plugins.builtin.architectures._own_attention import MethodPatch
from padfree_plugins.builtin.architectures._packed_rows import example_of_token, is_packed_row
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.modeling.patching import ModelPatch

#: ESM's share of masked tokens in training (15 % selected, 80 % of them masked), hard-coded in ``EsmEmbeddings``.
MASK_RATIO_TRAIN = 0.15 * 0.8


def esm_position_start(model_config) -> int:
    """Absolute positions start at ``padding_idx + 1`` (RoBERTa's numbering); rotary ones at 0."""
    if getattr(model_config, "position_embedding_type", "absolute") == "rotary":
        return 0
    if model_config.pad_token_id is None:
        raise ConfigError("ESM with absolute positions numbers them from pad_token_id + 1, but the config has no "
                          "pad_token_id (every ESM tokenizer's <pad> is 1): set config.pad_token_id")
    return int(model_config.pad_token_id) + 1


ESM = Architecture("esm", model_types=("esm",), kind="encoder", position_start=esm_position_start,
                   default_pooling="mean", description="ESM-2 / ESM-1b protein encoders; token dropout scaled per "
                   "example (positions from pad_token_id + 1 when absolute, 0 when rotary)")
ESMC = Architecture("esmc", model_types=("esmc",), kind="encoder", default_pooling="mean",
                    description="ESM C protein encoders (RoPE, GQA); sequence_id chains refused when packed")


@hookimpl
def register_architectures():
    return [ESM, ESMC]


def per_example_token_dropout(module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``EsmEmbeddings``' token dropout on a packed row, every example scaled by its own share of masks — the same
    arithmetic as ESM's per-row scaling of that example alone."""
    embeddings = module.word_embeddings(input_ids)
    masked = input_ids == module.mask_token_id
    embeddings = embeddings.masked_fill(masked.unsqueeze(-1), 0.0)
    example = example_of_token(position_ids)
    total = input_ids.shape[1]
    counts = torch.zeros(total, dtype=torch.long, device=input_ids.device).index_add_(0, example, masked[0].long())
    lengths = torch.zeros(total, dtype=torch.long, device=input_ids.device).index_add_(
        0, example, torch.ones_like(example))
    observed = (counts.float() / lengths.clamp_min(1)).index_select(0, example)  # [T]: each token's example's share
    return (embeddings * (1 - MASK_RATIO_TRAIN) / (1 - observed)[None, :, None]).to(embeddings.dtype)


@dataclass
class PerExampleTokenDropout(MethodPatch):
    """The patch's change to an ESM-2 model: its embeddings' forward (token dropout per example on a packed row)."""

    def targets(self):
        embeddings = self.model.base_model.embeddings
        return [(embeddings, "forward", partial(self.embed, embeddings))]

    def embed(self, module, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
        """``EsmEmbeddings.forward``: ESM's own, but for a packed row with token dropout the masks are counted per
        example (the rest — positions, layer norm — is still ESM's own forward, given the scaled embeddings)."""
        own = type(module).forward
        packed = (module.token_dropout and input_ids is not None and inputs_embeds is None and attention_mask is None
                  and is_packed_row(position_ids, input_ids))
        if not packed:
            return own(module, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       inputs_embeds=inputs_embeds)
        scaled = per_example_token_dropout(module, input_ids, position_ids)
        return own(module, input_ids=None, attention_mask=None, position_ids=position_ids, inputs_embeds=scaled)


def chains(module, args, kwargs):
    """ESM C's pre-hook for ``sequence_id`` (several chains in one input, masked from each other). A packed row is
    refused: no attention backend masks inside an example on top of its boundaries. An ordinary padded call gets
    its chain mask as the 4-D boolean mask ESM C builds from ``sequence_id`` (a token attends to the tokens of its
    own chain; padding, ``-1``, to padding), passed as ``attention_mask``: the patched model's mask function builds
    masks only from a 2-D ``attention_mask``, so the chain mask would otherwise be lost."""
    bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs)
    sequence_id = bound.arguments.get("sequence_id")
    if sequence_id is None:
        return None
    inputs = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    positions = inputs.get("position_ids")
    restarting = (isinstance(positions, torch.Tensor) and positions.ndim == 2 and positions.shape[-1] > 1
                  and bool((positions[:, 1:] != positions[:, :-1] + 1).any()))
    if inputs.get("cu_seq_lens_q") is not None or restarting:
        raise PadfreeError("ESM C: sequence_id (several chains in one input, masked from each other) cannot be "
                           "packed padding-free; pack single-chain examples, or run multi-chain inputs padded")
    bound.arguments["attention_mask"] = sequence_id[:, None, :, None] == sequence_id[:, None, None, :]
    bound.arguments["sequence_id"] = None
    return bound.args[1:], bound.kwargs


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name not in (ESM.name, ESMC.name):
        return None
    patch = ModelPatch.apply(model, architecture, backend, fallback,
                             attention_dropout=config.attention_dropout == "keep")
    if architecture.name == ESM.name:
        patch.handles.append(PerExampleTokenDropout(patch.model).install())
    else:
        patch.handles.append(patch.model.base_model.register_forward_pre_hook(chains, with_kwargs=True))
    return patch
