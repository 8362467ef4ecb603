"""MPNet (all-mpnet-base-v2 and other sentence-transformers models): attention with a relative position bias.

MPNet computes attention with its own matmuls, not through transformers' ``AttentionInterface``, and adds a bias
from bucketed relative distances that ``MPNetEncoder.compute_position_bias`` builds over the whole row
(``[B, H, L, L]``). Packed, the patch makes the encoder build that bias once per example *length* (``[1, H, L, L]``:
a relative distance does not depend on where an example sits in the row) and run each self-attention per example:
examples of equal length are stacked into one sdpa call with the bias as float mask (attention dropout on the
probabilities, as MPNet's own). Nothing of size ``T × T`` is built and nothing crosses an example boundary.

Any ``attention:`` backend but ``auto`` / ``exact`` is refused: none of them takes the bias.

MPNet's layers pass no keyword arguments down, and sentence-transformers calls the model's ``forward`` itself (past
its hooks), so the boundaries reach the encoder through the one input every call hands the embeddings: the
position ids, which restart (at 2: ``MPNetEmbeddings`` hard-codes ``padding_idx = 1``) at every example. The guard
on the base model (and sentence-transformers' guarded call) checks that they restart exactly at ``cu_seq_lens_q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ...batch import length_groups, restarts
from ...errors import BackendUnavailableError, PadfreeError
from ...hookspecs import hookimpl
from ...patching import PATCH_ATTRIBUTE, ModelPatch, check_boundaries, own_attribute, restore_attributes
from ...specs import Architecture


def after_padding_idx(model_config) -> int:
    """``MPNetEmbeddings.padding_idx`` is 1 in every MPNet, so positions start at 2."""
    return 2


MPNET = Architecture("mpnet", model_types=("mpnet",), kind="encoder", position_start=after_padding_idx,
                     default_pooling="first", description="MPNet encoders (all-mpnet-base-v2); relative position "
                     "bias per example")


#: ``attention:`` values MPNet takes: its per-example sdpa with the bias is the only attention it can run.
OWN_ATTENTION = ("auto", "exact")


@hookimpl
def register_architectures():
    return [MPNET]


@dataclass
class PackedBias:
    """What the patched encoder hands its layers as ``position_bias`` for a packed row: the row's tokens grouped
    by example length (``order``; ``inverse`` puts them back) and one ``[1, H, L, L]`` bias per length."""

    order: torch.Tensor
    inverse: torch.Tensor
    groups: list[tuple[int, int]]  # (length, number of examples of that length), in ``order``
    biases: list[torch.Tensor]


@dataclass
class PerExampleAttention:
    """The patch's changes to an MPNet model (it sits in ``patch.handles``: ``remove()`` undoes them)."""

    model: Any
    dropout: bool = True
    positions: torch.Tensor | None = None  # from the embeddings' pre-hook until the encoder reads them
    saved: list = field(default_factory=list)

    def install(self) -> PerExampleAttention:
        encoder = self.model.base_model.encoder
        targets = [(encoder, "compute_position_bias", self.position_bias)]
        targets += [(layer.attention.attn, "forward", partial(self.attend, layer.attention.attn))
                    for layer in encoder.layer]
        for obj, name, value in targets:
            self.saved.append((obj, name, own_attribute(obj, name)))
            setattr(obj, name, value)
        return self

    def remove(self) -> None:
        for obj, name, value in reversed(self.saved):
            restore_attributes(obj, {name: value})
        self.saved.clear()

    def remember(self, module, args, kwargs) -> None:
        """Pre-hook of the embeddings, which every call path reaches (sentence-transformers calls the model's
        ``forward`` itself, past the base model's hooks): the row's position ids."""
        positions = kwargs.get("position_ids")
        self.positions = positions if positions is not None and positions.shape[0] == 1 else None

    def position_bias(self, x, position_ids=None, num_buckets=32):
        """``compute_position_bias``: MPNet's own for a padded batch; per example length for a packed row."""
        encoder = self.model.base_model.encoder
        compute = type(encoder).compute_position_bias
        positions, self.positions = self.positions, None
        bounds = restarts(positions)  # one host read per forward, for every layer
        if bounds is None:  # a padded batch, or one example
            return compute(encoder, x, position_ids, num_buckets)
        order, inverse, groups = length_groups(bounds)
        biases = [compute(encoder, x[:, :n], None, num_buckets) for n, _ in groups]
        return PackedBias(order.to(x.device), inverse.to(x.device), groups, biases)

    def attend(self, module, hidden_states, attention_mask=None, position_bias=None, output_attentions=False,
               **kwargs):
        """``MPNetSelfAttention.forward``: MPNet's own for a padded batch; per example for a packed row."""
        if not isinstance(position_bias, PackedBias):
            return type(module).forward(module, hidden_states, attention_mask, position_bias, output_attentions,
                                        **kwargs)
        if output_attentions:
            raise PadfreeError("MPNet cannot return attention probabilities (output_attentions) for a packed row")
        heads, size = module.num_attention_heads, module.attention_head_size
        rows = hidden_states[0].index_select(0, position_bias.order)  # [T, C], grouped by example length
        sizes = [n * m for n, m in position_bias.groups]
        projected = [proj(rows).split(sizes) for proj in (module.q, module.k, module.v)]
        dropout = module.dropout.p if module.training and self.dropout else 0.0
        pieces = []
        for (n, m), bias, q, k, v in zip(position_bias.groups, position_bias.biases, *projected):
            q, k, v = (t.view(m, n, heads, size).transpose(1, 2) for t in (q, k, v))  # [m, H, n, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout)
            pieces.append(out.transpose(1, 2).reshape(m * n, heads * size))
        return (module.o(torch.cat(pieces).index_select(0, position_bias.inverse)).unsqueeze(0),)


def guard(module, args, kwargs) -> None:
    """The base model's pre-hook: a packed row has boundaries where its position ids restart, and no mask."""
    check_boundaries(module, args, kwargs)


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name != MPNET.name:
        return None
    if getattr(model, PATCH_ATTRIBUTE, None) is not None:
        raise PadfreeError(f"{type(model).__name__} is already patched; undo the first patch before patching again")
    if config.attention not in OWN_ATTENTION:
        raise BackendUnavailableError(
            f"attention: {config.attention} cannot run MPNet: its attention adds a relative position bias that "
            "padfree computes per example with sdpa itself; use attention: auto or exact"
        )
    keep = config.attention_dropout == "keep"
    implementation = model.config._attn_implementation  # MPNet's attention is its own: nothing to switch
    patch = ModelPatch(model, architecture, backend, fallback, implementation, None, attention_dropout=keep)
    attention = PerExampleAttention(model, keep)
    base = model.base_model
    patch.handles += [base.register_forward_pre_hook(guard, with_kwargs=True),
                      base.embeddings.register_forward_pre_hook(attention.remember, with_kwargs=True),
                      attention.install()]
    setattr(model, PATCH_ATTRIBUTE, patch)
    return patch
