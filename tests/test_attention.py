"""Attention backends on raw tensors: each equals attention computed example by example with an explicit mask."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from padfree_plugins.errors import BackendUnavailableError
from padfree_plugins.modeling.attention import backends


def reference(q, k, v, lengths, *, causal, scale=None, window=None, softcap=None):
    """Plain eager attention per example: [T, H, D] in, [T, H, D] out."""
    outs, start = [], 0
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        scores = qs @ ks.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(n)
        allowed = torch.ones(n, n, dtype=torch.bool)
        if causal:
            allowed &= i[:, None] >= i[None, :]
        if window:
            allowed &= (i[:, None] - i[None, :]).abs() < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_inputs(lengths, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


CASES = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "causal-window": dict(causal=True, window=3),
    "bidirectional-window": dict(causal=False, window=2),
    "softcap": dict(causal=True, softcap=2.0),
    "softcap-window": dict(causal=True, softcap=1.5, window=4),
    "scale": dict(causal=True, scale=0.3),
}


#: The kernels that run on any device (``repad`` is registered for accelerators only, but computes anywhere).
#: ``row_masked``: ``exact``'s compiled path (one masked call over the whole row, built with tensor ops only).
EXACT_KERNELS = {"exact": backends.exact_varlen, "repad": backends.repad_varlen,
                 "row_masked": backends.row_masked_varlen}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [5, 5, 5], [1, 17, 3, 8, 8, 2]])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kernel", EXACT_KERNELS.values(), ids=EXACT_KERNELS.keys())
def test_exact_kernels_match_reference(kernel, case, lengths, kv_heads):
    q, k, v, cu, longest = packed_inputs(lengths, kv_heads=kv_heads)
    got = kernel(q, k, v, cu, cu.clone(), longest, longest, **case)
    torch.testing.assert_close(got, reference(q, k, v, lengths, **case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [CASES["causal-window"], CASES["bidirectional"], CASES["softcap-window"]],
                         ids=["causal-window", "bidirectional", "softcap-window"])
@pytest.mark.parametrize("kernel", EXACT_KERNELS.values(), ids=EXACT_KERNELS.keys())
def test_exact_kernels_gradients_match_reference(kernel, case):
    lengths = [3, 9, 1, 9]
    q, k, v, cu, longest = packed_inputs(lengths)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    kernel(*inputs, cu, cu, longest, longest, **case).sum().backward()
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    reference(*ref_inputs, lengths, **case).sum().backward()
    for got, want in zip(inputs, ref_inputs):
        assert torch.isfinite(got.grad).all()  # repad: padding rows never poison the key / value gradients
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", EXACT_KERNELS.values(), ids=EXACT_KERNELS.keys())
def test_exact_kernels_apply_dropout_when_asked(kernel):
    q, k, v, cu, longest = packed_inputs([6, 6])
    plain = kernel(q, k, v, cu, cu, longest, longest, causal=False)
    torch.manual_seed(0)
    dropped = kernel(q, k, v, cu, cu, longest, longest, causal=False, dropout=0.5)
    assert not torch.allclose(plain, dropped)


def test_varlen_refuses_softcap_and_dropout():
    q, k, v, cu, longest = packed_inputs([4])
    with pytest.raises(BackendUnavailableError, match="soft-capping"):
        backends.torch_varlen(q, k, v, cu, cu, longest, longest, causal=True, softcap=2.0)


def test_backend_availability_reasons_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("reasons differ when CUDA is present")
    assert "CUDA" in backends.torch_varlen_unavailable()
    assert backends.flash_attn_unavailable()  # not installed, or no CUDA


def test_flash_attn_argument_mapping(monkeypatch):
    """The flash_attn backend hands flash_attn_varlen_func the arguments flash-attn documents."""
    calls = {}

    def fake_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap):
        calls.update(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                     softcap=softcap, max_q=max_q)
        return backends.exact_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=softmax_scale,
                                     window=None if window_size[0] < 0 else window_size[0] + 1,
                                     softcap=softcap or None)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_varlen_func))
    lengths = [5, 2, 7]
    q, k, v, cu, longest = packed_inputs(lengths)
    got = backends.flash_attn_varlen(q, k, v, cu, cu, longest, longest, causal=True, scale=0.5, window=3,
                                     softcap=None)
    assert calls == dict(dropout_p=0.0, softmax_scale=0.5, causal=True, window_size=(2, 0), softcap=0.0, max_q=7)
    torch.testing.assert_close(got, reference(q, k, v, lengths, causal=True, scale=0.5, window=3))
    backends.flash_attn_varlen(q, k, v, cu, cu, longest, longest, causal=False, window=3)
    assert calls["window_size"] == (2, 2) and calls["causal"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=False), dict(causal=True, window=16)])
def test_torch_varlen_matches_exact_on_gpu(case):
    lengths = [1, 200, 37, 64, 5]
    q, k, v, cu, longest = (t.cuda() if torch.is_tensor(t) else t for t in packed_inputs(lengths, dim=64))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    got = backends.torch_varlen(q, k, v, cu, cu, longest, longest, **case)
    want = backends.exact_varlen(q.float(), k.float(), v.float(), cu, cu, longest, longest, **case)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
