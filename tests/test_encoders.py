"""The encoder architecture plugins (DistilBERT, ELECTRA, ModernBERT, ALBERT, ERNIE, the wider RoBERTa family, the
RoPE encoders, MPNet, DeBERTa-v2): packed hidden states and gradients equal every example run alone, embeddings and
classifier logits equal the padded model's, ModernBERT's local attention keeps its window, MPNet's relative position
bias and DeBERTa-v2's disentangled attention stay per example, and undeclared encoders are probed as encoders."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from padfree_plugins import assemble, plan
from tests.conftest import make_examples, per_example, split_packed, tiny_config
from tests.tasks_common import MORE_ENCODERS, TINY, assert_grads_close, grads, model_for, model_type, padded

#: Dropout off (training-mode comparisons with padded batches), under every name these configs use.
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
                  classifier_dropout_prob=0.0, attention_dropout=0.0)
NEW_ENCODERS = ("distilbert", "electra", "modernbert", *MORE_ENCODERS)
POSITIONS_FROM_2 = ("camembert", "xlm-roberta-xl", "mpnet")  # padding_idx + 1 (RoBERTa family, MPNet)
#: Encoders whose plugin runs their own attention per example (the rest go through transformers' interface).
OWN_ATTENTION = ("mpnet", "deberta-v2", "deberta-v2/absolute")
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
    resolved = plan(tiny_config(model_type(name), **TINY[name]), {"task": "hidden_states", "attention": "exact"})
    assert model_type(name) in resolved.architecture.model_types and resolved.architecture.kind == "encoder"
    assert resolved.architecture_plugin != "probe" and "bidirectional" in resolved.features
    assert resolved.position_start == (2 if name in POSITIONS_FROM_2 else 0)


def masked_mean(hidden, mask):
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


@pytest.mark.parametrize("name", MORE_ENCODERS)
def test_mean_embeddings_and_gradients_equal_padded(name):
    """Task embedding (mean pooling), training mode without dropout: embeddings and gradients as padded."""
    model = model_for(name, **NO_DROPOUT).train()
    texts = make_examples([1, 13, 7, 30, 7])
    weight = torch.randn(len(texts), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    inputs = padded(texts)
    want = masked_mean(model(**inputs).last_hidden_state, inputs["attention_mask"])
    (want * weight).sum().backward()
    want_grads = grads(model)
    assembly = assemble(model, {"task": "embedding", "attention": "exact", "pooling": "mean"})
    try:
        got = assembly.forward(model, assembly.collator([{"text_input_ids": t["input_ids"]} for t in texts]))
        (got.embeddings * weight).sum().backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(got.embeddings, want, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want_grads)


SEQ_CLS_CASES = [(name, {}) for name in MORE_ENCODERS] + [
    ("eurobert", dict(classifier_pooling="bos")), ("eurobert", dict(classifier_pooling="mean"))]


@pytest.mark.parametrize(("name", "overrides"), SEQ_CLS_CASES, ids=[f"{n}{'-' if o else ''}{'-'.join(o.values())}"
                                                                    for n, o in SEQ_CLS_CASES])
def test_seq_cls_logits_and_gradients_equal_padded(name, overrides):
    """Task seq_cls with the model's own head (EuroBERT: every classifier_pooling, late by default)."""
    model = model_for(name, head="seq_cls", num_labels=3, **NO_DROPOUT, **overrides).train()
    examples = [{**ex, "label": i % 3} for i, ex in enumerate(make_examples([1, 13, 7, 30, 7]))]
    want = model(**padded(examples), labels=torch.tensor([ex["label"] for ex in examples]))
    want.loss.backward()
    want_grads = grads(model)
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    try:
        got = assembly.forward(model, assembly.collator(examples))
        got.loss.backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want_grads)


def test_probe_takes_an_undeclared_encoder_for_an_encoder():
    """An encoder no plugin declares (ALBERT with its plugin blocked) is probed as an encoder: first-token pooling is
    its default and allowed (a decoder's first token would see only itself), and the CLS embeddings equal padded."""
    model = model_for("albert")
    texts = make_examples([1, 9, 4])
    config = {"task": "embedding", "attention": "exact", "architecture": "probe", "plugins": {"block": ["albert"]}}
    assembly = assemble(model, config)
    try:
        assert assembly.plan.architecture_plugin == "probe"
        assert assembly.plan.architecture.kind == "encoder" and "bidirectional" in assembly.plan.features
        with torch.no_grad():
            got = assembly.forward(model, assembly.collator([{"text_input_ids": t["input_ids"]} for t in texts]))
    finally:
        assembly.undo()
    with torch.no_grad():
        want = model(**padded(texts)).last_hidden_state[:, 0]
    torch.testing.assert_close(got.embeddings, want, atol=1e-5, rtol=1e-5)


