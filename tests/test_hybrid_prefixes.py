"""Shared prefixes on hybrid families: in a row that holds a prompt once, each completion's sequence mixers start from
the prompt's final state — a gated delta rule's or a Mamba2 scan's recurrent state and the short-conv taps (LFM2: the
taps alone) — so one shared call computes what every completion computes in its padded row: log-probabilities within
1e-5, gradients within 1e-4 (the prompt runs once; every completion's gradient flows back into it through the state).

The models forget slowly here (small decays: ``slow``): with transformers' default decays a tiny random model's state
dies within a few tokens and a wrong state would move its outputs by 1e-9. Each deliberate fault — a completion
starting from zeros, continuing its sibling's state, its conv taps reaching into a sibling — moves the shared call
by far more than the tolerance (asserted), so the comparison fails on each. Mamba1 families are refused with the
reason."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from padfree_plugins import BoundaryError, assemble
from padfree_plugins.modeling import mixers, unpad
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY
from padfree_plugins.testing.faults import completions_continue_a_sibling, completions_start_from_zero, \
    conv_taps_reach_into_a_sibling
from tests.hybrids_common import hybrid_model, slow
from tests.test_hybrid_lfm2 import model_of as lfm2_model

#: The families whose mixers start a completion from its prompt's state, by model type.
SHARING = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "nemotron_h", "bamba",
           "granitemoehybrid", "falcon_h1", "mamba2", "lfm2", "lfm2_moe"]
#: Families with a recurrent state (LFM2 has conv taps only).
RECURRENT = [name for name in SHARING if not name.startswith("lfm2")]
FAULTS = {"zero state": completions_start_from_zero, "sibling's state": completions_continue_a_sibling,
          "conv tap in a sibling": conv_taps_reach_into_a_sibling}
#: Prompt lengths and each prompt's completions. A shared prefix is the prompt but its last token (which predicts the
#: first label): prefixes of one token, shorter than the conv kernel (4) and a scan chunk (16); completion segments
#: of one token, several chunks.
PROMPTS = {0: 21, 1: 6, 2: 2}
COMPLETIONS = [(0, 5), (0, 18), (1, 2), (2, 4), (0, 1), (1, 40), (0, 3), (2, 2)]


def model_for(model_type: str):
    if model_type.startswith("lfm2"):
        return lfm2_model(model_type, initializer_range=0.1).float().eval()
    return slow(hybrid_model(model_type, initializer_range=0.1))


def padded_call(vocab: int, seed: int = 0):
    """Right-padded rows ``prompt + completion`` (COMPLETIONS), labels on the completions."""
    generator = torch.Generator().manual_seed(seed)
    prompts = {key: torch.randint(3, vocab, (length,), generator=generator) for key, length in PROMPTS.items()}
    return padded_rows([(prompts[key], torch.randint(3, vocab, (length,), generator=generator))
                        for key, length in COMPLETIONS])


def padded_rows(rows: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows ``prompt + completion`` (``rows``: their token tensors), labels on the completions."""
    width = max(len(p) + len(c) for p, c in rows) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, (prompt, completion) in enumerate(rows):
        tokens = torch.cat([prompt, completion])
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
        labels[row, len(prompt):len(tokens)] = completion
    return ids, mask, labels


def shared_and_padded(model):
    """Log-probabilities (every vocabulary entry) at the tokens the shared row holds, from the padded call and from
    the shared call, and each call's parameter gradients of one weighted sum of them."""
    outputs, packed = compare_call(model, *padded_call(model.config.get_text_config().vocab_size))
    parents = packed[SHARED_PREFIXES_KEY].parents
    assert parents.count(-1) == 3 and len(parents) == 11, parents  # every prompt shared
    return outputs


def compare_call(model, ids, mask, labels):
    """The padded call ``ids`` / ``mask`` / ``labels`` run padded and shared: per call, the log-probabilities at the
    tokens the shared row holds and the parameter gradients of one weighted sum of them; and the shared inputs."""
    packed, unpadded = unpad.pack_padded_call({"input_ids": ids}, mask, labels, False, True)
    held = unpadded.scatter(torch.ones(1, unpadded.index.numel())).bool()
    outputs = []
    for inputs in ({"input_ids": ids, "attention_mask": mask, "use_cache": False}, packed):
        model.zero_grad()
        logits = model(**inputs).logits.float()
        logits = unpadded.scatter(logits) if inputs is packed else logits
        log_probs = logits[held].log_softmax(-1)
        torch.manual_seed(1)
        (log_probs * torch.randn_like(log_probs)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outputs.append((log_probs.detach(), grads))
    return outputs, packed


def differences(outputs):
    """The largest log-probability difference, and the largest gradient difference relative to its parameter's
    gradient scale."""
    (want, want_grads), (got, got_grads) = outputs
    assert want_grads.keys() == got_grads.keys()
    grad = max(float((got_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-3)) for n, g in want_grads.items())
    return float((got - want).abs().max()), grad


def assert_same(outputs):
    log_probs, grads = differences(outputs)
    assert log_probs <= 1e-5 and grads <= 1e-4, f"shared call off: log-probs {log_probs:.2e}, gradients {grads:.2e}"


@pytest.fixture(scope="module", params=SHARING)
def shared_model(request):
    model = model_for(request.param)
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})  # padded calls: the model's own code
    yield request.param, model
    assembly.undo()


