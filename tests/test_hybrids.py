"""Hybrid families (gated DeltaNet, KDA, Mamba1 / Mamba2 beside attention, and attention-free Mamba): every
sequence mixer restarts at each example of a packed row, so a packed batch computes exactly what each example
computes alone — logits, loss (MoE load-balancing loss included), gradients — and a mixer that lets one token of
the previous example in is caught. Bad requests (CUDA-only kernels on a CPU, a family without a boundary-aware
kernel, a cache, a mixer that lost its boundaries) are errors, never a silent mix.

The padded reference is right-padded: a causal mixer only looks back, so the real tokens of a right-padded row
compute what the example computes alone (left padding would run the scan over pads first)."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import BackendUnavailableError, BoundaryError, UnsupportedArchitectureError, assemble
from padfree_plugins.modeling import hybrids, mixers
from padfree_plugins.modeling.attention import PACKED_CALL
from padfree_plugins.testing import assert_packed_matches_alone
from tests.conftest import make_examples
from tests.hybrids_common import AUX_LOSS, HYBRIDS, LENGTHS, hybrid_model
from tests.test_decoders import assert_packed_step_equals_padded, outputs_and_grads, padded_batch

#: Model type -> the plugin that must take it.
PLUGINS = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "falcon_mamba": "mamba"}
#: Weights of 5× the usual init scale: at 0.02, Jamba's and Falcon-H1's tiny mixers add so little to the residual
#: stream that a mixer leaking 1e-2 of a token stays below fp32 resolution; at 0.1 a leak of 1e-3 of one token is
#: caught in every family (measured: down to 1e-5 for the gated-DeltaNet, KDA and Mamba2 families, 1e-4 for Jamba
#: and Mamba1, 1e-3 for Falcon-H1), while packed still equals alone within the tolerances.
SENSITIVE = dict(initializer_range=0.1)
#: Families whose loss carries a MoE load-balancing loss in these configs.
WITH_AUX_LOSS = [name for name, overrides in HYBRIDS.items() if overrides.get("output_router_logits")]


def plugin_of(model_type: str) -> str:
    return PLUGINS.get(model_type, model_type)


def mixer_modules(model):
    return [module for module in model.modules() if isinstance(module.__dict__.get("forward"), mixers.PackedMixer)]


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_packed_equals_every_example_alone(model_type):
    """Logits within 1e-5 and gradients within 1e-4 (relative to each one's scale) of each example run alone
    through the unpatched model, with examples of 1 token, shorter than the conv kernel and the scan chunk, one
    chunk, several chunks."""
    model = hybrid_model(model_type, **SENSITIVE)
    report = assert_packed_matches_alone(model, {"task": "causal_lm"}, make_examples(LENGTHS, seed=3),
                                         plugin=plugin_of(model_type))
    assert report.parameters_compared > 0 and report.max_grad_diff is not None and not report.failures


@pytest.mark.parametrize("model_type", HYBRIDS)
@pytest.mark.parametrize("lengths", [LENGTHS, [150]], ids=["mixed", "batch-of-one"])
def test_packed_training_step_equals_padded(model_type, lengths):
    """One training step (train mode: MoE routers as in training, their load-balancing loss in the loss): loss,
    logits and every gradient equal a right-padded batch's."""
    def mixers_routed(model):
        assert mixer_modules(model), "no mixer was routed"

    assert_packed_step_equals_padded(hybrid_model(model_type).train(), make_examples(lengths, seed=1),
                                     plugin_of(model_type), {"task_options": {"labelled_logits_only": False}},
                                     check=mixers_routed)


@pytest.mark.parametrize("model_type", WITH_AUX_LOSS)
def test_the_load_balancing_loss_is_in_the_compared_loss(model_type):
    """The MoE families above compare a loss that includes the router's auxiliary loss: it is there, and not
    negligible, so a routing difference on a packed row would show."""
    model = hybrid_model(model_type).train()
    with torch.no_grad():
        output = model(**padded_batch(make_examples(LENGTHS, seed=1)), use_cache=False)
    assert output.aux_loss is not None and output.aux_loss * AUX_LOSS["router_aux_loss_coef"] > 0.1


def leaking_run(strength: float):
    """A mixer backend that lets one token across every boundary: each example after the first runs with
    ``strength ×`` the previous example's last token in front of it (its output for that token dropped)."""

    def run(forward, hidden_states, row, chunk=1, **kwargs):
        cu = row.cu_seq_lens.tolist()
        outputs = []
        for i in range(len(cu) - 1):
            example = hidden_states[:, cu[i]:cu[i + 1]]
            if i == 0:
                outputs.append(forward(example, **kwargs))
                continue
            leaked = torch.cat([strength * hidden_states[:, cu[i] - 1:cu[i]], example], dim=1)
            outputs.append(forward(leaked, **kwargs)[:, 1:])
        return torch.cat(outputs, dim=1)

    return run


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_a_mixer_leaking_one_token_across_a_boundary_is_caught(model_type, monkeypatch):
    """The equivalence check above fails when the mixers see 1e-3 of the previous example's last token (see
    SENSITIVE for how much smaller a leak each family's check catches)."""
    model = hybrid_model(model_type, **SENSITIVE)
    monkeypatch.setattr(mixers, "run_per_example", leaking_run(1e-3))
    with pytest.raises(AssertionError, match="differ"):
        assert_packed_matches_alone(model, {"task": "causal_lm"}, make_examples(LENGTHS, seed=3), grad_atol=None)


def test_the_leak_itself_is_exact_without_a_leak(monkeypatch):
    """The leaking backend at strength 0 is a correct per-example run, so what the test above catches is the one
    token and nothing else."""
    model = hybrid_model("qwen3_5_text", **SENSITIVE)
    monkeypatch.setattr(mixers, "run_per_example", leaking_run(0.0))
    assert_packed_matches_alone(model, {"task": "causal_lm"}, make_examples(LENGTHS, seed=3), grad_atol=None)


@pytest.mark.parametrize("model_type,reentrant", [("qwen3_5_text", False), ("bamba", True), ("kimi_linear", False),
                                                  ("jamba", False), ("jamba", True), ("mamba", True)])
def test_gradient_checkpointing_recomputes_every_example_alone(model_type, reentrant):
    """Gradient checkpointing recomputes each layer in the backward pass, outside the packed forward: the mixers
    get the boundaries from the layer's own arguments, or — Jamba's and Mamba's, whose layers hand them none —
    from the packed row the checkpoint carries into the recomputation. Without it the recomputed mixers would run
    across examples and the gradients would differ."""
    model = hybrid_model(model_type).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    examples = make_examples(LENGTHS, seed=1)
    want_loss, _, want_grads = outputs_and_grads(model, padded_batch(examples))
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        got_loss, _, got_grads = outputs_and_grads(model, assembly.forward.inputs(assembly.collator(examples)))
        assert not any("_gradient_checkpointing_func" in module.__dict__ and isinstance(
            module.__dict__["_gradient_checkpointing_func"], mixers.RowCheckpoint) for module in model.modules())
    finally:
        assembly.undo()
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "mamba"])
def test_padded_calls_and_generation_run_the_models_own_code(model_type):
    """While patched, a padded batch and ``generate()`` (with its recurrent cache) give what they give unpatched;
    ``undo`` leaves no instance forward behind."""
    model = hybrid_model(model_type)
    padded = padded_batch(make_examples([4, 9], seed=2))
    prompt = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():
        want_logits = model(**padded, use_cache=False).logits
        want_tokens = model.generate(prompt, max_new_tokens=5, do_sample=False)
        assembly = assemble(model, {"task": "causal_lm"})
        try:
            got_logits = model(**padded, use_cache=False).logits
            got_tokens = model.generate(prompt, max_new_tokens=5, do_sample=False)
        finally:
            assembly.undo()
    torch.testing.assert_close(got_logits, want_logits, atol=0, rtol=0)
    assert torch.equal(got_tokens, want_tokens)
    assert not any("forward" in module.__dict__ for module in model.modules())


