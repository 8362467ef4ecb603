"""Task seq_cls: per-example heads on a packed row equal the model's own padded forward — logits, loss (every
problem type) and gradients — for every encoder and decoder plugin and every hybrid family with a classifier; bad
inputs are clear errors."""

from __future__ import annotations

import pickle

import pytest
import torch

from padfree_plugins import BatchError, ConfigError, UnsupportedArchitectureError, assemble
from tests.conftest import make_examples
from tests.tasks_common import ARCHITECTURES, assert_grads_close, grads, lengths_for, model_for, padded, pair_examples

CONFIG = "configs/seq_cls.yaml"
PROBLEMS = {
    "single_label": dict(num_labels=3),
    "regression": dict(num_labels=1),
    "multi_label": dict(num_labels=3, problem_type="multi_label_classification"),
}


def labelled(examples, problem):
    for i, ex in enumerate(examples):
        ex["label"] = {"single_label": i % 3, "regression": 0.5 * i - 1.0,
                       "multi_label": [float(i % 2), 1.0, float(i % 3 == 0)]}[problem]
    return examples


def padded_reference(model, examples, keys=("input_ids",)):
    """The model's own forward on a right-padded batch, with labels: (loss, logits, gradients)."""
    inputs = padded(examples, keys)
    labels = [ex["label"] for ex in examples]
    labels = torch.tensor(labels, dtype=torch.long if isinstance(labels[0], int) else torch.float)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), grads(model)


def packed_run(model, examples, config=None):
    assembly = assemble(model, config or CONFIG)
    try:
        batch = assembly.collator(examples)
        out = assembly.forward(model, batch)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), grads(model)
    finally:
        assembly.undo()


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_loss_and_gradients_equal_padded(name, problem):
    model = model_for(name, head="seq_cls", **PROBLEMS[problem])
    examples = labelled(make_examples(lengths_for(name, [1, 13, 7, 30, 7])), problem)  # one token, equal lengths
    want_loss, want_logits, want_grads = padded_reference(model, examples)
    loss, logits, got_grads = packed_run(model, examples)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(got_grads, want_grads)


#: Labels DeBERTa-v2's own loss treats apart from transformers' shared one (``problem_type`` unset).
DEBERTA_LABELS = {
    "soft-targets": [[0.2, 0.5, 0.3], [1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]],
    "some-left-out": [2, -100, 0, -100, 1],
}


@pytest.mark.parametrize("labels", DEBERTA_LABELS.values(), ids=DEBERTA_LABELS.keys())
def test_deberta_v2_keeps_its_own_loss(labels):
    """DeBERTa-v2's classifier computes its own loss when ``problem_type`` is unset (soft targets take a soft
    cross-entropy, class labels below 0 are left out); the packed run takes the same loss, not the shared one."""
    model = model_for("deberta-v2", head="seq_cls", num_labels=3)
    examples = make_examples([1, 13, 7, 30, 7])
    for example, label in zip(examples, labels):
        example["label"] = label
    want_loss, want_logits, want_grads = padded_reference(model, examples)
    loss, logits, got_grads = packed_run(model, examples)
    assert model.config.problem_type is None
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(got_grads, want_grads)


def test_deberta_v2_loss_is_zero_when_every_label_is_left_out():
    model = model_for("deberta-v2", head="seq_cls", num_labels=3)
    examples = make_examples([1, 13, 7])
    for example in examples:
        example["label"] = -100
    want = model(**padded(examples), labels=torch.tensor([-100] * 3))
    assembly = assemble(model, CONFIG)
    try:
        got = assembly.forward(model, assembly.collator(examples))
    finally:
        assembly.undo()
    assert want.loss.item() == got.loss.item() == 0.0
    torch.testing.assert_close(got.logits, want.logits.detach(), atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("name", ["bert", "llama"])
def test_batch_of_one(name):
    model = model_for(name, head="seq_cls", num_labels=3)
    examples = labelled(make_examples([9]), "single_label")
    want_loss, want_logits, want_grads = padded_reference(model, examples)
    loss, logits, got_grads = packed_run(model, examples)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(got_grads, want_grads)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decoder_heads_skip_pad_id_tokens_as_transformers_does(name):
    """Decoder heads read "the rightmost token that is not the pad id" (transformers finds a right-padded row's end
    that way), so an example ending in real pad-id tokens (an EOS doubling as pad token) is scored at the token
    before them, and one made only of pad ids at its first token. Packed: the same tokens, per example."""
    from tests.tasks_common import PAD

    model = model_for(name, head="seq_cls", num_labels=3)
    examples = labelled(make_examples([6, 9, 4, 7]), "single_label")
    examples[0]["input_ids"][-1] = PAD  # ends in one pad-id token
    examples[1]["input_ids"][-3:] = [PAD] * 3  # in three
    examples[2]["input_ids"][:] = [PAD] * 4  # nothing but pad ids
    examples[3]["input_ids"][2] = PAD  # one inside: not the end, so the last token still counts
    want_loss, want_logits, want_grads = padded_reference(model, examples)
    loss, logits, got_grads = packed_run(model, examples)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(got_grads, want_grads)


def test_modernbert_mean_classifier_pooling():
    model = model_for("modernbert", head="seq_cls", num_labels=3, classifier_pooling="mean")
    examples = labelled(make_examples([1, 11, 6]), "single_label")
    want_loss, want_logits, want_grads = padded_reference(model, examples)
    loss, logits, got_grads = packed_run(model, examples)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    assert_grads_close(got_grads, want_grads)


@pytest.mark.parametrize("name", ["bert", "electra"])
def test_sentence_pairs_carry_token_type_ids(name):
    model = model_for(name, head="seq_cls", num_labels=3)
    examples = labelled(pair_examples([2, 9, 17]), "single_label")
    want_loss, want_logits, _ = padded_reference(model, examples, keys=("input_ids", "token_type_ids"))
    loss, logits, _ = packed_run(model, examples, {"task": "seq_cls", "attention": "exact",
                                                   "task_options": {"pairs": True}})
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    # and the token types matter: without them the logits change
    plain = [{"input_ids": ex["input_ids"], "label": ex["label"]} for ex in examples]
    _, plain_logits, _ = packed_run(model, plain)
    assert (plain_logits - logits).abs().max() > 1e-4


def test_missing_token_type_ids_for_a_pair_model_is_an_error():
    model = model_for("bert", head="seq_cls", num_labels=2)  # type_vocab_size=2
    assembly = assemble(model, {"task": "seq_cls", "task_options": {"pairs": True}})
    try:
        with pytest.raises(BatchError, match=r"sentence pairs .*type_vocab_size=2.* no 'token_type_ids'"):
            assembly.collator(make_examples([3, 4]))
        one_segment = [{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 0]}]
        with pytest.raises(BatchError, match=r"example 0 is marked as a sentence pair .* token_type_ids are all 0"):
            assembly.collator(one_segment)
    finally:
        assembly.undo()


