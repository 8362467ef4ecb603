"""Padded in, padded out (``unpad``): an ordinary padded batch given to a patched decoder runs padding-free inside
the model's body and returns what the padded forward returns — loss, logits at real tokens, MoE router loss,
gradients — for left and right padding, every decoder family; other calls run the model's own code untouched."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import assemble
from padfree_plugins.modeling import unpad
from padfree_plugins.packing.padded import pad_examples
from padfree_plugins.testing.faults import leak_across_boundaries
from tests.conftest import make_examples
from tests.hybrids_common import hybrid_model
from tests.test_decoders import DECODERS, causal_lm, outputs_and_grads
from tests.ties import assert_same_greedy, greedy

LENGTHS = [5, 17, 1, 9, 17]
#: Families whose own left-padded training step has NaN gradients in transformers 5.23 (Gemma 3n: the rows of the
#: pads, masked everywhere): unpadded, the step is finite and equals the right-padded one.
LEFT_PADDED_NAN = {"gemma3n"}


def padded(examples, side):
    return pad_examples(examples, ("input_ids", "labels"), pad_token_id=1, side=side)


def step(model, batch):
    """Loss, logits and gradients of one training step on ``batch``."""
    return outputs_and_grads(model, batch)


def assert_step_equals(model, batch, config=None, packed_calls=None, reference=None):
    """The patched step on ``batch`` equals the unpatched step on ``reference`` (default: ``batch``; the same
    examples padded on another side compare real token for real token)."""
    reference = batch if reference is None else reference
    want_loss, want_logits, want_grads = step(model, reference)
    assembly = assemble(model, {"task": "causal_lm", **(config or {})})
    try:
        got_loss, got_logits, got_grads = step(model, batch)
    finally:
        assembly.undo()
    if packed_calls is not None:
        assert packed_calls == [True], "the padded call was not unpadded"
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits[batch["attention_mask"].bool()],
                               want_logits[reference["attention_mask"].bool()], atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", DECODERS)
def test_a_padded_training_step_equals_the_padded_forward(name, side, packed_calls):
    """Every decoder family, left and right padding: packed inside the body, the loss (MoE router loss included),
    the logits at real tokens and every gradient equal the model's own padded step. Labels as collators set them:
    -100 at pads and on each row's first token (which, left-padded, a pad would predict)."""
    model_type, overrides = DECODERS[name]
    model = causal_lm(model_type, **overrides).train()
    examples = make_examples(LENGTHS, seed=1)
    batch = unlabelled_first(padded(examples, side))
    reference = None
    if side == "left" and name in LEFT_PADDED_NAN:
        assert any(torch.isnan(grad).any() for grad in step(model, batch)[2].values())
        reference = unlabelled_first(padded(examples, "right"))
    assert_step_equals(model, batch, packed_calls=packed_calls, reference=reference)


def unlabelled_first(batch):
    batch["labels"][torch.arange(len(batch["labels"])), batch["attention_mask"].argmax(1)] = -100
    return batch


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "jamba", "mamba"])
def test_hybrids_padded_on_the_right_equal_the_padded_forward(model_type, packed_calls):
    """Hybrids too (right padding: the padded reference of a recurrent model is exact per example only there)."""
    assert_step_equals(hybrid_model(model_type).train(), padded(make_examples(LENGTHS, seed=1), "right"),
                       packed_calls=packed_calls)


def test_left_padded_hybrids_get_each_example_alone_where_padding_does_not():
    """Left padding runs Mamba's scan over the pads first, so its padded forward is not each example alone;
    unpadded, every example's logits are what it computes alone."""
    model = hybrid_model("mamba").train()
    examples = make_examples(LENGTHS, seed=1)
    batch = padded(examples, "left")
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits[0] for ex in examples]
        assembly = assemble(model, {"task": "causal_lm"})
        try:
            logits = model(**batch, use_cache=False).logits
        finally:
            assembly.undo()
    for row, want in enumerate(alone):
        torch.testing.assert_close(logits[row, -len(want):], want, atol=1e-5, rtol=1e-5)


def test_the_unpadded_step_catches_a_leak_across_examples():
    """The equality above fails when one layer lets 1e-3 of the previous example's last token in."""
    model = causal_lm("llama", num_key_value_heads=2).train()
    batch = padded(make_examples(LENGTHS, seed=1), "right")
    want_loss, want_logits, _ = step(model, batch)
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        with leak_across_boundaries(model, strength=1e-3):
            _, got_logits, _ = step(model, batch)
    finally:
        assembly.undo()
    real = batch["attention_mask"].bool()
    assert (got_logits[real] - want_logits[real]).abs().max() > 1e-4


