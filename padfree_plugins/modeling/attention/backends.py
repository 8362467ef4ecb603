"""Attention kernels over a packed row: ``[T, H, D]`` tensors split into examples by ``cu_seq_lens``.

Every backend has the signature of :func:`exact_varlen` and returns ``[T, H_q, D]``. Semantics shared by all:

* ``causal``: a token sees itself and earlier tokens of its own example only.
* ``window``: transformers' ``sliding_window`` — a token sees tokens at distance ``< window`` (on the left when
  causal, on both sides otherwise); ``None`` is unlimited.
* ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2).
* ``dropout``: attention-probability dropout, already ``0.0`` outside training.
* GQA / MQA: ``key`` / ``value`` may have fewer heads than ``query`` (a divisor of it).
* ``sinks`` (only for backends that declare the ``sinks`` feature, passed only when set): one learned logit per
  query head that joins every softmax and takes its share of the probability, attending to nothing (gpt-oss's
  ``s_aux``). A backend that does not declare it is never given it.
* ``blocks`` (only for backends that declare the ``bidirectional_blocks`` feature, passed only when set): int
  ``[T]``, transformers' ``block_sequence_ids`` of the packed row — the tokens of one block (an image's, ``>= 0``,
  numbered so that no two examples share one) see each other both ways beyond ``causal``; ``-1``: in no block.
  A window still limits how far back a token sees, never a block's later tokens (Gemma 3's sliding layers).
  Self-attention only (an example has as many keys as queries).
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
import torch.nn.functional as F

from padfree_plugins.errors import BackendUnavailableError
from padfree_plugins.packing.batch import length_groups, token_examples


def segment_mask(
    length_q: int, length_k: int, causal: bool, window: int | None, device, *, always: bool = False
) -> torch.Tensor | None:
    """Boolean ``[Lq, Lk]`` mask (True = attend) for one example; ``None`` when sdpa's ``is_causal`` flag (or
    no mask at all) says the same, unless ``always``.

    Queries are aligned to the end of the keys (the last query sees the last key), as in a KV cache.
    """
    window_limits = window is not None and window < max(length_q, length_k)
    causal_limits = causal and length_q > 1
    if not always and not window_limits and not (causal_limits and length_q != length_k):
        return None
    q = torch.arange(length_q, device=device)[:, None] + (length_k - length_q)
    k = torch.arange(length_k, device=device)[None, :]
    distance = q - k
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if window_limits:
        allowed &= (distance < window) & (distance > -window)
    return allowed


def block_mask(blocks: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Boolean ``[B, 1, L, L]`` mask (True = attend) of self-attention over rows of ``blocks`` (``[B, L]``, see the
    module docstring): ``causal`` or in the same block, then within ``window`` — transformers' Gemma 3 masks,
    ``(causal | blockwise) & sliding_window_overlay`` (the window looks back only when causal)."""
    position = torch.arange(blocks.shape[-1], device=blocks.device)
    distance = position[:, None] - position[None, :]
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    allowed = (same | (distance >= 0)) if causal else torch.ones_like(same)
    if window is not None:
        allowed = allowed & ((distance < window) if causal else (distance.abs() < window))
    return allowed[:, None]


def attend(q, k, v, *, causal, scale=None, window=None, softcap=None, dropout=0.0, mask=None, sinks=None,
           return_weights=False, blocks=None):
    """Exact attention of ``[B, H, Lq, D]`` queries over ``[B, H_kv, Lk, D]`` keys (``H_kv`` divides ``H``).

    ``mask`` (optional, boolean, True = attend, broadcastable to ``[B, H, Lq, Lk]``) is combined with the
    causal / window structure. ``sinks`` (``[H]``): a per-head logit in every softmax that attends to nothing.
    ``return_weights``: also return the attention probabilities ``[B, H, Lq, Lk]`` (``output_attentions``).
    ``blocks`` (``[B, L]``, self-attention): bidirectional blocks, which replace the causal / window structure by
    :func:`block_mask`.
    """
    if blocks is not None:
        structure = block_mask(blocks, causal, window)
        mask = structure if mask is None else mask & structure
        causal, window = False, None
    grouped = k.shape[-3] != q.shape[-3]
    explicit = mask is not None or softcap is not None or sinks is not None or return_weights
    structure = segment_mask(q.shape[-2], k.shape[-2], causal, window, q.device, always=explicit and causal)
    if mask is not None:
        structure = mask if structure is None else (mask & structure)
    if softcap is None and sinks is None and not return_weights:
        use_flag = structure is None and causal and q.shape[-2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=structure, dropout_p=dropout, scale=scale,
                                              is_causal=use_flag, enable_gqa=grouped)
    if grouped:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if structure is not None:
        scores = scores.masked_fill(~structure, torch.finfo(scores.dtype).min)
    accumulate = torch.promote_types(scores.dtype, torch.float32)  # float32 at least, float64 kept
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=accumulate).to(q.dtype)
    else:  # the sink joins the softmax as one more column, then is dropped: it attends to nothing
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, column], dim=-1)
        probs = torch.softmax(combined, dim=-1, dtype=accumulate)[..., :-1].to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    out = torch.matmul(probs, v)
    return (out, probs) if return_weights else out


