"""LFM2 / LFM2-MoE: the gated short convolution restarts at every example of a packed row, so packed training
equals padded (right padding: a causal conv only looks back, so the padded reference is itself exact per
example), with examples shorter than the kernel, a batch of one, MoE routing — and a convolution leaking
one token across a boundary is caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from padfree_plugins import BoundaryError, assemble, patch_of
from padfree_plugins.builtin.architectures import lfm2
from padfree_plugins.modeling.mixers import boundary_causal_conv1d
from tests.conftest import make_examples, tiny_config
from tests.test_decoders import loss_and_grads, padded_batch
from tests.ties import assert_same_greedy, greedy

LFM2 = {
    "lfm2": dict(num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3),
    "lfm2_moe": dict(num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3,
                     num_experts=4, num_experts_per_tok=2, num_dense_layers=1, moe_intermediate_size=32),
}
LENGTHS = [1, 2, 13, 6, 20, 3]  # shorter than the kernel (3), equal to it, longer


def model_of(model_type: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **{**LFM2[model_type], **overrides}),
                                            attn_implementation="sdpa")


def packed_loss_and_grads(model, examples):
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        assert assembly.plan.architecture_plugin == "lfm2"
        return loss_and_grads(model, assembly.forward.inputs(assembly.collator(examples)))
    finally:
        assembly.undo()


@pytest.mark.parametrize("model_type", LFM2)
@pytest.mark.parametrize("lengths", [LENGTHS, [17]], ids=["mixed", "batch-of-one"])
def test_packed_loss_and_gradients_equal_padded(model_type, lengths):
    model = model_of(model_type).train()
    examples = make_examples(lengths, seed=1)
    want_loss, want_grads = loss_and_grads(model, padded_batch(examples))
    got_loss, got_grads = packed_loss_and_grads(model, examples)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys() and any("conv.weight" in key for key in want_grads)
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def test_moe_routing_matches_padded():
    """LFM2-MoE's routers (no load-balancing loss in transformers 5.23: ``aux_loss`` is None padded too) route
    every real token as padded: the logits of every example are equal."""
    model = model_of("lfm2_moe").eval()
    examples = make_examples(LENGTHS, seed=2)
    padded_inputs = padded_batch(examples)
    with torch.no_grad():
        padded = model(**padded_inputs, use_cache=False)
        assembly = assemble(model, {"task": "causal_lm"})
        try:
            batch = assembly.collator(examples)
            packed = model(**batch.model_inputs())
        finally:
            assembly.undo()
    assert padded.aux_loss is None and packed.aux_loss is None
    cu = batch["cu_seq_lens_q"].tolist()
    for i, n in enumerate(len(ex["input_ids"]) for ex in examples):
        torch.testing.assert_close(packed.logits[0, cu[i] : cu[i] + n], padded.logits[i, :n], atol=1e-5, rtol=1e-5)


def test_the_conv_is_exact_per_example_and_vectorised():
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 9, 4]
    x = torch.randn(1, 8, sum(lengths), generator=generator)
    weight, bias = torch.randn(8, 3, generator=generator), torch.randn(8, generator=generator)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = boundary_causal_conv1d(x, weight, bias, cu)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = F.conv1d(x[..., start:end], weight[:, None], bias, padding=2, groups=8)[..., : end - start]
        torch.testing.assert_close(got[..., start:end], alone, atol=1e-6, rtol=1e-6)
    across = F.conv1d(x, weight[:, None], bias, padding=2, groups=8)[..., : x.shape[-1]]
    assert (got - across).abs().max() > 1e-2  # the plain conv over the row really mixes examples


def test_a_conv_leaking_one_token_across_a_boundary_is_caught(monkeypatch):
    """The training test's sensitivity: a conv that lets one tap cross each boundary (the unmasked first tap)."""
    model = model_of("lfm2").train()
    examples = make_examples(LENGTHS, seed=1)
    want_loss, _ = loss_and_grads(model, padded_batch(examples))

    def leaky(x, weight, bias, cu_seq_lens, shared=None):
        one_back = F.pad(x, (1, 0))[..., : x.shape[-1]]
        exact = boundary_causal_conv1d(x, weight, bias, cu_seq_lens)
        starts = torch.zeros(x.shape[-1], dtype=x.dtype)
        starts[cu_seq_lens[1:-1].long()] = 1.0  # each example's first token, but the first example's
        return exact + one_back * weight[:, 1, None] * starts

    monkeypatch.setattr(lfm2, "boundary_causal_conv1d", leaky)
    got_loss, _ = packed_loss_and_grads(model, examples)
    assert (got_loss - want_loss).abs() > 1e-5


def test_padded_batches_and_generate_are_unchanged():
    model = model_of("lfm2").eval()
    examples = make_examples([5, 9])
    padded = padded_batch(examples)
    prompt = torch.tensor([examples[1]["input_ids"]])
    with torch.no_grad():
        want = model(**padded, use_cache=False).logits
        generated, gaps = greedy(model, prompt, max_new_tokens=5, pad_token_id=1)
        assembly = assemble(model, {"task": "causal_lm"})
        try:
            torch.testing.assert_close(model(**padded, use_cache=False).logits, want, atol=1e-5, rtol=1e-5)
            assert_same_greedy(model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=1), generated,
                               gaps)
        finally:
            assembly.undo()
    assert patch_of(model) is None and all(not isinstance(m.forward, lfm2.PackedShortConv)
                                           for m in lfm2.short_convs(model))


def test_a_packed_call_without_boundaries_at_the_conv_is_an_error(monkeypatch):
    model = model_of("lfm2").eval()
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = assembly.collator(make_examples([4, 6]))
        conv = lfm2.short_convs(model)[0]
        inner = conv.forward
        monkeypatch.setattr(conv, "forward", lambda hidden_states, **kwargs: inner(
            hidden_states, **{k: v for k, v in kwargs.items() if not k.startswith("cu_seq_lens")}))
        with torch.no_grad(), pytest.raises(BoundaryError, match="without the example boundaries"):
            model(**batch.model_inputs())
    finally:
        assembly.undo()
