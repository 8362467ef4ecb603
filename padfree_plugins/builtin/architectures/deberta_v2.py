"""DeBERTa-v2 / v3 (classifiers, NLI and cross-encoder rerankers): disentangled attention per example.

``DisentangledSelfAttention`` computes attention with its own matmuls, not through transformers'
``AttentionInterface``: content-to-position and position-to-content scores read the (log-bucketed) relative
position of every query / key pair, which ``DebertaV2Encoder.get_rel_pos`` builds over the whole row
(``[1, T, T]``), as ``get_attention_mask`` builds the mask (``[1, 1, T, T]``). Packed, the patch builds neither:
the encoder's mask becomes a :class:`PackedRow` (the row's tokens grouped by example length and one ``[n, n]``
relative-position table per length — a relative position does not depend on where an example sits in the row),
and every layer's attention runs per example, examples of equal length stacked: the token projections run once
on the row, the projections of the relative embeddings once per layer, and the scores, the c2p / p2c terms, the
softmax and the attention dropout per length group, in DeBERTa's own order of operations. Nothing of size
``T × T`` is built and nothing crosses an example boundary.

``conv_kernel_size > 0`` (DeBERTa-v2 xlarge / xxlarge): the encoder's ``ConvLayer`` mixes neighbouring tokens,
so packed it runs per example too (its own forward, on each length group), with zeros beyond every example's
ends as in a padded batch. Absolute positions (``position_biased_input``) restart at 0 at every example, and
token types travel per token, so the embeddings need nothing.

Any ``attention:`` backend but ``auto`` / ``exact`` is refused: none of them computes disentangled attention.
``output_attentions`` is refused for a packed row.

The boundaries come from the position ids (see :mod:`._own_attention`), which restart at 0 at every example.
DeBERTa v1 (``deberta``) has another attention and stays refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from padfree_plugins.builtin.architectures._own_attention import MethodPatch, patch_own_attention
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import PadfreeError, UnsupportedArchitectureError
from padfree_plugins.modeling.attention.backends import PermuteRows
from padfree_plugins.packing.batch import length_groups, restarts

DEBERTA_V2 = Architecture("deberta-v2", model_types=("deberta-v2",), kind="encoder", default_pooling="first",
                          description="DeBERTa-v2 / v3 encoders, classifiers and cross-encoders; disentangled "
                          "attention per example")

@hookimpl
def register_architectures():
    return [DEBERTA_V2]


@dataclass
class PackedRow:
    """What the patched encoder hands its layers as ``attention_mask`` for a packed row: the row's tokens grouped by
    example length (``order``; ``inverse`` puts them back), each group's ``(length, count)``, and per group the
    relative positions ``[n, n]`` of DeBERTa's own ``build_relative_position`` (``None`` without relative
    attention)."""

    order: torch.Tensor
    inverse: torch.Tensor
    groups: list[tuple[int, int]]
    relative: list[torch.Tensor | None]

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[1, T, C]`` -> one ``[count, length, C]`` block per group."""
        rows = PermuteRows.apply(x[0], self.order, self.inverse)
        return [block.view(m, n, -1) for (n, m), block in zip(self.groups, rows.split([n * m for n, m in self.groups]))]

    def scatter(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`gather`: ``[1, T, C]`` in the row's order."""
        rows = torch.cat([block.reshape(-1, block.shape[-1]) for block in blocks])
        return PermuteRows.apply(rows, self.inverse, self.order).unsqueeze(0)


@dataclass
class PerExampleAttention(MethodPatch):
    """The patch's changes to a DeBERTa-v2 model: its mask and relative positions, every self-attention and the
    convolution."""

    row: PackedRow | None = None  # the current forward's packed row (None: padded), for get_rel_pos and the conv

    def targets(self):
        encoder = self.model.base_model.encoder
        targets = [(encoder, "get_attention_mask", self.attention_mask), (encoder, "get_rel_pos", self.rel_pos)]
        targets += [(layer.attention.self, "forward", partial(self.attend, layer.attention.self))
                    for layer in encoder.layer]
        if encoder.conv is not None:
            targets.append((encoder.conv, "forward", partial(self.convolve, encoder.conv)))
        return targets

    def remove(self) -> None:
        super().remove()
        self.row = None

    def attention_mask(self, attention_mask):
        """``get_attention_mask``: DeBERTa's own for a padded batch; a :class:`PackedRow` for a packed one."""
        encoder = self.model.base_model.encoder
        bounds = restarts(self.take_positions())  # one host read per forward, for every layer
        if bounds is None:  # a padded batch, or one example
            self.row = None
            return type(encoder).get_attention_mask(encoder, attention_mask)
        # the mask is DeBERTa's own all-ones: the guard refuses a packed row that brings one (no host read here)
        order, inverse, groups = length_groups(bounds)
        relative = [self.relative_positions(n, attention_mask.device) for n, _ in groups]
        self.row = PackedRow(order.to(attention_mask.device), inverse.to(attention_mask.device), groups, relative)
        return self.row

    def relative_positions(self, length: int, device) -> torch.Tensor | None:
        """DeBERTa's relative positions (bucketed as configured) of an example of ``length`` tokens: ``[n, n]``."""
        from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

        encoder = self.model.base_model.encoder
        if not encoder.relative_attention:
            return None
        shape = torch.empty(length, 0, device=device)  # build_relative_position reads sizes and device only
        return build_relative_position(shape, shape, bucket_size=encoder.position_buckets,
                                       max_position=encoder.max_relative_positions)[0]

    def rel_pos(self, hidden_states, query_states=None, relative_pos=None):
        """``get_rel_pos``: nothing for a packed row (the :class:`PackedRow` carries them per example length)."""
        if self.row is not None:
            return None
        encoder = self.model.base_model.encoder
        return type(encoder).get_rel_pos(encoder, hidden_states, query_states, relative_pos)

    def convolve(self, module, hidden_states, residual_states, input_mask):
        """``ConvLayer.forward``: DeBERTa's own for a padded batch; on each example of a packed row (its own
        forward per length group, zeros past the example's ends, as padded)."""
        if self.row is None:
            return type(module).forward(module, hidden_states, residual_states, input_mask)
        row = self.row
        blocks = [type(module).forward(module, h, r, r.new_ones(r.shape[:2]))
                  for h, r in zip(row.gather(hidden_states), row.gather(residual_states))]
        return row.scatter(blocks)

    def attend(self, module, hidden_states, attention_mask, output_attentions=False, query_states=None,
               relative_pos=None, rel_embeddings=None):
        """``DisentangledSelfAttention.forward``: DeBERTa's own for a padded batch; per example for a packed row."""
        if not isinstance(attention_mask, PackedRow):
            return type(module).forward(module, hidden_states, attention_mask, output_attentions,
                                        query_states=query_states, relative_pos=relative_pos,
                                        rel_embeddings=rel_embeddings)
        if output_attentions:
            raise PadfreeError("DeBERTa-v2 cannot return attention probabilities (output_attentions) for a packed "
                               "row")
        if query_states is not None:
            raise PadfreeError("DeBERTa-v2 with separate query states (z_steps) cannot run packed")
        row, heads = attention_mask, module.num_attention_heads
        types = module.pos_att_type
        scale_factor = 1 + ("c2p" in types) + ("p2c" in types)
        scale = torch.sqrt(torch.tensor(module.attention_head_size, dtype=torch.float) * scale_factor)
        position = {}
        if module.relative_attention:  # the relative embeddings' projections: once per layer, for every group
            span = module.pos_ebd_size
            rel = module.pos_dropout(rel_embeddings)[: span * 2]
            names = {"c2p": "key_proj", "p2c": "query_proj"}  # pos_key_proj / pos_query_proj unless shared
            position = {kind: getattr(module, name if module.share_att_key else f"pos_{name}")(rel)
                        .view(span * 2, heads, -1).permute(1, 2, 0)  # [H, D, 2 * span]
                        for kind, name in names.items() if kind in types}
        dropout = module.dropout.p if module.training and self.dropout else 0.0
        blocks = []
        projected = [row.gather(proj(hidden_states)) for proj in (module.query_proj, module.key_proj,
                                                                   module.value_proj)]  # once on the row
        for (q, k, v), relative in zip(zip(*projected), row.relative):
            m, n = q.shape[:2]
            q, k, v = (t.view(m, n, heads, -1).transpose(1, 2) for t in (q, k, v))  # [m, H, n, D]
            scores = torch.matmul(q, k.transpose(-1, -2) / scale.to(dtype=q.dtype))
            bias = 0  # DeBERTa's order: the c2p and p2c terms summed, then added to the scores
            if "c2p" in position:
                index = torch.clamp(relative + span, 0, span * 2 - 1).expand(m, heads, n, n)
                c2p = torch.gather(torch.matmul(q, position["c2p"]), -1, index)
                bias = bias + c2p / scale.to(dtype=c2p.dtype)
            if "p2c" in position:
                index = torch.clamp(-relative + span, 0, span * 2 - 1).expand(m, heads, n, n)
                p2c = torch.gather(torch.matmul(k, position["p2c"]), -1, index).transpose(-1, -2)
                bias = bias + p2c / scale.to(dtype=p2c.dtype)
            if position:
                scores = scores + bias
            probs = F.dropout(F.softmax(scores, dim=-1), p=dropout, training=dropout > 0)
            blocks.append(torch.matmul(probs, v).transpose(1, 2).reshape(m, n, -1))
        return row.scatter(blocks), None


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name != DEBERTA_V2.name:
        return None
    if getattr(model.base_model, "z_steps", 0) > 1:
        raise UnsupportedArchitectureError("DeBERTa-v2 with z_steps > 1 (enhanced mask decoder steps) cannot run "
                                           "packed")
    return patch_own_attention(model, architecture, backend, fallback, config, PerExampleAttention,
                               "DeBERTa-v2: its disentangled attention (relative-position terms per query / key "
                               "pair) is computed per example by padfree itself")
