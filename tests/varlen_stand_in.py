"""A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` (CUDA only): a custom op with its own backward, as
the real one is, that runs each example alone. With it patched in (:func:`install`), the built-in ``varlen``
backend's own wrapper (``backends.torch_varlen``) runs and compiles on a CPU, with the host-side metadata it takes
from the batch: ``cu_seq_lens`` tensors and the max lengths as python ints, which the op checks against the
boundaries (a wrong or stale max length fails the call, as it would corrupt a CUDA kernel's grid)."""

from __future__ import annotations

import torch

from padfree_plugins.contract.declarations import FEATURES, AttentionBackend
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.modeling.attention import backends
from padfree_plugins.modeling.attention.backends import segment_mask


def _examples(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int):
    """Each example's ``(q0, q1), (k0, k1)``; a kernel may read its boundaries (it stands in for a CUDA one)."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    longest = (max(b - a for a, b in zip(bounds_q, bounds_q[1:])), max(b - a for a, b in zip(bounds_k, bounds_k[1:])))
    if (max_q, max_k) != longest:
        raise ValueError(f"varlen_attn given max lengths {(max_q, max_k)}, the boundaries say {longest}")
    return zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]))


def _probs(q, k, scale, left, right):
    """``[H, Lq, Lk]`` attention probabilities of one example (window ``(left, right)`` as varlen_attn takes it)."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = segment_mask(q.shape[0], k.shape[0], right == 0, None if left < 0 else left + 1, q.device, always=True)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


@torch.library.custom_op("padfree_test::varlen_attn", mutates_args=())
def varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
              max_q: int, max_k: int, scale: float, left: int, right: int) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for (q0, q1), (k0, k1) in _examples(cu_q, cu_k, max_q, max_k):
        out[q0:q1] = torch.einsum("hqk,khd->qhd", _probs(q[q0:q1], k[k0:k1], scale, left, right), v[k0:k1])
    return out


@varlen_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("padfree_test::varlen_attn_backward", mutates_args=())
def varlen_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, scale: float, left: int, right: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in _examples(cu_q, cu_k, max_q, max_k):
        probs, g = _probs(q[q0:q1], k[k0:k1], scale, left, right), grad[q0:q1]
        dv[k0:k1] = torch.einsum("hqk,qhd->khd", probs, g)
        dprobs = torch.einsum("qhd,khd->hqk", g, v[k0:k1])
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True)) * scale
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", dscores, k[k0:k1])
        dk[k0:k1] = torch.einsum("hqk,qhd->khd", dscores, q[q0:q1])
    return dq, dk, dv


@varlen_backward_op.register_fake
def _(grad, q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.options = inputs[5:]


def _backward(ctx, grad):
    dq, dk, dv = varlen_backward_op(grad.contiguous(), *ctx.saved_tensors, *ctx.options)
    return dq, dk, dv, *([None] * 7)


varlen_op.register_autograd(_backward, setup_context=_setup)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """``torch.nn.attention.varlen.varlen_attn``'s signature, on the CPU."""
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return varlen_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, *window_size)


class CpuVarlen:
    """A plugin that registers the built-in ``varlen`` backend's wrapper as ``cpu_varlen``, for CPU devices."""

    @hookimpl
    def register_attention_backends(self):
        return [AttentionBackend("cpu_varlen", backends.torch_varlen, devices=("cpu",),
                                 features=frozenset(FEATURES) - {"softcap", "dropout"})]


def install(monkeypatch) -> CpuVarlen:
    """Patch the stand-in in for torch's ``varlen_attn``; returns the plugin to give a ``PluginHost``."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)
    return CpuVarlen()