def test_probe_checks_a_classifier_on_its_body():
    """The probe compares per-token outputs of the model's body: a sequence classifier's head pools one vector per
    row, which says nothing about packing, so probing it used to refuse every classifier (shape mismatch)."""
    model = model_for("albert", head="seq_cls", num_labels=3)
    examples = [{**ex, "label": i % 3} for i, ex in enumerate(make_examples([1, 9, 4]))]
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact", "architecture": "probe",
                                "plugins": {"block": ["albert"]}})
    try:
        assert assembly.plan.architecture_plugin == "probe"
        with torch.no_grad():
            got = assembly.forward(model, assembly.collator(examples)).logits
    finally:
        assembly.undo()
    with torch.no_grad():
        want = model(**padded(examples)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("model_type", "kind"), [("bert", "encoder"), ("albert", "encoder"), ("llama", "decoder"),
                                                  ("gpt2", "decoder")])
def test_probed_kind_from_the_config(model_type, kind):
    from padfree_plugins.modeling.probe import probed_architecture

    architecture = probed_architecture(tiny_config(model_type))
    assert architecture.kind == kind and architecture.default_pooling == ("first" if kind == "encoder" else "last")
    if model_type == "bert":  # BERT configured as a decoder (BertLMHeadModel) is causal
        assert probed_architecture(tiny_config("bert", is_decoder=True)).kind == "decoder"


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


