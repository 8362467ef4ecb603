"""How long an example may be: ``max_position_embeddings`` bounds it, unless the model's RoPE serves longer ones
(dynamic NTK scaling). A dynamic-RoPE model trains longer examples packed exactly as padded — its frequencies follow
the longest position of each call, the same in the packed row as in the padded batch (and across calls: the rotary
embedding keeps the largest length it has grown to). Under sequence parallelism, where each rank's slice would pick
its frequencies by its own longest position, dynamic RoPE keeps ``max_position_embeddings`` and ``longrope`` its
``original_max_position_embeddings`` (a 2-process launch: tests/position_limits_sp_run.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from padfree_plugins import BatchError, assemble, plan
from padfree_plugins.config.schema import load_config
from padfree_plugins.packing.collator import extends_positions, model_token_limit, packing_collator
from tests.conftest import make_examples, split_packed, tiny_config

LIMIT = 64


def llama(rope: dict | None):
    torch.manual_seed(0)
    config = tiny_config("llama", num_key_value_heads=2, max_position_embeddings=LIMIT,
                         **({"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
NOT_EXTENDING = {"default": None, "linear": {"rope_type": "linear", "factor": 2.0},
                 "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": LIMIT // 2},
                 "llama3": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": LIMIT // 2}}


def padded_logits(model, examples):
    """The padded batch's logits of every example (right padding, as HF Trainer pads)."""
    longest = max(len(ex["input_ids"]) for ex in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, ex in enumerate(examples):
        ids[i, : len(ex["input_ids"])] = torch.tensor(ex["input_ids"])
        mask[i, : len(ex["input_ids"])] = 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return [logits[i, : len(ex["input_ids"])] for i, ex in enumerate(examples)]


def loss_of(logits: list[torch.Tensor]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return sum((out * torch.randn(out.shape, generator=generator)).sum() for out in logits)


def test_dynamic_rope_extends_the_limit_and_others_keep_it():
    assert extends_positions(llama(DYNAMIC).config)
    assert model_token_limit(llama(DYNAMIC).config) is None
    for name, rope in NOT_EXTENDING.items():
        config = llama(rope).config
        assert not extends_positions(config) and model_token_limit(config) == LIMIT, name


@pytest.mark.parametrize("name", list(NOT_EXTENDING))
def test_an_example_longer_than_the_limit_is_refused_where_rope_does_not_extend(name):
    collator = assemble(llama(NOT_EXTENDING[name]), {"task": "causal_lm"}).collator
    with pytest.raises(BatchError, match=f"has {LIMIT + 1} tokens but the model takes at most {LIMIT}"):
        collator(make_examples([10, LIMIT + 1]))


def test_dynamic_rope_trains_examples_longer_than_the_limit_as_padded():
    """Batches with examples past the 64 positions (the rotary frequencies grow to 100, then stay there for a batch
    whose longest is 80): logits and gradients of the packed rows equal the padded batches', call after call."""
    model = llama(DYNAMIC)
    reference = copy.deepcopy(model)
    assembly = assemble(model, {"task": "causal_lm"})
    for seed, lengths in enumerate(([100, 30, 70], [80, 20], [40, 90, 12])):
        examples = make_examples(lengths, seed=seed)
        want = padded_logits(reference, examples)
        batch = assembly.collator(examples)
        got = split_packed(assembly.forward(model, batch).logits, batch)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        grads = [torch.autograd.grad(loss_of(outs), list(m.parameters())) for outs, m in ((got, model),
                                                                                         (want, reference))]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert model.model.rotary_emb.max_seq_len_cached == reference.model.rotary_emb.max_seq_len_cached == 100


def test_the_comparison_fails_when_the_packed_row_scales_by_another_length():
    """The test above can fail: a packed row whose rotary frequencies are those of another longest position (here
    the model's own 64, as a row cut into pieces would give) differs from the padded batch."""
    model = llama(DYNAMIC)
    reference = copy.deepcopy(model)
    assembly = assemble(model, {"task": "causal_lm"})
    examples = make_examples([100, 30])
    want = padded_logits(reference, examples)
    rotary = model.model.rotary_emb
    rotary.max_seq_len_cached = 10 ** 6  # no growth: the frequencies stay those of 64 positions
    batch = assembly.collator(examples)
    got = split_packed(assembly.forward(model, batch).logits, batch)
    assert (got[0] - want[0]).abs().max() > 1e-3


def test_under_sequence_parallelism_dynamic_rope_keeps_the_limit_and_says_why():
    model_config = llama(DYNAMIC).config
    config = load_config({"task": "causal_lm", "sequence_parallel": {"size": 2}})
    resolved = plan(model_config, {"task": "causal_lm"})
    collator = packing_collator(resolved.task, resolved.architecture, model_config, config)
    assert collator.max_length == LIMIT
    message = collator.overlong_message(0, LIMIT + 1)
    assert "dynamic RoPE serves longer examples, but not under sequence_parallel.size: 2" in message


def test_under_sequence_parallelism_longrope_keeps_its_original_length_and_says_why():
    """``longrope`` picks its short or long factors for a whole call by the call's longest position; under sequence
    parallelism each rank would pick them for its slice (the launch below shows the difference): examples up to
    ``original_max_position_embeddings`` only, which use the short factors on every rank. Without sequence
    parallelism the limit is ``max_position_embeddings``."""
    plain = tiny_config("phi3")
    half = plain.hidden_size // plain.num_attention_heads // 2  # one factor per rotary frequency
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": LIMIT // 2,
            "short_factor": [1.0] * half, "long_factor": [4.0] * half}
    model_config = tiny_config("phi3", max_position_embeddings=LIMIT, original_max_position_embeddings=LIMIT // 2,
                               rope_parameters=rope)
    assert model_token_limit(model_config) == LIMIT and model_token_limit(model_config, 0, 2) == LIMIT // 2
    config = load_config({"task": "causal_lm", "sequence_parallel": {"size": 2}})
    resolved = plan(model_config, {"task": "causal_lm"})
    collator = packing_collator(resolved.task, resolved.architecture, model_config, config)
    assert collator.max_length == LIMIT // 2
    message = collator.overlong_message(0, LIMIT // 2 + 1)
    assert "longrope original_max_position_embeddings=32" in message and "sequence_parallel.size: 1" in message


def test_longrope_under_sequence_parallelism_equals_one_process_within_its_original_length(tmp_path):
    """Two processes: within ``original_max_position_embeddings`` the sequence-parallel loss and gradients equal one
    process's; a row with an example past it (fed without the limit) differs — the case the limit refuses, and the
    real collator does refuse it on the rank that holds it."""
    import os
    import sys

    from tests.test_distributed import ROOT, free_port, run_group

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / "position_limits_sp_run.py"), str(tmp_path)]
    returncode, output = run_group(command, env, timeout=240, results=[tmp_path / "result.pt"])
    assert returncode == 0, output[-4000:]
    results = torch.load(tmp_path / "result.pt", weights_only=True)
    within, beyond = results["within"], results["beyond"]
    print(results)
    assert within["loss"] < 1e-5 and within["grad"] < 1e-4 and within["refused"] == 0, within
    assert beyond["loss"] > 1e-5 and beyond["grad"] > 1e-4 and beyond["refused"] == 1, beyond