def _expand_kv(key: torch.Tensor, value: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat key/value heads (dim 1 of ``[T, H, D]``) to match the query heads (GQA / MQA)."""
    heads = key.shape[1]
    if heads == num_q_heads:
        return key, value
    if num_q_heads % heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of key/value heads ({heads})")
    repeat = num_q_heads // heads
    return key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)


def exact_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    max_length_q: int,
    max_length_k: int,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention on any device: one ``scaled_dot_product_attention`` per example.

    Examples of equal length are stacked into one call, so the number of kernel launches is the number of
    distinct lengths, not of examples. No work is spent on padding; nothing crosses an example boundary.

    Under ``torch.compile`` the grouping, which reads the boundaries on the host, cannot be traced: the call is
    the custom op ``padfree::exact_varlen`` (:func:`exact_varlen_op`, this function run eagerly inside the op, with
    its own backward), and with soft-capping, sinks, bidirectional blocks or dropout one masked call over the
    whole row (:func:`row_masked_varlen`, ``T × T`` scores). Either way the graph holds no break.
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})")
    if torch.compiler.is_compiling():
        if softcap is None and sinks is None and blocks is None and not dropout:
            return exact_varlen_op(query, key, value, cu_seq_lens_q, cu_seq_lens_k, causal,
                                   query.shape[-1] ** -0.5 if scale is None else scale, -1 if window is None else window)
        return row_masked_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, causal=causal, scale=scale,
                                 window=window, softcap=softcap, dropout=dropout, sinks=sinks, blocks=blocks)
    if cu_seq_lens_k is cu_seq_lens_q or (cu_seq_lens_k.shape == cu_seq_lens_q.shape
                                          and torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        return _self_attention_by_length(query, key, value, cu_seq_lens_q, causal=causal, scale=scale,
                                         window=window, softcap=softcap, dropout=dropout, sinks=sinks,
                                         blocks=blocks)
    if blocks is not None:
        raise ValueError("bidirectional blocks are for self-attention only (cu_seq_lens_k == cu_seq_lens_q)")
    return _cross_attention_by_shape(query, key, value, cu_seq_lens_q, cu_seq_lens_k, causal=causal, scale=scale,
                                     window=window, softcap=softcap, dropout=dropout, sinks=sinks)


def _cross_attention_by_shape(query, key, value, cu_seq_lens_q, cu_seq_lens_k, **options) -> torch.Tensor:
    """:func:`exact_varlen` when queries and keys have boundaries of their own (a shared row's segments and the keys
    each attends to): the examples of one shape ``(L_q, L_k)`` in one call. The queries are reordered once, group
    after group, and the keys and values gathered once (a key of several examples, a shared prompt's, once per
    example), each group a contiguous block of them; the outputs are put back in order with one more gather. So the
    backward is a few gathers and one scatter per tensor, not a full-size zero-filled gradient per group."""
    groups = list(_shape_groups(cu_seq_lens_q, cu_seq_lens_k, query.device))
    if not groups:
        return query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    order = torch.cat([index_q.reshape(-1) for index_q, _ in groups])
    keys = torch.cat([index_k.reshape(-1) for _, index_k in groups])
    whole = order.shape[0] == query.shape[0]  # every query in a group (no example without keys)
    inverse = torch.empty_like(order)
    if whole:
        inverse[order] = torch.arange(order.shape[0], device=order.device)
    queries = PermuteRows.apply(query, order, inverse) if whole else query.index_select(0, order)
    sizes_q, sizes_k = [index.numel() for index, _ in groups], [index.numel() for _, index in groups]
    outputs = []
    for (index_q, index_k), q, k, v in zip(groups, queries.split(sizes_q), key.index_select(0, keys).split(sizes_k),
                                           value.index_select(0, keys).split(sizes_k)):
        (m, length_q), length_k = index_q.shape, index_k.shape[1]
        q = q.view(m, length_q, *q.shape[1:]).transpose(1, 2)  # [m, H, L_q, D]
        k, v = (t.view(m, length_k, *t.shape[1:]).transpose(1, 2) for t in (k, v))
        out = attend(q, k, v, **options)
        outputs.append(out.transpose(1, 2).reshape(m * length_q, out.shape[1], out.shape[-1]))
    if whole:
        return PermuteRows.apply(torch.cat(outputs), inverse, order)  # [T, H, D]
    out = outputs[0].new_zeros(query.shape[0], query.shape[1], value.shape[-1])  # queries without keys: zeros
    return out.index_put((order,), torch.cat(outputs))


def _token_places(cu_seq_lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The example of each of ``total`` packed tokens and its place in it, from the boundaries with tensor ops only
    (``searchsorted``: nothing read on the host, a shape ``total`` that may be symbolic)."""
    bounds = cu_seq_lens.long()
    token = torch.arange(total, device=cu_seq_lens.device)
    example = torch.searchsorted(bounds[1:], token, right=True)
    return example, token - bounds.index_select(0, example)


def row_masked_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q=None, max_length_k=None, *,
                      causal, scale=None, window=None, softcap=None, dropout=0.0, sinks=None, blocks=None
                      ) -> torch.Tensor:
    """:func:`exact_varlen` as one masked ``scaled_dot_product_attention`` over the whole row: the ``[T_q, T_k]``
    mask (same example; causal and window distances with queries aligned to the end of their keys; bidirectional
    blocks) is built from the boundaries with tensor ops, so nothing is read on the host and ``torch.compile`` traces
    it whole (the max lengths are not read). Costs a ``T_q × T_k`` mask and scores, where the per-length calls cost
    ``Σ L²``: the compiled path of ``exact`` (CPU, CI); on a GPU the varlen kernels compile as they are."""
    example_q, place_q = _token_places(cu_seq_lens_q, query.shape[0])
    example_k, place_k = _token_places(cu_seq_lens_k, key.shape[0])
    offset = (cu_seq_lens_k.diff() - cu_seq_lens_q.diff()).long()  # keys before the first query (shared prefixes)
    distance = (place_q + offset.index_select(0, example_q))[:, None] - place_k[None, :]
    same = example_q[:, None] == example_k[None, :]
    ordered = distance >= 0 if causal else torch.ones_like(same)
    if blocks is not None:
        if query.shape[0] != key.shape[0]:
            raise ValueError("bidirectional blocks are for self-attention only (cu_seq_lens_k == cu_seq_lens_q)")
        ordered = ordered | ((blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0))
    allowed = same & ordered
    if window is not None:
        allowed = allowed & ((distance < window) if causal else (distance.abs() < window))
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, H, T, D]
    out = attend(q, k, v, causal=False, scale=scale, softcap=softcap, dropout=dropout, mask=allowed[None, None],
                 sinks=sinks)
    return out[0].transpose(0, 1)  # [T, H, D]