def test_eval_mode_packed_calls_run_without_a_cache():
    """Mamba's head would build a recurrent cache in eval mode (``use_cache`` from its config): a packed call runs
    without one, so the mixers are never handed a cache spanning examples."""
    model = hybrid_model("mamba")
    assert model.config.use_cache
    assert_packed_matches_alone(model, {"task": "causal_lm"}, make_examples([3, 8, 1], seed=4), grad_atol=None)


def test_kernels_on_a_cpu_is_a_clear_error():
    model = hybrid_model("qwen3_5_text")
    with pytest.raises(BackendUnavailableError, match="no CUDA device.*mixers: exact"):
        assemble(model, {"task": "causal_lm", "mixers": "kernels"})
    assert not mixer_modules(model)


def test_kernels_for_a_family_without_a_boundary_aware_kernel_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="kimi_linear: its sequence mixers have no boundary-aware"):
        assemble(hybrid_model("kimi_linear"), {"task": "causal_lm", "mixers": "kernels"})


def test_kernels_without_their_packages_names_what_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mixers, "missing_packages", lambda packages: packages)
    with pytest.raises(BackendUnavailableError, match="flash-linear-attention, causal-conv1d"):
        assemble(hybrid_model("qwen3_next"), {"task": "causal_lm", "mixers": "kernels"})


