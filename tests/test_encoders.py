"""The encoder architecture plugins (DistilBERT, ELECTRA, ModernBERT): packed hidden states and gradients equal
every example run alone, and ModernBERT's local attention keeps its window."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import assemble, plan
from tests.conftest import make_examples, per_example, split_packed, tiny_config
from tests.tasks_common import ENCODERS, assert_grads_close, grads, model_for

NEW_ENCODERS = ("distilbert", "electra", "modernbert")
LENGTHS = {"one-token": [1, 1, 4], "unequal": [1, 13, 7, 30, 7], "single": [12]}


def packed_hidden(model, examples):
    assembly = assemble(model, {"task": "hidden_states", "attention": "exact"})
    try:
        batch = assembly.collator(examples)
        return model(**batch.model_inputs()).last_hidden_state, batch
    finally:
        assembly.undo()


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("name", NEW_ENCODERS)
def test_hidden_states_equal_per_example(name, lengths):
    model = model_for(name)
    examples = make_examples(lengths)
    with torch.no_grad():
        reference = [out.last_hidden_state[0] for out in per_example(model, examples)]
        packed, batch = packed_hidden(model, examples)
    for i, (got, want) in enumerate(zip(split_packed(packed, batch), reference)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"example {i}: {m}")


@pytest.mark.parametrize("name", NEW_ENCODERS)
def test_gradients_equal_per_example(name):
    model = model_for(name)
    examples = make_examples([1, 30, 7, 7])
    for out in per_example(model, examples):
        out.last_hidden_state.pow(2).mean(-1).sum().backward()
    reference = grads(model)
    packed, _ = packed_hidden(model, examples)
    packed.pow(2).mean(-1).sum().backward()
    assert_grads_close(grads(model), reference)


@pytest.mark.parametrize("name", NEW_ENCODERS)
def test_architecture_is_resolved_by_model_type(name):
    resolved = plan(tiny_config(name, **ENCODERS[name]), {"task": "hidden_states", "attention": "exact"})
    assert resolved.architecture.name == name and resolved.architecture.kind == "encoder"
    assert resolved.position_start == 0 and "bidirectional" in resolved.features


def test_modernbert_local_window_matches_its_own_mask():
    """local_attention=4: ModernBERT passes sliding_window = 4 // 2 + 1 = 3, i.e. a token sees 2 tokens on each
    side in local layers. The packed model equals ModernBERT's own padded sdpa path, and differs from a model
    whose window covers everything — so the window is honoured, not ignored."""
    examples = make_examples([20, 9, 3])
    local = model_for("modernbert", local_attention=4)
    wide = model_for("modernbert", local_attention=64)  # same weights (same seed), window wider than any example
    layer_windows = {m.sliding_window for m in local.modules() if hasattr(m, "sliding_window")}
    assert layer_windows == {None, 3}
    assert "sliding_window" in plan(local.config, {"task": "hidden_states"}).features
    with torch.no_grad():
        reference = [out.last_hidden_state[0] for out in per_example(local, examples)]
        packed, batch = packed_hidden(local, examples)
        unwindowed, _ = packed_hidden(wide, examples)
    for got, want in zip(split_packed(packed, batch), reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (packed - unwindowed).abs().max() > 1e-3


def test_distilbert_ignores_token_type_ids_it_does_not_take():
    """Pairs tokenized with token types still run: DistilBERT's forward has no token_type_ids."""
    model = model_for("distilbert", head="seq_cls", num_labels=2)
    examples = [{"input_ids": [5, 6, 7], "token_type_ids": [0, 1, 1]}, {"input_ids": [8], "token_type_ids": [0]}]
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    try:
        with torch.no_grad():
            logits = assembly.forward(model, assembly.collator(examples)).logits
    finally:
        assembly.undo()
    with torch.no_grad():
        want = torch.cat([model(input_ids=torch.tensor([ex["input_ids"]])).logits for ex in examples])
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