@torch.library.custom_op("padfree::exact_varlen", mutates_args=())
def exact_varlen_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens_q: torch.Tensor,
                    cu_seq_lens_k: torch.Tensor, causal: bool, scale: float, window: int) -> torch.Tensor:
    """:func:`exact_varlen` (causal or not, a ``window`` of ``-1`` for none) as one op a compiled graph calls: it
    runs eagerly inside (per-length calls, ``Σ L²`` work), so the graph needs neither the examples' lengths nor a
    ``T × T`` mask. Its backward is :func:`exact_varlen_backward`."""
    return exact_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, 0, 0, causal=causal, scale=scale,
                        window=None if window < 0 else window).contiguous()


@exact_varlen_op.register_fake
def _(query, key, value, cu_seq_lens_q, cu_seq_lens_k, causal, scale, window):
    return query.new_empty(query.shape[0], query.shape[1], value.shape[-1])


@torch.library.custom_op("padfree::exact_varlen_backward", mutates_args=())
def exact_varlen_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, causal: bool, scale: float,
                          window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`exact_varlen_op` for ``query``, ``key`` and ``value``, for each group of examples of
    one shape: on the CPU by the fused kernels sdpa uses there (the attention recomputed, then its backward); on other
    devices (or value heads narrower than the query's) recomputed and differentiated by hand, in float32 at least."""
    grads = [torch.zeros_like(t) for t in (query, key, value)]
    fused = query.device.type == "cpu" and query.shape[-1] == value.shape[-1]
    for index_q, index_k in _shape_groups(cu_seq_lens_q, cu_seq_lens_k, query.device):
        parts = (_attention_grads_cpu if fused else _attention_grads)(
            query[index_q], key[index_k], value[index_k], grad[index_q], causal, scale, None if window < 0 else window)
        for target, index, part in zip(grads, (index_q, index_k, index_k), parts):
            target[index] = part.to(target.dtype)
    return tuple(grads)


@exact_varlen_backward.register_fake
def _(grad, query, key, value, cu_seq_lens_q, cu_seq_lens_k, causal, scale, window):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _save_for_exact_varlen_backward(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.options = inputs[5:]


def _exact_varlen_op_backward(ctx, grad):
    grads = exact_varlen_backward(grad.contiguous(), *ctx.saved_tensors, *ctx.options)
    return *grads, None, None, None, None, None


exact_varlen_op.register_autograd(_exact_varlen_op_backward, setup_context=_save_for_exact_varlen_backward)


def _shape_groups(cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, device: torch.device):
    """For each shape ``(L_q, L_k)`` of the row's examples, the token indices of its examples' queries and keys,
    ``[m, L_q]`` and ``[m, L_k]`` (read on the host, inside an op); empty examples, which have no gradient, left
    out."""
    bounds_q, bounds_k = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(bounds_q) - 1):
        groups.setdefault((bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]), []).append(i)
    for (length_q, length_k), members in groups.items():
        if not (length_q and length_k):
            continue
        starts_q = torch.tensor([bounds_q[i] for i in members], device=device)
        starts_k = torch.tensor([bounds_k[i] for i in members], device=device)
        yield (starts_q[:, None] + torch.arange(length_q, device=device),
               starts_k[:, None] + torch.arange(length_k, device=device))


