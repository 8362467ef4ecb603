"""The 2025-26 decoder families of tests/test_decoders.py: what makes each special is really switched on in its tiny
config and changes the outputs, the exact kernels take MLA's value head dim, and the packed-vs-padded check catches
a leak of 1e-3 across example boundaries in an MLA and a MoE family.

The equivalence itself (loss, logits, gradients, MoE auxiliary losses) is tests/test_decoders.py's, over DECODERS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from padfree_plugins import UnsupportedArchitectureError, assemble, patch_of
from padfree_plugins.modeling.attention.backends import exact_varlen, repad_varlen, row_masked_varlen
from padfree_plugins.testing import leak_across_boundaries
from tests.conftest import make_examples
from tests.test_decoders import (
    DECODERS,
    LENGTHS,
    assert_packed_logits_equal_padded,
    causal_lm,
    outputs_and_grads,
    packed_logits,
    padded_batch,
)

MLA_FAMILIES = ["deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe_lite"]
WINDOWED_FAMILIES = ["gemma3n", "gemma4", "ministral3", "exaone4"]


def tiny(name: str, **changes):
    model_type, overrides = DECODERS[name]
    return causal_lm(model_type, **{**overrides, **changes})


# -- multi-head latent attention: the value head dim differs from the query's ------------------------------------


@pytest.mark.parametrize("name", MLA_FAMILIES)
def test_mla_attention_gets_a_value_head_dim_other_than_the_query(name):
    """The tiny MLA configs give queries and keys 16 + 8 dims and values 12, as the released models do (192 / 128)."""
    model = tiny(name)
    attention = model.model.layers[0].self_attn
    assert (attention.qk_head_dim, attention.v_head_dim) == (24, 12)
    assert attention.o_proj.in_features == model.config.num_attention_heads * 12


def reference_attention(q, k, v, cu, window=None):
    """Each example alone through sdpa ([T, H, D] in and out), GQA by repeating heads; ``window`` as transformers'."""
    pieces = []
    for start, end in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
        repeat = qi.shape[0] // ki.shape[0]
        ki, vi = ki.repeat_interleave(repeat, 0), vi.repeat_interleave(repeat, 0)
        length = end - start
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        allowed = distance >= 0
        if window is not None:
            allowed &= distance < window
        pieces.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=0.3).transpose(0, 1))
    return torch.cat(pieces)


@pytest.mark.parametrize("kernel", [exact_varlen, repad_varlen, row_masked_varlen],
                         ids=["exact", "repad", "row_masked"])
@pytest.mark.parametrize("window", [None, 4])
def test_exact_kernels_take_a_value_head_dim_other_than_the_query(kernel, window):
    """exact and repad (run here on CPU tensors) return [T, H, D_v] for MLA-shaped inputs, equal to each example
    alone, outputs and gradients, with GQA and a window shorter than the long examples."""
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(total, 4, 24, generator=generator, requires_grad=True)
    k = torch.randn(total, 2, 24, generator=generator, requires_grad=True)
    v = torch.randn(total, 2, 12, generator=generator, requires_grad=True)
    got = kernel(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=True, scale=0.3, window=window)
    want = reference_attention(q, k, v, cu.tolist(), window)
    assert got.shape == (total, 4, 12)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    weights = torch.randn(want.shape, generator=generator)
    got_grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


# -- what the tiny configs switch on really changes the outputs ------------------------------------------------


@pytest.mark.parametrize("name", WINDOWED_FAMILIES)
def test_sliding_windows_shorter_than_the_examples_change_the_outputs(name):
    examples = make_examples([20, 13, 9])
    assert DECODERS[name][1]["sliding_window"] == 4 < max(LENGTHS)
    windowed = packed_logits(tiny(name).eval(), examples)
    unwindowed = packed_logits(tiny(name, sliding_window=64).eval(), examples)
    assert (windowed - unwindowed).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["ministral3", "mistral4"])