def test_one_shared_call_equals_the_padded_call(shared_model):
    assert_same(shared_and_padded(shared_model[1]))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_comparison_fails_on_a_wrong_state(shared_model, fault):
    """Each fault moves the log-probabilities by more than 100× the tolerance, and so fails the comparison."""
    with FAULTS[fault]():
        outputs = shared_and_padded(shared_model[1])
    assert differences(outputs)[0] > 1e-3
    with pytest.raises(AssertionError, match="shared call off"):
        assert_same(outputs)


def test_the_recurrent_state_alone_matters(shared_model):
    """Completions whose conv taps read their prompt but whose recurrent state starts from zeros are caught too: the
    comparison sees the recurrent state itself (LFM2 has none)."""
    if shared_model[0] not in RECURRENT:
        pytest.skip("LFM2's mixers carry conv taps only")
    with mock.patch.object(mixers, "state_sources", lambda shared: tuple((-1, p) for p in shared.parents)):
        outputs = shared_and_padded(shared_model[1])
    assert differences(outputs)[0] > 1e-3


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_mamba1_families_refuse_a_shared_row_with_the_reason(model_type):
    model = hybrid_model(model_type)
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})
    try:
        ids, mask, labels = padded_call(model.config.vocab_size)
        packed, _ = unpad.pack_padded_call({"input_ids": ids}, mask, labels, False, True)
        with pytest.raises(BoundaryError, match="Mamba1 selective scan .* takes no initial SSM state"):
            model(**packed)
    finally:
        assembly.undo()


def test_auto_shares_prompts_on_a_hybrid_and_says_why_not_where_it_cannot(caplog):
    """``prefix_sharing: auto`` shares a DPO trainer's prompts on a Qwen3.5 hybrid; on Mamba (whose scan takes no
    initial state) it packs every example whole and logs the reason; ``mixers: kernels`` is a reason too (its CUDA
    route does not carry a prompt's state yet)."""
    pytest.importorskip("trl")
    from padfree_plugins import accelerate
    from tests.test_prefix_sharing import dpo_trainer
    from tests.test_trainer import tokenizer

    acceleration = accelerate(dpo_trainer(slow(hybrid_model("qwen3_5_text", vocab_size=len(tokenizer()))).train()),
                              {"task": "causal_lm"})
    assert acceleration.trainer_patch.shares_prefixes is True
    assert mixers.why_no_prompt_state(acceleration.trainer.model) is None
    assert "mixers: kernels does not yet start" in mixers.why_no_prompt_state(acceleration.trainer.model, "kernels")
    acceleration.undo()
    with caplog.at_level("INFO", logger="padfree_plugins"):
        acceleration = accelerate(dpo_trainer(hybrid_model("mamba", vocab_size=len(tokenizer())).train()),
                                  {"task": "causal_lm"})
    assert acceleration.trainer_patch.shares_prefixes is False
    assert "prompts are not shared for DPOTrainer: mamba runs sequence mixers: its MambaMixer cannot start a " \
           "completion from its prompt's state" in caplog.text
    acceleration.undo()


@pytest.mark.parametrize("model_type,reason", [("mamba", "Mamba1 selective scan"), ("jamba", "Mamba1 selective scan"),
                                               ("qwen3_5_text", None), ("bamba", None), ("lfm2", None)])
def test_check_says_why_a_family_shares_no_prompts(model_type, reason):
    """``padfree-plugins check`` (no model needed) names the reason where a family never shares prompts, and says
    nothing of the kind where it does."""
    import json

    from tests.test_cli import run

    result = run("check", "configs/padfree.yaml", "--model-type", model_type, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    notes = [note for note in json.loads(result.output)["notes"] if "shares no prompts" in note]
    if reason is None:
        assert notes == []
    else:
        assert len(notes) == 1 and reason in notes[0] and "cannot start a completion from its prompt's state" in \
            notes[0], notes


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba", "lfm2"])
def test_gradient_checkpointing_recomputes_completions_from_the_prompts_state(model_type):
    """In train mode with gradient checkpointing, the backward pass recomputes every layer outside the forward; the
    completions' mixers still start from their prompt's state there (the row carries the shared prefixes)."""
    model = model_for(model_type).train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})
    try:
        assert_same(shared_and_padded(model))
    finally:
        assembly.undo()