def _attention_grads_cpu(q, k, v, grad, causal: bool, scale: float, window: int | None):
    """:func:`_attention_grads` by ATen's CPU flash-attention kernels (forward recomputed for its log-sum-exp, then
    its backward): 2-3× faster than by hand on long examples."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    repeat = q.shape[2] // k.shape[2]
    q, k, v, grad = (t.transpose(1, 2) for t in (q, k.repeat_interleave(repeat, dim=2),
                                                  v.repeat_interleave(repeat, dim=2), grad))  # [m, H, L, D]
    mask = segment_mask(q.shape[2], k.shape[2], causal, window, q.device)
    flag = causal and mask is None and q.shape[2] > 1
    bias = None if mask is None else q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out, logsumexp = flash(q, k, v, 0.0, flag, attn_mask=bias, scale=scale)
    dq, dk, dv = flash_backward(grad.contiguous(), q, k, v, out, logsumexp, 0.0, flag, attn_mask=bias, scale=scale)
    fold = (dk.shape[0], k.shape[2], dk.shape[1] // repeat, repeat, dk.shape[-1])
    return (dq.transpose(1, 2), dk.transpose(1, 2).reshape(fold).sum(3),
            dv.transpose(1, 2).reshape(*fold[:4], dv.shape[-1]).sum(3))


def _attention_grads(q, k, v, grad, causal: bool, scale: float, window: int | None):
    """``(dq, dk, dv)`` of ``softmax(q kᵀ · scale, masked) v`` for ``[m, L, H, D]`` examples (``k`` / ``v`` with
    ``H_kv`` heads, GQA: their gradients summed over the query heads that share them), queries aligned to the end of
    their keys as :func:`segment_mask` aligns them."""
    work = torch.promote_types(q.dtype, torch.float32)
    q, k, v, grad = (t.to(work) for t in (q, k, v, grad))
    repeat = q.shape[2] // k.shape[2]
    k_all, v_all = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_all) * scale
    mask = segment_mask(q.shape[1], k.shape[1], causal, window, q.device, always=True)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, grad)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", grad, v_all)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True)) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k_all)
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q)
    fold = (*k.shape[:2], k.shape[2], repeat)
    return dq, dk.reshape(*fold, dk.shape[-1]).sum(3), dv.reshape(*fold, dv.shape[-1]).sum(3)


def _self_attention_by_length(query, key, value, cu_seq_lens, blocks=None, **options) -> torch.Tensor:
    """:func:`exact_varlen` when queries and keys share their boundaries (self-attention, the usual case).

    The tokens are reordered once so that examples of equal length sit together (one ``index_select`` per
    tensor), each length group is a contiguous block viewed as ``[examples, L, H, D]`` (``split``, no copy),
    and the output is put back in order with one more ``index_select``. The backward pass is then a few
    gathers and one ``cat`` instead of a zero-filled full-size gradient per example slice.
    """
    perm, inverse, groups = length_groups(cu_seq_lens)
    perm, inverse = perm.to(query.device), inverse.to(query.device)
    sizes = [n * m for n, m in groups]
    q_groups, k_groups, v_groups = (torch.split(PermuteRows.apply(t, perm, inverse), sizes)
                                    for t in (query, key, value))
    b_groups = torch.split(blocks.index_select(0, perm), sizes) if blocks is not None else [None] * len(groups)
    outputs = []
    for (n, m), q, k, v, b in zip(groups, q_groups, k_groups, v_groups, b_groups):
        q, k, v = (t.view(m, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [m, H, n, D]
        out = attend(q, k, v, blocks=None if b is None else b.view(m, n), **options)
        outputs.append(out.transpose(1, 2).reshape(m * n, out.shape[1], out.shape[-1]))  # [m * n, H, D]
    return PermuteRows.apply(torch.cat(outputs), inverse, perm)  # [T, H, D]


class PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation: the backward is the inverse gather (no scatter-add, no zero fill)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


# -- re-padded attention (any device, any dtype, a fixed number of kernels) --------------------------------------


def padded_slots(cu_seq_lens: torch.Tensor, total: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the ``total`` packed tokens, its row in a ``[n * longest]`` right-padded layout, and each
    example's length. Device-side and sync-free: sizes come from shapes and ``longest`` (a python int)."""
    starts, lengths = cu_seq_lens[:-1].long(), cu_seq_lens.diff().long()
    example = token_examples(cu_seq_lens, total)
    position = torch.arange(total, device=cu_seq_lens.device) - starts[example]
    return example * longest + position, lengths