def test_a_kernels_call_on_cpu_tensors_is_an_error_not_a_mix(monkeypatch):
    """Patched for kernels (on a machine with CUDA), then run on CPU tensors: refused at the first mixer."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mixers, "missing_packages", lambda packages: ())
    model = hybrid_model("bamba")
    assembly = assemble(model, {"task": "causal_lm", "mixers": "kernels"})
    try:
        with pytest.raises(BackendUnavailableError, match="CUDA-only"):
            model(**assembly.forward.inputs(assembly.collator(make_examples([5, 7], seed=1))))
    finally:
        assembly.undo()


@pytest.mark.parametrize("device_type,packages_missing,expected", [
    ("cpu", False, False), ("cuda", False, True), ("cuda", True, False)])
def test_auto_takes_the_kernels_only_on_cuda_with_every_package(device_type, packages_missing, expected, monkeypatch):
    monkeypatch.setattr(mixers, "missing_packages", lambda packages: packages if packages_missing else ())
    mixer = mixers.PackedMixer(None, None, "auto", hybrids.GATED_DELTA_KERNELS)
    assert mixer.uses_kernels(torch.device(device_type)) is expected
    assert not mixers.PackedMixer(None, None, "auto", ()).uses_kernels(torch.device("cuda"))
    assert not mixers.PackedMixer(None, None, "exact", hybrids.GATED_DELTA_KERNELS).uses_kernels(
        torch.device("cuda"))


def test_the_kernels_route_hands_the_mixer_the_boundaries_and_seq_idx(monkeypatch):
    """What the kernels route passes on (checked here with a recording mixer; the kernels themselves need a GPU,
    tests/test_gpu.py): the packed row, ``cu_seq_lens_q`` and ``seq_idx``, no cache."""
    seen = {}

    def mixer_forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        seen.update(kwargs, hidden_states=hidden_states.shape)
        return hidden_states

    monkeypatch.setattr(mixers.PackedMixer, "uses_kernels", lambda self, device: True)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    mixer = mixers.PackedMixer(torch.nn.Identity(), mixer_forward, "kernels", ("fla",))
    mixer(torch.zeros(1, 5, 3), cache_params=None, cu_seq_lens_q=cu, max_length_q=3)
    assert seen["hidden_states"] == (1, 5, 3) and seen["cu_seq_lens_q"].tolist() == [0, 2, 5]
    assert seen["seq_idx"].tolist() == [[0, 0, 1, 1, 1]] and seen["seq_idx"].dtype == torch.int32


def test_a_packed_call_with_a_cache_is_refused():
    mixer = mixers.PackedMixer(torch.nn.Identity(), lambda hidden_states, cache_params=None, **kw: hidden_states,
                               "exact", ())
    with pytest.raises(BoundaryError, match="cache"):
        mixer(torch.zeros(1, 5, 3), cache_params=object(), cu_seq_lens_q=torch.tensor([0, 2, 5]))


def test_a_mixer_that_lost_its_boundaries_in_a_packed_forward_is_refused():
    mixer = mixers.PackedMixer(torch.nn.Identity(), lambda hidden_states, **kw: hidden_states, "exact", ())
    token = PACKED_CALL.set(True)
    try:
        with pytest.raises(BoundaryError, match="without the example boundaries"):
            mixer(torch.zeros(1, 5, 3))
    finally:
        PACKED_CALL.reset(token)
    assert mixer(torch.ones(2, 5, 3)).sum() == 30  # outside a packed forward: the module's own code


def test_boundaries_that_do_not_cover_the_row_are_refused():
    mixer = mixers.PackedMixer(torch.nn.Identity(), lambda hidden_states, **kw: hidden_states, "exact", ())
    with pytest.raises(BoundaryError, match="6 tokens, but the boundaries describe 5"):
        mixer(torch.zeros(1, 6, 3), cu_seq_lens_q=torch.tensor([0, 2, 5]))


def test_a_model_without_the_known_mixer_modules_is_refused():
    """A transformers version that renamed a family's mixer classes is refused, not run across examples."""
    from padfree_plugins.builtin.architectures.qwen3_5 import QWEN3_5
    from padfree_plugins.config.schema import PadfreeConfig

    renamed = hybrids.Hybrid(QWEN3_5.architecture, mixers=("RenamedGatedDeltaNet",))
    _, patch_model = renamed.hooks()
    with pytest.raises(UnsupportedArchitectureError, match="RenamedGatedDeltaNet"):
        patch_model(hybrid_model("qwen3_5_text"), renamed.architecture, None, None, PadfreeConfig())


