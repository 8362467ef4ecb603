"""MLA (DeepSeek-V2/V3, Kimi-K2): the value head dim differs from the query's. The FlashAttention kernels take one
head dim, so `varlen` / `flash_attn` pad values (or queries and keys) with zeros and crop the output
(backends.one_head_dim); checked here on the CPU with the exact kernel standing in for one that needs equal dims."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins.modeling.attention.backends import exact_varlen, one_head_dim


def equal_dims_only(query, key, value, *args, **kwargs):
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], "this kernel takes one head dim"
    return exact_varlen(query, key, value, *args, **kwargs)


@pytest.mark.parametrize("qk_dim,v_dim", [(24, 12), (12, 24), (16, 16)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_padding_to_one_head_dim_changes_nothing(qk_dim, v_dim, scale):
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 6, 6, 11]
    total = sum(lengths)
    q, k = (torch.randn(total, heads, qk_dim, generator=generator) for heads in (4, 2))
    v = torch.randn(total, 2, v_dim, generator=generator)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want = exact_varlen(q, k, v, cu, cu, 11, 11, causal=True, scale=scale, window=4)
    padded_q, padded_k, padded_v, fixed_scale, crop = one_head_dim(q, k, v, scale)
    got = crop(equal_dims_only(padded_q, padded_k, padded_v, cu, cu, 11, 11, causal=True, scale=fixed_scale,
                               window=4))
    assert got.shape == want.shape == (total, 4, v_dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