def repad_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, *,
                 causal, scale=None, window=None, softcap=None, dropout=0.0, sinks=None, blocks=None) -> torch.Tensor:
    """Exact attention with one masked ``scaled_dot_product_attention`` call: queries, keys and values are
    scattered into a right-padded ``[n, L_max, H, D]`` view for attention alone (every other layer stays packed),
    padded keys are masked out, and the output is gathered back to ``[T, H, D]``.

    The number of kernels does not grow with the number of examples and nothing is read on the host, which suits
    GPUs for inputs the varlen kernels cannot take (fp32): attention costs what it costs in a padded batch
    (``n × L_max²``) and everything else runs on real tokens only, so a step is never slower than padded, where
    :func:`exact_varlen`'s per-length calls (dozens for a batch of short texts) can be. On a CPU, where kernel
    launches are cheap, :func:`exact_varlen` is much faster for mixed lengths (8× on a bs64 batch of short
    texts), which is why ``repad`` is registered for accelerators only. Queries and keys are aligned at each example's
    start: self-attention, where an example has as many keys as queries (what packed training runs).
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})")
    slots_q, lengths_q = padded_slots(cu_seq_lens_q, query.shape[0], max_length_q)
    slots_k, lengths_k = (slots_q, lengths_q) if cu_seq_lens_k is cu_seq_lens_q else \
        padded_slots(cu_seq_lens_k, key.shape[0], max_length_k)
    n = lengths_q.numel()

    def padded(x: torch.Tensor, slots: torch.Tensor, longest: int) -> torch.Tensor:  # [n, H, L, D]
        grid = x.new_zeros(n * longest, *x.shape[1:]).index_copy(0, slots, x)
        return grid.view(n, longest, *x.shape[1:]).transpose(1, 2)

    q = padded(query, slots_q, max_length_q)
    k, v = (padded(t, slots_k, max_length_k) for t in _expand_kv(key, value, query.shape[1]))
    keys = torch.arange(max_length_k, device=query.device)
    real_key = keys[None, :] < lengths_k[:, None]  # [n, Lk]
    padding_query = torch.arange(max_length_q, device=query.device)[None, :] >= lengths_q[:, None]  # [n, Lq]
    # a padding query may see every key: its row is never read, and a fully masked row would be NaN in backward
    mask = (real_key[:, None, :] | padding_query[:, :, None])[:, None]  # [n, 1, Lq, Lk]
    if blocks is not None:  # padding in no block; self-attention: the keys are the queries' tokens
        if max_length_k != max_length_q or key.shape[0] != query.shape[0]:
            raise ValueError("bidirectional blocks are for self-attention only (cu_seq_lens_k == cu_seq_lens_q)")
        blocks = blocks.new_full((n * max_length_q,), -1).index_copy(0, slots_q, blocks).view(n, max_length_q)
    out = attend(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, dropout=dropout, mask=mask,
                 sinks=sinks, blocks=blocks)
    return out.transpose(1, 2).reshape(n * max_length_q, *out.shape[1:2], out.shape[-1]).index_select(0, slots_q)


# -- FlashAttention kernels: one head dim for queries, keys and values -------------------------------------------


def one_head_dim(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None):
    """``(query, key, value, scale, crop)`` for a kernel that takes one head dim for all three (FlashAttention):
    MLA's value head dim differs from the query's (DeepSeek-V3: 128 vs 192), so values are zero-padded to the
    query's dim (or queries and keys to the value's) and the output is cropped back to the value's dim with
    ``crop``; ``scale`` is fixed from the query's own dim first. Zero columns change no score and no output value."""
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if qk_dim == v_dim:
        return query, key, value, scale, lambda out: out
    scale = qk_dim ** -0.5 if scale is None else scale
    if v_dim < qk_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    else:
        query, key = F.pad(query, (0, v_dim - qk_dim)), F.pad(key, (0, v_dim - qk_dim))
    return query, key, value, scale, lambda out: out[..., :v_dim]


