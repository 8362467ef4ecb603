"""MPNet (all-mpnet-base-v2 and other sentence-transformers models): attention with a relative position bias.

MPNet computes attention with its own matmuls, not through transformers' ``AttentionInterface``, and adds a bias
from bucketed relative distances that ``MPNetEncoder.compute_position_bias`` builds over the whole row
(``[B, H, L, L]``). Packed, the patch makes the encoder build that bias once per example *length* (``[1, H, L, L]``:
a relative distance does not depend on where an example sits in the row) and run each self-attention per example:
examples of equal length are stacked into one sdpa call with the bias as float mask (attention dropout on the
probabilities, as MPNet's own). Nothing of size ``T × T`` is built and nothing crosses an example boundary.

Any ``attention:`` backend but ``auto`` / ``exact`` is refused: none of them takes the bias.

The boundaries come from the position ids (see :mod:`._own_attention`), which restart at 2 at every example
(``MPNetEmbeddings`` hard-codes ``padding_idx = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from padfree_plugins.builtin.architectures._own_attention import MethodPatch, patch_own_attention
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import PadfreeError
from padfree_plugins.packing.batch import length_groups, restarts


def after_padding_idx(model_config) -> int:
    """``MPNetEmbeddings.padding_idx`` is 1 in every MPNet, so positions start at 2."""
    return 2


MPNET = Architecture("mpnet", model_types=("mpnet",), kind="encoder", position_start=after_padding_idx,
                     default_pooling="first", description="MPNet encoders (all-mpnet-base-v2); relative position "
                     "bias per example")


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
class PerExampleAttention(MethodPatch):
    """The patch's changes to an MPNet model: its position bias and every self-attention."""

    def targets(self):
        encoder = self.model.base_model.encoder
        return [(encoder, "compute_position_bias", self.position_bias)] + [
            (layer.attention.attn, "forward", partial(self.attend, layer.attention.attn)) for layer in encoder.layer]

    def position_bias(self, x, position_ids=None, num_buckets=32):
        """``compute_position_bias``: MPNet's own for a padded batch; per example length for a packed row."""
        encoder = self.model.base_model.encoder
        compute = type(encoder).compute_position_bias
        bounds = restarts(self.take_positions())  # one host read per forward, for every layer
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


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name != MPNET.name:
        return None
    return patch_own_attention(model, architecture, backend, fallback, config, PerExampleAttention,
                               "MPNet: its attention adds a relative position bias that padfree computes per "
                               "example with sdpa itself")
