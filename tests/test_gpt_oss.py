"""gpt-oss: attention sinks (``s_aux``: a learned logit per head in every softmax) in the exact and repad backends,
sliding-window layers alternating with full ones, a mixture of experts — packed training equals padded, and a
backend without sinks is never picked or is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from padfree_plugins import BackendUnavailableError, assemble, plan
from padfree_plugins.modeling.attention.backends import attend, exact_varlen, repad_varlen, row_masked_varlen
from tests.conftest import make_examples, tiny_config
from tests.test_decoders import loss_and_grads, padded_batch
from tests.ties import assert_same_greedy, greedy

GPT_OSS = dict(num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
               layer_types=["sliding_attention", "full_attention"], output_router_logits=True,
               router_aux_loss_coef=0.1)
LENGTHS = [1, 13, 6, 20, 2, 6]


def gpt_oss(seed: int = 0, **overrides):
    """A tiny gpt-oss with sinks large enough to take a real share of every softmax (zero-initialised sinks would
    change almost nothing)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss", **{**GPT_OSS, **overrides}),
                                             attn_implementation="eager")  # transformers has no sdpa path for sinks
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator) * 2)
    return model


def test_packed_loss_and_gradients_equal_padded_with_sinks_window_and_experts():
    model = gpt_oss().train()
    examples = make_examples(LENGTHS, seed=1)
    want_loss, want_grads = loss_and_grads(model, padded_batch(examples))
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        assert assembly.plan.architecture_plugin == "gpt_oss" and "sinks" in assembly.plan.features
        got_loss, got_grads = loss_and_grads(model, assembly.forward.inputs(assembly.collator(examples)))
    finally:
        assembly.undo()
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert any("sinks" in key for key in want_grads) and want_grads.keys() == got_grads.keys()
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def test_sinks_and_window_really_change_the_outputs():
    examples = make_examples([20, 13, 9])

    def logits(model):
        assembly = assemble(model.eval(), {"task": "causal_lm"})
        try:
            with torch.no_grad():
                return model(**assembly.forward.inputs(assembly.collator(examples))).logits
        finally:
            assembly.undo()

    reference = logits(gpt_oss())
    without_sinks = gpt_oss()
    with torch.no_grad():
        for layer in without_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no probability is no sink
    assert (reference - logits(without_sinks)).abs().max() > 1e-3
    assert (reference - logits(gpt_oss(sliding_window=64))).abs().max() > 1e-3


def test_a_padded_batch_and_generate_still_work_after_patching():
    model = gpt_oss().eval()
    examples = make_examples([5, 9])
    padded = padded_batch(examples)
    prompt = torch.tensor([examples[0]["input_ids"]])
    with torch.no_grad():
        want = model(**padded, use_cache=False).logits
        generated, gaps = greedy(model, prompt, max_new_tokens=4, pad_token_id=1)
        assembly = assemble(model, {"task": "causal_lm"})
        try:
            torch.testing.assert_close(model(**padded, use_cache=False).logits, want, atol=1e-5, rtol=1e-5)
            assert_same_greedy(model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=1), generated,
                               gaps)
        finally:
            assembly.undo()


@pytest.mark.parametrize("backend", ["varlen", "flash_attn"])
def test_a_backend_without_sinks_is_refused_by_name(backend):
    with pytest.raises(BackendUnavailableError, match=backend):
        plan(tiny_config("gpt_oss", **GPT_OSS), {"task": "causal_lm", "attention": backend}, device_type="cuda")


def test_auto_never_picks_a_backend_without_sinks_on_a_gpu():
    resolved = plan(tiny_config("gpt_oss", **GPT_OSS), {"task": "causal_lm"}, device_type="cuda")
    assert "sinks" in resolved.backend.features and resolved.backend.name in ("exact", "repad")


def test_kernels_with_sinks_equal_the_eager_reference():
    """exact, its compiled path and repad with sinks equal transformers' eager softmax-with-a-sink-column, per
    example."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    lengths = [1, 5, 5, 9]
    q, k, v = (torch.randn(sum(lengths), heads, 8, generator=generator) for heads in (4, 2, 2))
    sinks = torch.randn(4, generator=generator)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = end - start
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out, _ = eager_attention_forward(module, *(t[start:end].transpose(0, 1)[None] for t in (q, k, v)), mask,
                                         scaling=8 ** -0.5)
        pieces.append(out[0])
    want = torch.cat(pieces)
    for kernel in (exact_varlen, row_masked_varlen, repad_varlen):
        got = kernel(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, scale=8 ** -0.5, sinks=sinks)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{kernel.__name__}: {m}")
    plain = attend(*(t[None].transpose(1, 2) for t in (q, k, v)), causal=True, scale=8 ** -0.5)
    with_sinks = attend(*(t[None].transpose(1, 2) for t in (q, k, v)), causal=True, scale=8 ** -0.5, sinks=sinks)
    assert (plain - with_sinks).abs().max() > 1e-2