def test_logits_to_keep_and_position_ids_of_the_padded_call_are_honoured(packed_calls):
    """GRPO's shape of call: left-padded prompts, ``logits_to_keep`` of the completion length, explicit positions."""
    model = causal_lm("qwen2", num_key_value_heads=2).train()
    batch = padded(make_examples(LENGTHS, seed=2), "left")
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    del batch["labels"]
    want = model(**batch, logits_to_keep=4, use_cache=False).logits
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        got = model(**batch, logits_to_keep=4, use_cache=False).logits
    finally:
        assembly.undo()
    assert packed_calls == [True] and got.shape == want.shape == (len(LENGTHS), 4, model.config.vocab_size)
    real = batch["attention_mask"][:, -4:].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_one_read_from_the_device_per_forward(monkeypatch):
    """Packing a padded call reads the device once (lengths, where each row starts, the mask's and the labels'
    checks in one transfer); the packed call carries the longest length as an int, so no kernel reads it again."""
    batch = unlabelled_first(padded(make_examples(LENGTHS, seed=1), "left"))
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _original=original, _name=name: reads.append(
            _name) or _original(self, *a))
    packed, _ = unpad.pack_padded_call(dict(batch), batch["attention_mask"], batch["labels"])
    assert reads == ["tolist"] and isinstance(packed["max_length_q"], int)


def test_a_pad_given_a_token_to_predict_runs_padded(packed_calls):
    """Left padding with the first real token labelled: padded, that label is predicted from the pad before it,
    which a packed row has not — so the call runs padded, exactly (and with the label masked it is unpadded)."""
    model = causal_lm("phi").train()
    batch = padded(make_examples(LENGTHS, seed=1), "left")
    assert_step_equals(model, batch)
    assert packed_calls == [False]
    first = batch["attention_mask"].argmax(1)
    batch["labels"][torch.arange(len(LENGTHS)), first] = -100
    packed_calls.clear()
    assert_step_equals(model, batch, packed_calls=packed_calls)


@pytest.mark.parametrize("case", ["no padding", "eval mode", "a mask with holes", "unpad off", "a cache"])
def test_other_calls_run_the_models_own_code(case, packed_calls):
    """Nothing is packed — and the output is the model's own, bit for bit — for a batch without padding (which so
    costs nothing extra), an evaluation forward under ``auto``, a mask that is not left or right padding,
    ``unpad: off``, a call with a cache."""
    model = causal_lm("llama", num_key_value_heads=2).train()
    examples = make_examples([6, 6, 6] if case == "no padding" else LENGTHS, seed=1)
    batch = padded(examples, "right")
    config = {"unpad": "off"} if case == "unpad off" else {}
    if case == "eval mode":
        model.eval()
    if case == "a mask with holes":
        batch["attention_mask"][0, 1] = 0
    kwargs = {}
    if case == "a cache":
        from transformers import DynamicCache

        model.eval()
        kwargs = {"past_key_values": DynamicCache(config=model.config), "use_cache": True}
    with torch.no_grad():
        want = model(**batch, **({"use_cache": False} if not kwargs else kwargs)).logits
        if kwargs:
            kwargs["past_key_values"] = DynamicCache(config=model.config)
        assembly = assemble(model, {"task": "causal_lm", **config})
        try:
            got = model(**batch, **({"use_cache": False} if not kwargs else kwargs)).logits
        finally:
            assembly.undo()
    assert not any(packed_calls)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_always_unpads_evaluation_and_no_grad_forwards(packed_calls):
    """``unpad: always``: a reference model's log-probabilities (eval mode, no_grad) run padding-free too."""
    model = causal_lm("llama", num_key_value_heads=2).eval()
    batch = unlabelled_first(padded(make_examples(LENGTHS, seed=1), "left"))
    with torch.no_grad():
        want = model(**batch, use_cache=False).logits
        assembly = assemble(model, {"task": "causal_lm", "unpad": "always"})
        try:
            got = model(**batch).logits
        finally:
            assembly.undo()
    assert packed_calls == [True]
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_generate_is_untouched(packed_calls):
    model = causal_lm("llama", num_key_value_heads=2).eval()
    batch = padded(make_examples([3, 7], seed=1), "left")
    del batch["labels"]
    with torch.no_grad():
        want, gaps = greedy(model, **batch, max_new_tokens=4)
        assembly = assemble(model, {"task": "causal_lm", "unpad": "always"})
        try:
            got = model.generate(**batch, max_new_tokens=4, do_sample=False)
        finally:
            assembly.undo()
    assert_same_greedy(got, want, gaps)
    assert not any(packed_calls)