def test_mpnet_beyond_the_bucket_range_equals_padded_and_undoes(monkeypatch):
    """MPNet's relative position bias, train mode: examples longer than its largest bucket distance (128) and a
    one-token one give the padded hidden states and gradients (the bias table's too); the bias is built per example
    length, never over the packed row; copies run packed on their own; undo gives back MPNet's own forward."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    model = model_for("mpnet", **NO_DROPOUT).train()
    examples = make_examples([150, 1, 140, 9, 1])
    weight = torch.randn(len(examples), 150, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    inputs = padded(examples)
    want = model(**inputs).last_hidden_state * inputs["attention_mask"][..., None]
    (want * weight).sum().backward()
    want_grads = grads(model)
    assert "encoder.relative_attention_bias.weight" in want_grads
    lengths, compute = [], MPNetEncoder.compute_position_bias
    monkeypatch.setattr(MPNetEncoder, "compute_position_bias",
                        lambda self, x, *a, **k: lengths.append(x.shape[1]) or compute(self, x, *a, **k))
    assembly = assemble(model, {"task": "hidden_states", "attention": "exact"})
    batch = assembly.collator(examples)
    got = model(**batch.model_inputs()).last_hidden_state
    assert sorted(lengths) == [1, 9, 140, 150]  # one [1, H, L, L] bias per length, none of T = 301
    check_packed_then_undo(model, assembly, batch, got, (want, weight, want_grads, inputs),
                           replaced=("forward", "compute_position_bias"))


@pytest.mark.parametrize("name", OWN_ATTENTION)
def test_own_attention_examples_do_not_mix(name):
    """Changing one packed example's tokens changes its outputs and leaves every other example's exactly as they
    were: a bias, attention or convolution (DeBERTa-v2's, absolute config) over the whole packed row would carry the
    change across."""
    model = model_for(name)
    examples = make_examples([20, 1, 33, 20])
    changed = [dict(ex) for ex in examples]
    changed[2] = {"input_ids": make_examples([33], seed=7)[0]["input_ids"]}
    with torch.no_grad():
        before, batch = packed_hidden(model, examples)
        after, _ = packed_hidden(model, changed)
    parts_before, parts_after = split_packed(before, batch), split_packed(after, batch)
    for i, (a, b) in enumerate(zip(parts_before, parts_after)):
        if i == 2:
            assert (a - b).abs().max() > 1e-2
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("attention_dropout", ["keep", "disable"])
@pytest.mark.parametrize("name", ["mpnet", "deberta-v2"])
def test_own_attention_dropout(name, attention_dropout):
    """In training MPNet and DeBERTa-v2 drop attention probabilities (``attention_dropout: keep``); ``disable`` turns
    that off, so the packed row then equals the model without dropout."""
    model = model_for(name, **{**NO_DROPOUT, "attention_probs_dropout_prob": 0.5})
    examples = make_examples([9, 1, 17])
    with torch.no_grad():
        want = [out.last_hidden_state[0] for out in per_example(model, examples)]
        assembly = assemble(model.train(), {"task": "hidden_states", "attention": "exact",
                                            "attention_dropout": attention_dropout})
        try:
            batch = assembly.collator(examples)
            got = split_packed(model(**batch.model_inputs()).last_hidden_state, batch)
        finally:
            assembly.undo()
    difference = max((a - b).abs().max() for a, b in zip(got[::2], want[::2]))  # a 1-token example attends to itself
    assert (difference < 1e-5) == (attention_dropout == "disable")


@pytest.mark.parametrize("backend", ["repad", "varlen", "flash_attn"])
@pytest.mark.parametrize(("name", "label"), [("mpnet", "MPNet"), ("deberta-v2", "DeBERTa-v2")])
def test_own_attention_refuses_a_backend_that_cannot_run_it(name, label, backend):
    """None of these backends takes MPNet's relative position bias or computes DeBERTa-v2's disentangled attention.
    On a GPU they resolve, so the plugin refuses them itself (here its hook is called as assembly calls it, since on
    a CPU the backend is refused first)."""
    from padfree_plugins import BackendUnavailableError
    from padfree_plugins.builtin.architectures import deberta_v2, mpnet
    from padfree_plugins.config.schema import load_config

    plugin, architecture = {"mpnet": (mpnet, mpnet.MPNET), "deberta-v2": (deberta_v2, deberta_v2.DEBERTA_V2)}[name]
    model = model_for(name)
    config = load_config({"task": "hidden_states", "attention": backend})
    with pytest.raises(BackendUnavailableError, match=f"attention: {backend} cannot run {label}"):
        plugin.patch_model(model=model, architecture=architecture, backend=None, fallback=None, config=config)
    assert getattr(model, "_padfree_patch", None) is None


@pytest.mark.parametrize("name", ["deberta-v2", "deberta-v2/absolute"])
def test_deberta_v2_per_length_relative_positions_no_row_mask_and_undo(name, monkeypatch):
    """DeBERTa-v2, train mode: examples longer than its buckets / largest relative distance and one-token ones give
    the padded hidden states and gradients (the relative embeddings' too); relative positions are built once per
    example length and neither they nor the mask over the packed row (T × T) are ever built; copies run packed on
    their own; undo gives back DeBERTa's own methods, and the padded outputs exactly."""
    from transformers.models.deberta_v2 import modeling_deberta_v2 as deberta

    model = model_for(name, **NO_DROPOUT).train()
    examples = make_examples([40, 1, 33, 9, 1, 33])
    weight = torch.randn(len(examples), 40, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    inputs = padded(examples)
    want = model(**inputs).last_hidden_state * inputs["attention_mask"][..., None]
    (want * weight).sum().backward()
    want_grads = grads(model)
    assert "encoder.rel_embeddings.weight" in want_grads
    assert (model.encoder.conv is not None) == (name == "deberta-v2/absolute")
    sizes, build, masks = [], deberta.build_relative_position, []
    monkeypatch.setattr(deberta, "build_relative_position",
                        lambda q, k, *a, **kw: sizes.append((q.shape[-2], k.shape[-2])) or build(q, k, *a, **kw))
    mask = deberta.DebertaV2Encoder.get_attention_mask
    monkeypatch.setattr(deberta.DebertaV2Encoder, "get_attention_mask",
                        lambda self, m: masks.append(m) or mask(self, m))
    assembly = assemble(model, {"task": "hidden_states", "attention": "exact"})
    batch = assembly.collator(examples)
    got = model(**batch.model_inputs()).last_hidden_state
    assert sorted(sizes) == [(1, 1), (9, 9), (33, 33), (40, 40)] and not masks  # nothing of T = 117
    check_packed_then_undo(model, assembly, batch, got, (want, weight, want_grads, inputs),
                           replaced=("forward", "get_attention_mask", "get_rel_pos"))


def test_deberta_v2_sentence_pairs_with_token_types_and_absolute_positions():
    """Cross-encoder pairs on the absolute-position DeBERTa-v2 (token types, positions restarting at 0, the encoder's
    convolution): seq_cls logits equal padded, and the token types matter."""
    from tests.tasks_common import pair_examples

    model = model_for("deberta-v2/absolute", head="seq_cls", num_labels=1)
    examples = [{**ex, "label": float(i % 2)} for i, ex in enumerate(pair_examples([2, 1, 17, 9, 30]))]
    with torch.no_grad():
        labels = torch.tensor([ex["label"] for ex in examples])  # with labels DeBERTa's regression logits are [n]
        want = model(**padded(examples, keys=("input_ids", "token_type_ids")), labels=labels).logits
        assembly = assemble(model, {"task": "seq_cls", "attention": "exact", "task_options": {"pairs": True}})
        try:
            batch = assembly.collator(examples)
            assert "token_type_ids" in batch
            got = assembly.forward(model, batch).logits
        finally:
            assembly.undo()
        plain = model(**padded(examples), labels=labels).logits  # token types all 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (plain - got).abs().max() > 1e-4


def check_packed_then_undo(model, assembly, batch, got, padded_run, replaced):
    """A model with its own attention code: packed outputs and gradients equal the padded run's (``want``,
    ``weight``, ``want_grads``, ``inputs``); copies run packed; undo removes every replaced method and hook, and
    the model gives its padded outputs again, bit for bit."""
    want, weight, want_grads, inputs = padded_run
    for i, part in enumerate(split_packed(got, batch)):
        torch.testing.assert_close(part, want[i, : len(part)], atol=1e-5, rtol=1e-5)
        (part * weight[i, : len(part)]).sum().backward(retain_graph=True)
    assert_grads_close(grads(model), want_grads)
    with torch.no_grad():
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            torch.testing.assert_close(other(**batch.model_inputs()).last_hidden_state, got, atol=1e-6, rtol=0)
        assembly.undo()
        assert not any(name in module.__dict__ for module in model.modules() for name in replaced)
        assert not model._forward_pre_hooks and not model.embeddings._forward_pre_hooks
        again = model(**inputs).last_hidden_state * inputs["attention_mask"][..., None]
    torch.testing.assert_close(again, want, atol=0, rtol=0)
