"""The heart of the suite: a padding-free forward equals running every example alone (fp32, CPU).

Hidden states within 1e-5, gradients of the parameters within 1e-4, for every builtin architecture, with
examples of length 1, equal lengths and very unequal lengths.
"""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import assemble
from tests.conftest import make_examples, per_example, split_packed, tiny_model

LENGTH_SETS = {
    "one-token": [1, 1, 4],
    "equal": [9, 9, 9, 9],
    "unequal": [1, 63, 2, 17, 5],
    "single": [12],
}

ARCHITECTURES = {
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=4)),
    "bert": ("bert", {}),
    "roberta": ("roberta", {}),
    "xlm-roberta": ("xlm-roberta", {}),
}


def packed_hidden(model, examples, config=None):
    assembly = assemble(model, config or {"task": "hidden_states"})
    batch = assembly.collator(examples)
    try:
        return model(**batch.model_inputs()).last_hidden_state, batch, assembly
    finally:
        assembly.undo()


@pytest.mark.parametrize("lengths", LENGTH_SETS.values(), ids=LENGTH_SETS.keys())
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_hidden_states_equal_per_example(name, lengths):
    model_type, overrides = ARCHITECTURES[name]
    model = tiny_model(model_type, **overrides)
    examples = make_examples(lengths)
    with torch.no_grad():
        reference = [out.last_hidden_state[0] for out in per_example(model, examples)]
        packed, batch, _ = packed_hidden(model, examples)
    for i, (got, want) in enumerate(zip(split_packed(packed, batch), reference)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"example {i}: {m}")


def test_sliding_window_is_really_exercised():
    """With a window shorter than the examples, ignoring the window would change the outputs."""
    examples = make_examples([20, 13])
    windowed = tiny_model("mistral", num_key_value_heads=2, sliding_window=4)
    unwindowed = tiny_model("mistral", num_key_value_heads=2, sliding_window=None)
    with torch.no_grad():
        a, batch, _ = packed_hidden(windowed, examples)
        b, _, _ = packed_hidden(unwindowed, examples)
    assert (a - b).abs().max() > 1e-3


def test_roberta_positions_start_after_padding_idx():
    model = tiny_model("roberta")
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        batch = assembly.collator(make_examples([3, 2]))
    finally:
        assembly.undo()
    start = model.config.pad_token_id + 1
    assert batch["position_ids"].tolist() == [[start, start + 1, start + 2, start, start + 1]]


def _loss(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.float().pow(2).mean(-1).sum()


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "bert", "roberta"])
def test_gradients_equal_per_example(name):
    model_type, overrides = ARCHITECTURES[name]
    model = tiny_model(model_type, **overrides)
    examples = make_examples([1, 30, 7, 7])
    for out in per_example(model, examples):
        _loss(out.last_hidden_state).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    packed, _, _ = packed_hidden(model, examples)
    _loss(packed).backward()
    assert reference, "the reference produced no gradients"
    for n, p in model.named_parameters():
        if n in reference:
            torch.testing.assert_close(p.grad, reference[n], atol=1e-4, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_packed_differs_from_mixing_examples():
    """Sanity of the reference: attending across examples (one long sequence) gives different outputs."""
    model = tiny_model("llama", num_key_value_heads=2)
    examples = make_examples([6, 6])
    with torch.no_grad():
        packed, batch, _ = packed_hidden(model, examples)
        mixed = model(input_ids=batch["input_ids"]).last_hidden_state
    assert (packed[0, 6:] - mixed[0, 6:]).abs().max() > 1e-3


def test_causal_lm_logits_equal_per_example():
    model = tiny_model("llama", head="causal_lm", num_key_value_heads=2)
    examples = make_examples([1, 5, 23])
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = assembly.collator(examples)
        with torch.no_grad():
            logits = model(**batch.model_inputs(), use_cache=True).logits  # a cache must not mix examples
    finally:
        assembly.undo()
    with torch.no_grad():
        reference = [out.logits[0] for out in per_example(model, examples)]
    for got, want in zip(split_packed(logits, batch), reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