# -- torch varlen_attn (CUDA, FlashAttention-2 inside ATen) -----------------------------------------------------


def _torch_varlen_parameters() -> frozenset[str]:
    """The parameters of torch's ``varlen_attn`` (read per call, as ``torch.compile`` traces it; a cache would not
    be traced)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_unavailable() -> str | None:
    """Why ``torch.nn.attention.varlen.varlen_attn`` cannot be used here, or ``None``."""
    try:
        _torch_varlen_parameters()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
    if not torch.cuda.is_available():
        return "varlen_attn runs on CUDA only and no CUDA device is available"
    return None


def torch_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, *,
                 causal, scale=None, window=None, softcap=None, dropout=0.0):
    """``torch.nn.attention.varlen.varlen_attn`` (no soft-capping, no dropout)."""
    from torch.nn.attention.varlen import varlen_attn

    if softcap is not None or dropout:
        raise BackendUnavailableError(
            "the 'varlen' backend implements neither attention soft-capping nor attention dropout; "
            "use attention: flash_attn or exact, or set the model's attention dropout to 0"
        )
    parameters = _torch_varlen_parameters()
    query, key, value, scale, crop = one_head_dim(query, key, value, scale)
    extra = {}
    if "window_size" in parameters:
        left = window - 1 if window is not None else -1
        extra["window_size"] = (left, 0 if causal else left)
    else:
        if window is not None:
            raise BackendUnavailableError(f"varlen_attn of torch {torch.__version__} has no sliding window")
        extra["is_causal"] = causal
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in parameters:
            extra["enable_gqa"] = True
        else:
            key, value = _expand_kv(key, value, query.shape[1])
    return crop(varlen_attn(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                            scale=scale, **extra))


# -- flash-attn package ------------------------------------------------------------------------------------------


def flash_attn_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return ("flash_attn runs on CUDA GPUs only and no CUDA device is available (on a CPU use attention: auto or "
                "exact)")
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash_attn package is not installed (pip install flash-attn; CUDA only)"
    return None


def flash_attn_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, *,
                      causal, scale=None, window=None, softcap=None, dropout=0.0):
    """``flash_attn.flash_attn_varlen_func`` (GQA, windows, soft-capping and dropout supported)."""
    from flash_attn import flash_attn_varlen_func

    query, key, value, scale, crop = one_head_dim(query, key, value, scale)
    left = window - 1 if window is not None else -1
    return crop(flash_attn_varlen_func(
        query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
        dropout_p=dropout, softmax_scale=scale, causal=causal,
        window_size=(left, 0 if causal else left), softcap=softcap or 0.0,
    ))