def test_pairs_need_no_token_types_without_a_token_type_vocabulary():
    model = model_for("distilbert", head="seq_cls", num_labels=2)  # no type_vocab_size
    assembly = assemble(model, {"task": "seq_cls", "task_options": {"pairs": True}})
    try:
        assert "token_type_ids" not in assembly.collator(make_examples([3, 4]))
    finally:
        assembly.undo()


def test_inference_batches_need_no_labels_and_labels_are_all_or_none():
    model = model_for("bert", head="seq_cls", num_labels=2)
    assembly = assemble(model, CONFIG)
    try:
        batch = assembly.collator(make_examples([3, 4]))
        out = assembly.forward(model, batch)
        assert out.loss is None and out.logits.shape == (2, 2)
        examples = make_examples([3, 4])
        examples[0]["label"] = 1
        with pytest.raises(BatchError, match="present in some examples but not in example 1"):
            assembly.collator(examples)
    finally:
        assembly.undo()


def test_a_label_outside_the_models_classes_names_the_example():
    model = model_for("bert", head="seq_cls", num_labels=3)
    assembly = assemble(model, CONFIG)
    try:
        examples = make_examples([3, 4, 5])
        for example, label in zip(examples, (0, -100, 2)):  # -100 is ignored, as by the padded loss
            example["label"] = label
        assert assembly.collator(examples)["labels"].tolist() == [0, -100, 2]
        examples[2]["label"] = 7
        with pytest.raises(BatchError, match=r"example 2 has label 7, but the model has num_labels=3 \(classes 0 to 2"):
            assembly.collator(examples)
    finally:
        assembly.undo()


def test_unknown_task_option_is_an_error():
    model = model_for("bert", head="seq_cls")
    with pytest.raises(ConfigError, match="'pair' is not an option of task 'seq_cls'. Did you mean 'pairs'"):
        assemble(model, {"task": "seq_cls", "task_options": {"pair": True}})


def test_unknown_head_is_refused():
    from padfree_plugins.modeling.heads import sequence_head

    class Strange(torch.nn.Module):
        config = type("C", (), {"model_type": "strange"})()

        def set_attn_implementation(self, name):
            pass

    with pytest.raises(UnsupportedArchitectureError, match="does not know how this sequence-classification head"):
        sequence_head(Strange())


def test_collator_and_forward_pickle():
    model = model_for("bert", head="seq_cls", num_labels=2)
    assembly = assemble(model, CONFIG)
    try:
        collator, forward = pickle.loads(pickle.dumps((assembly.collator, assembly.forward)))
        examples = labelled(make_examples([3, 5]), "single_label")
        torch.testing.assert_close(forward(model, collator(examples)).logits,
                                   assembly.forward(model, assembly.collator(examples)).logits)
    finally:
        assembly.undo()


@pytest.mark.parametrize("model_type, head, task, message", [
    ("bert", "base", "seq_cls", "task seq_cls needs a model with a sequence-classification head; BertModel has none"),
    ("llama", "causal_lm", "seq_cls", "LlamaForCausalLM has none"),
    ("bert", "base", "causal_lm", "task causal_lm needs a model with a language-model head; BertModel has none"),
    ("llama", "seq_cls", "causal_lm", "LlamaForSequenceClassification has none"),
])
def test_a_model_without_the_tasks_head_is_refused_at_assembly(model_type, head, task, message):
    from padfree_plugins import patch_of
    from tests.conftest import tiny_model

    model = tiny_model(model_type, head=head)
    with pytest.raises(UnsupportedArchitectureError, match=message):
        assemble(model, {"task": task})
    assert patch_of(model) is None
