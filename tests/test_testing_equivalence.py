"""padfree_plugins.testing.assert_packed_matches_alone: it passes on correct plugins, leaves the model as it was,
compares against the model's own attention, and fails — with a message naming example, difference, tolerance and
parameter — on a model that leaks across example boundaries or numbers positions across the packed row."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from padfree_plugins import assemble, patch_of
from padfree_plugins.testing import (
    EquivalenceReport,
    assert_packed_matches_alone,
    example_batch,
    leak_across_boundaries,
    positions_run_on,
    tiny_model,
)

GQA = dict(num_key_value_heads=2)
#: (model type, task, overrides): decoders and encoders, per-token outputs and per-example classifier logits.
CASES = {
    "llama-hidden_states": ("llama", "hidden_states", GQA),
    "llama-causal_lm": ("llama", "causal_lm", GQA),
    "llama-seq_cls": ("llama", "seq_cls", dict(num_labels=3, **GQA)),
    "bert-hidden_states": ("bert", "hidden_states", {}),
    "roberta-seq_cls": ("roberta", "seq_cls", dict(num_labels=3)),
    "mpnet-hidden_states": ("mpnet", "hidden_states", {}),  # its own attention code (eager)
}


def model_of(case: str):
    model_type, task, overrides = CASES[case]
    return tiny_model(model_type, task, **overrides)


@pytest.mark.parametrize("case", CASES)
def test_passes_and_leaves_the_model_as_it_was(case):
    model = model_of(case)
    implementation = model.config._attn_implementation
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    report = assert_packed_matches_alone(model)
    assert isinstance(report, EquivalenceReport) and report.ok
    assert report.task == CASES[case][1] and report.lengths == (1, 7, 7, 30, 1, 3)
    assert report.max_output_diff <= report.output_tolerance and report.max_output_diff < 1e-5
    assert report.parameters_compared > 5 and report.max_grad_diff <= report.grad_tolerance
    assert report.worst_parameter and str(report).startswith(f"{report.task} via ")
    assert patch_of(model) is None and model.config._attn_implementation == implementation
    assert not model.training
    assert all(p.grad is None for p in model.parameters())  # gradients through autograd.grad, .grad untouched
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_reference_runs_through_the_models_own_attention():
    """Every example alone runs with the model's own attention (sdpa), the packed row once with padfree's."""
    model = model_of("llama-hidden_states")
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    examples = example_batch(model, [3, 1, 5])
    assert_packed_matches_alone(model, {"task": "hidden_states"}, examples)
    assert seen[:3] == ["sdpa"] * 3 and len(seen) == 4 and seen[3].startswith("padfree")


def test_refuses_a_patched_model_and_dropout_in_training():
    model = model_of("bert-hidden_states")
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        with pytest.raises(ValueError, match="unpatched"):
            assert_packed_matches_alone(model)
    finally:
        assembly.undo()
    with pytest.raises(ValueError, match="dropout"):
        assert_packed_matches_alone(model.train())  # BERT's tiny config keeps hidden dropout 0.1


def test_a_plugin_that_is_not_the_expected_one_fails():
    model = model_of("llama-causal_lm")
    with pytest.raises(AssertionError, match="came from plugin 'llama', not 'cohere'"):
        assert_packed_matches_alone(model, plugin="cohere")
    assert patch_of(model) is None


def test_task_follows_the_model_class_and_forward_kwargs_reach_the_model():
    model = model_of("llama-causal_lm")
    report = assert_packed_matches_alone(model, {"attention": "exact"}, forward_kwargs={"use_cache": True})
    assert report.task == "causal_lm" and report.output == "logits (per token)"
    assert assert_packed_matches_alone(model_of("roberta-seq_cls"), grad_atol=None).output == "logits (per example)"


#: Smallest leak caught, per case, on the grid 1e-2, 3e-3, 1e-3 … 1e-6 (default tolerances, measured on CPU fp32).
SMALLEST_CAUGHT = {
    "llama-hidden_states": 3e-5,
    "bert-hidden_states": 3e-5,
    "llama-causal_lm": 1e-4,
    "llama-seq_cls": 1e-4,
    "roberta-seq_cls": 1e-3,
}


def caught(model, strength: float, **leak) -> str | None:
    """The failure message if the check catches a leak of ``strength``, else ``None``."""
    try:
        with leak_across_boundaries(model, strength=strength, **leak):
            assert_packed_matches_alone(model, grad_atol=1e-4 if leak.get("backward_only") else None)
    except AssertionError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case", SMALLEST_CAUGHT)
def test_a_leak_across_the_boundary_is_caught(case):
    """Sensitivity. The leak: after the first layer, the first token of every example but the first gets
    ``strength ×`` the hidden state of the token before it (the previous example's last). Measured with the default
    tolerances (atol = rtol = 1e-5 of the example's scale), outputs alone: a leak of 3e-5 (relative) is caught in
    per-token hidden states of a decoder (Llama) and an encoder (BERT), 1e-4 in causal-LM logits and in a decoder
    classifier's logits (the last token reads the leak through attention), 1e-3 in a CLS classifier's logits
    (RoBERTa); 1e-5 and 1e-6 pass unnoticed (a bug that small is below fp32 rounding through two layers). Here: the
    stated smallest leak is caught, and a leak of 0 (the same hooks, adding nothing) passes."""
    model = model_of(case)
    assert caught(model, 0.0) is None
    message = caught(model, SMALLEST_CAUGHT[case])
    assert message is not None, f"a leak of {SMALLEST_CAUGHT[case]:g} was not caught"
    assert "example 0 " not in message  # the first example has nothing before it: exact
    assert re.search(r"example [1-5] \(length \d+\): packed \w+ differ from the example run alone", message)
    assert "max abs; tolerance" in message


def test_a_1e3_leak_fails_with_a_clear_message():
    model = model_of("llama-causal_lm")
    message = caught(model, 1e-3)
    assert message.startswith("packed ≠ alone for task causal_lm (architecture from plugin llama), examples of "
                              "lengths [1, 7, 7, 30, 1, 3]:")
    # example 4 (one token after the 30-token one) and the others after a boundary; the leak sits at their token 0
    for i, length in [(1, 7), (2, 7), (3, 30), (4, 1), (5, 3)]:
        assert f"example {i} (length {length}): packed logits differ from the example run alone by " in message
    assert "worst at token 0" in message and "atol 1e-05 + rtol 1e-05 × scale" in message
    assert patch_of(model) is None


def test_a_gradient_only_leak_is_caught_naming_the_parameter():
    """A leak in the backward pass only (forward values exact, as from a wrong backward kernel): the output check
    passes, the gradient check fails and names the parameters. Smallest caught with the default grad tolerances
    (grad_atol = grad_rtol = 1e-4): 3e-4."""
    model = model_of("llama-hidden_states")
    assert caught(model, 1e-4, backward_only=True) is None
    message = caught(model, 3e-4, backward_only=True)
    assert message is not None and "packed last_hidden_state differ" not in message
    assert "gradient of layers.0." in message and "packed differs from the sum over the examples alone by" in message
    assert "grad_atol 0.0001 + grad_rtol 0.0001 × scale" in message


@pytest.mark.parametrize("case", ["bert-hidden_states", "roberta-seq_cls", "mpnet-hidden_states"])
def test_positions_that_do_not_restart_are_caught(case):
    model = model_of(case)
    with positions_run_on(model), pytest.raises(AssertionError, match=r"example 1 \(length 7\)"):
        assert_packed_matches_alone(model, grad_atol=None)


def test_positions_running_on_change_nothing_for_rotary_models():
    """RoPE sees only distances within an example, so there is no position table to fault."""
    with pytest.raises(ValueError, match="shift-invariant"), positions_run_on(model_of("llama-hidden_states")):
        pass


def test_works_without_pytest():
    code = ("import sys; sys.modules['pytest'] = None\n"
            "from padfree_plugins.testing import assert_packed_matches_alone, tiny_model\n"
            "print(assert_packed_matches_alone(tiny_model('llama', num_key_value_heads=2), grad_atol=None).ok)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