def test_an_undeclared_hybrid_is_refused_by_the_probe():
    """With its plugin blocked, a hybrid goes to the probe, which refuses sequence mixers without measuring."""
    with pytest.raises(UnsupportedArchitectureError, match="GatedDeltaNet"):
        assemble(hybrid_model("qwen3_next"), {"task": "causal_lm", "architecture": "probe",
                                              "plugins": {"block": ["qwen3_next"]}})


def test_an_unknown_mixer_backend_is_a_config_error():
    from padfree_plugins import ConfigError

    with pytest.raises(ConfigError, match="mixers"):
        assemble(hybrid_model("bamba"), {"task": "causal_lm", "mixers": "fast"})


def test_batch_plan_places_every_token_once_and_pads_read_the_zero_row():
    """The exact route's gather (one index per batch, pads pointing one past the row, at a zero row) and its put-back
    (one index over the batches' outputs): every token lands in its example's place and comes back where it was."""
    cu = torch.tensor([0, 5, 6, 70, 75, 200])  # lengths 5, 1, 64, 5 (one 64-token chunk each) and 125 (two)
    batches, keep = mixers.batch_plan(cu, 64)
    assert [(count, width) for _, count, width in batches] == [(4, 64), (1, 125)]
    tokens = torch.arange(1.0, 201.0)[:, None]
    gathered = [torch.nn.functional.pad(tokens, (0, 0, 0, 1))[torch.tensor(index)] for index, _, _ in batches]
    first = gathered[0].view(4, 64)
    for place, (start, end) in enumerate([(5, 6), (0, 5), (70, 75), (6, 70)]):  # shortest first, stably
        assert torch.equal(first[place, :end - start], tokens[start:end, 0])
        assert not first[place, end - start:].any()  # the pads: zeros
    assert torch.equal(torch.cat(gathered)[torch.tensor(keep)], tokens)


@pytest.mark.parametrize("model_type,chunk", [("qwen3_5_text", 64), ("bamba", 16)])
def test_examples_spanning_as_many_chunks_run_as_one_batch(model_type, chunk):
    """The exact route batches the examples that span the same number of scan chunks (right-padded to the
    longest): fewer calls of the mixer, the same output as one call per length."""
    model = hybrid_model(model_type)
    module = next(m for m in model.modules() if type(m).__name__.endswith(("GatedDeltaNet", "Mixer")))
    calls = []

    def forward(hidden_states, **kwargs):
        calls.append(tuple(hidden_states.shape[:2]))
        return module(hidden_states)

    lengths = torch.tensor(LENGTHS)
    row = mixers.PackedRow(torch.cat([torch.zeros(1), lengths.cumsum(0)]).int())
    hidden = torch.randn(1, int(lengths.sum()), model.config.hidden_size)
    with torch.no_grad():
        per_length = mixers.run_per_example(forward, hidden, row)
        calls_per_length = len(calls)
        calls.clear()
        bucketed = mixers.run_per_example(forward, hidden, row, chunk)
    assert calls_per_length == len(set(LENGTHS))
    assert len(calls) == len({-(-n // chunk) for n in LENGTHS}) < calls_per_length
    torch.testing.assert_close(bucketed, per_length, atol=1e-6, rtol=1e-6)
