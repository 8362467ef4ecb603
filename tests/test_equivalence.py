"""The heart of the suite: a padding-free forward equals running every example alone (fp32, CPU).

Hidden states within 1e-5, gradients of the parameters within 1e-4 (absolute, every element), for every builtin
architecture, with examples of length 1, equal lengths and very unequal lengths. The comparisons are
:func:`padfree_plugins.testing.assert_packed_matches_alone`, the check plugin authors use.
"""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import assemble
from padfree_plugins.testing import assert_packed_matches_alone
from tests.conftest import make_examples, tiny_model

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
    report = assert_packed_matches_alone(model, {"task": "hidden_states"}, make_examples(lengths), atol=1e-5,
                                         rtol=0, grad_atol=None)
    assert report.output == "last_hidden_state (per token)" and report.architecture_plugin != "probe"


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
    report = assert_packed_matches_alone(model, {"task": "hidden_states"}, make_examples([1, 30, 7, 7]), atol=1e-5,
                                         rtol=0, grad_atol=1e-4, grad_rtol=0, loss=_loss)
    assert report.parameters_compared > 5


def test_packed_differs_from_mixing_examples():
    """Sanity of the reference: attending across examples (one long sequence) gives different outputs."""
    model = tiny_model("llama", num_key_value_heads=2)
    examples = make_examples([6, 6])
    with torch.no_grad():
        packed, batch, _ = packed_hidden(model, examples)
        mixed = model(input_ids=batch["input_ids"]).last_hidden_state
    assert (packed[0, 6:] - mixed[0, 6:]).abs().max() > 1e-3


def test_causal_lm_logits_equal_per_example():
    """Logits and gradients; the packed forward asks for a cache, which must not mix examples."""
    model = tiny_model("llama", head="causal_lm", num_key_value_heads=2)
    report = assert_packed_matches_alone(model, {"task": "causal_lm"}, make_examples([1, 5, 23]), atol=1e-5,
                                         rtol=0, forward_kwargs={"use_cache": True})
    assert report.output == "logits (per token)"