def test_llama4_query_scaling_grows_inside_the_long_examples(name):
    """Llama 4's query scale ``1 + beta * log(1 + floor(position / 8))`` changes the outputs of examples longer than
    8 tokens; the equivalence test then proves that it restarts with every packed example (position_ids)."""
    examples = make_examples([20, 13, 9])
    _, overrides = DECODERS[name]
    unscaled = {**overrides["rope_parameters"], "llama_4_scaling_beta": 0.0}
    scaled = packed_logits(tiny(name).eval(), examples)
    plain = packed_logits(tiny(name, rope_parameters=unscaled).eval(), examples)
    difference = (scaled - plain).abs().amax(dim=-1)[0]  # per token
    assert difference[8:20].max() > 1e-4 and difference[:8].max() < 1e-6  # positions 0-7: scale 1


@pytest.mark.parametrize("name", ["gemma3n", "gemma4"])
def test_kv_sharing_and_per_layer_embeddings_are_on(name):
    """The last layer reuses the keys and values of an earlier layer of its type (no k/v projections of its own),
    and every layer gets its per-layer embedding."""
    model = tiny(name)
    layers = model.model.layers
    assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [False, False, True]
    assert not hasattr(layers[2].self_attn, "k_proj") and model.model.embed_tokens_per_layer is not None


def test_gemma4_global_layers_have_their_own_head_dim_and_values_from_keys():
    model = tiny("gemma4")
    full, sliding = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert (full.head_dim, sliding.head_dim, full.sliding_window, sliding.sliding_window) == (32, 16, None, 4)
    assert full.v_proj is None and sliding.v_proj is not None  # attention_k_eq_v: global values are the keys


def test_gemma4_with_global_key_value_heads_trains_exactly():
    """The released 26B / 31B models give the global layers their own key/value heads (``num_global_key_value_heads``
    with ``attention_k_eq_v``): a heterogeneous per-layer config, whose global ``num_key_value_heads`` transformers
    refuses to read (AmbiguousGlobalPerLayerAttributeError). Planning reads every layer's; the packed loss, logits
    and gradients equal padded."""
    model = tiny("gemma4", num_global_key_value_heads=1).train()
    assert model.model.layers[0].self_attn.k_proj.out_features == 32  # one key/value head of 32 dims
    examples = make_examples(LENGTHS, seed=1)
    want_loss, want_logits, want_grads = outputs_and_grads(model, padded_batch(examples))
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        assert "gqa" in assembly.plan.features
        batch = assembly.collator(examples)
        got_loss, got_logits, got_grads = outputs_and_grads(model, assembly.forward.inputs(batch))
    finally:
        assembly.undo()
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_packed_logits_equal_padded(got_logits, want_logits, batch)
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def test_gemma4_all_bidirectional_is_refused_not_run_with_another_window():
    """With ``use_bidirectional_attention="all"`` transformers' sdpa mask lets a sliding layer see distance <= w while
    the layer passes w to attention as flash attention reads it (distance < w): refused, the model left unpatched."""
    model = tiny("gemma4", use_bidirectional_attention="all")
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention='all' cannot run padding-free"):
        assemble(model, {"task": "causal_lm"})
    assert patch_of(model) is None and model.config._attn_implementation == "sdpa"


# -- the check catches a leak across example boundaries ----------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_v3", "olmoe"])
def test_a_1e3_leak_across_boundaries_fails_the_packed_vs_padded_check(name):
    """The packed-vs-padded check of tests/test_decoders.py (loss, per-example logits, gradients) fails for an MLA
    and a MoE family when, after the first layer, the first token of every example but the first gets 1e-3 × the
    previous example's last hidden state; without the leak (strength 0, same hooks) it passes."""
    model = tiny(name).train()
    examples = make_examples(LENGTHS, seed=1)
    want_loss, want_logits, _ = outputs_and_grads(model, padded_batch(examples))
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = assembly.collator(examples)
        inputs = assembly.forward.inputs(batch)
        with leak_across_boundaries(model, strength=0.0):
            exact_loss, exact_logits, _ = outputs_and_grads(model, inputs)
        with leak_across_boundaries(model, strength=1e-3):
            leaky_loss, leaky_logits, _ = outputs_and_grads(model, inputs)
    finally:
        assembly.undo()
    torch.testing.assert_close(exact_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_packed_logits_equal_padded(exact_logits, want_logits, batch)
    with pytest.raises(AssertionError, match="example [1-5]: Tensor-likes are not close"):
        assert_packed_logits_equal_padded(leaky_logits, want_logits, batch)
