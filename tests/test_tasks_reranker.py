"""Task reranker: pointwise, listwise (explicit query groups, unequal sizes) and generative yes/no scores equal the
padded model's, with the same losses and gradients; bad groups and missing options are clear errors."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from padfree_plugins import BatchError, ConfigError, UnsupportedArchitectureError, assemble
from tests.conftest import make_examples
from tests.hybrids_common import HYBRIDS
from tests.tasks_common import (
    ARCHITECTURES,
    DECODERS,
    HYBRID_CLASSIFIERS,
    assert_grads_close,
    grads,
    lengths_for,
    model_for,
    padded,
    pair_examples,
)

LISTWISE = "configs/reranker_listwise.yaml"
YES, NO = 17, 42


def padded_scores(model, examples, keys=("input_ids",)):
    inputs = padded(examples, keys)
    return model(**inputs).logits[:, 0]


def run(model, examples, config):
    assembly = assemble(model, config)
    try:
        out = assembly.forward(model, assembly.collator(examples))
        if out.loss is not None:
            out.loss.backward()
        return out, grads(model)
    finally:
        assembly.undo()


def grouped(examples, groups, positives):
    """Attach ``group`` and a 0/1 label (1 at the positions in ``positives``) to the examples."""
    for i, (ex, group) in enumerate(zip(examples, groups)):
        ex["group"], ex["label"] = group, int(i in positives)
    return examples


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_pointwise_bce_equals_padded(name):
    model = model_for(name, head="seq_cls", num_labels=1)
    typed = (getattr(model.config, "type_vocab_size", 0) or 0) > 1  # BERT, XLM-R: pairs carry token types
    lengths = lengths_for(name, [1, 12, 5, 5, 30])
    examples = pair_examples(lengths) if typed else make_examples(lengths)
    for i, ex in enumerate(examples):
        ex["label"] = float(i % 2)
    keys = ("input_ids", "token_type_ids") if typed else ("input_ids",)
    scores = padded_scores(model, examples, keys)
    F.binary_cross_entropy_with_logits(scores, torch.tensor([ex["label"] for ex in examples])).backward()
    want = grads(model)
    out, got = run(model, examples, {"task": "reranker", "attention": "exact"})
    torch.testing.assert_close(out.scores.detach(), scores.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(got, want)


def listwise_reference(scores, sizes, positives):
    """Per-query softmax cross-entropy, one query at a time."""
    losses, start = [], 0
    for size, positive in zip(sizes, positives):
        losses.append(F.cross_entropy(scores[start : start + size][None], torch.tensor([positive - start])))
        start += size
    return torch.stack(losses).mean()


@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_listwise_with_unequal_groups_equals_padded(name):
    model = model_for(name, head="seq_cls", num_labels=1)
    # groups of 3, 1 and 4 examples; positives not always first; a one-token example
    examples = grouped(pair_examples([4, 9, 1, 6, 3, 11, 2, 7]) if name == "bert" else make_examples([4, 9, 1, 6, 3, 11,
                                                                                                     2, 7]),
                       groups=[10, 10, 10, 3, 7, 7, 7, 7], positives={1, 3, 7})
    keys = ("input_ids", "token_type_ids") if name == "bert" else ("input_ids",)
    scores = padded_scores(model, examples, keys)
    want_loss = listwise_reference(scores, [3, 1, 4], [1, 3, 7])
    want_loss.backward()
    want = grads(model)
    out, got = run(model, examples, LISTWISE)
    torch.testing.assert_close(out.scores.detach(), scores.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.detach(), want_loss.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(got, want)


def test_collator_and_forward_pickle():
    model = model_for("bert", head="seq_cls", num_labels=1)
    assembly = assemble(model, LISTWISE)
    try:
        collator, forward = pickle.loads(pickle.dumps((assembly.collator, assembly.forward)))
        examples = grouped(pair_examples([3, 5, 2]), groups=[0, 0, 1], positives={0, 2})
        torch.testing.assert_close(forward(model, collator(examples)).loss,
                                   assembly.forward(model, assembly.collator(examples)).loss)
    finally:
        assembly.undo()


def test_listwise_batch_of_one_group_of_one():
    model = model_for("bert", head="seq_cls", num_labels=1)
    out, _ = run(model, grouped(pair_examples([5]), [0], {0}), LISTWISE)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)  # softmax over a single candidate


#: The hybrid families without a sequence-classification class rerank generatively here (their causal LMs), so that
#: each is checked in a second per-example task besides the embedding one.
GENERATIVE = [*DECODERS, *(name for name in HYBRIDS if name not in HYBRID_CLASSIFIERS)]


@pytest.mark.parametrize("name", GENERATIVE)
def test_generative_yes_no_equals_padded_lm_logits(name):
    model = model_for(name, head="causal_lm")
    examples = make_examples(lengths_for(name, [1, 8, 20, 8]))
    for i, ex in enumerate(examples):
        ex["label"] = float(i % 2)
    inputs = padded(examples)
    last = inputs["attention_mask"].sum(1) - 1
    logits = model(**inputs).logits[torch.arange(len(examples)), last][:, [YES, NO]]
    scores = logits[:, 0] - logits[:, 1]
    F.binary_cross_entropy_with_logits(scores, torch.tensor([ex["label"] for ex in examples])).backward()
    want = grads(model)
    config = {"task": "reranker", "attention": "exact",
              "task_options": {"scorer": "yes_no", "yes_token_id": YES, "no_token_id": NO}}
    out, got = run(model, examples, config)
    torch.testing.assert_close(out.logits.detach(), logits.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.scores.detach(), scores.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(got, want)


def test_generative_listwise():
    model = model_for("qwen3", head="causal_lm")
    examples = grouped(make_examples([3, 5, 2, 9, 4]), groups=[0, 0, 1, 1, 1], positives={0, 4})
    inputs = padded(examples)
    last = inputs["attention_mask"].sum(1) - 1
    logits = model(**inputs).logits[torch.arange(5), last][:, [YES, NO]]
    want = listwise_reference(logits[:, 0] - logits[:, 1], [2, 3], [0, 4])
    config = {"task": "reranker", "attention": "exact", "task_options": {
        "objective": "listwise", "scorer": "yes_no", "yes_token_id": YES, "no_token_id": NO}}
    out, _ = run(model, examples, config)
    torch.testing.assert_close(out.loss.detach(), want.detach(), atol=1e-5, rtol=1e-5)


def test_rows_holding_a_whole_group_are_expanded(listwise_assembly):
    """One row per query (its candidates as a list): what a shuffling sampler needs to keep groups whole."""
    model, assembly = listwise_assembly
    candidates = make_examples([3, 5, 2, 4, 6])
    rows = [{"input_ids": [c["input_ids"] for c in candidates[:2]], "labels": [0, 1]},
            {"input_ids": [c["input_ids"] for c in candidates[2:]], "labels": [1, 0, 0]}]
    flat = grouped(make_examples([3, 5, 2, 4, 6]), groups=[0, 0, 1, 1, 1], positives={1, 2})
    batch, want = assembly.collator(rows), assembly.collator(flat)
    for key in ("input_ids", "cu_seq_lens_q", "group_index", "group_position", "positive_position", "labels"):
        assert torch.equal(batch[key], want[key]), key
    rows[1]["labels"] = [1, 0]
    with pytest.raises(BatchError, match="row 1 has 3 candidates in input_ids but 2 labels"):
        assembly.collator(rows)


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.fixture
def listwise_assembly():
    model = model_for("llama", head="seq_cls", num_labels=1)
    assembly = assemble(model, LISTWISE)
    yield model, assembly
    assembly.undo()


def test_group_without_positive(listwise_assembly):
    _, assembly = listwise_assembly
    examples = grouped(make_examples([3, 4, 5, 2]), groups=[1, 1, 2, 2], positives={0})
    with pytest.raises(BatchError, match=r"group 2 has no positive \(no example with label 1\)"):
        assembly.collator(examples)


def test_group_with_two_positives(listwise_assembly):
    _, assembly = listwise_assembly
    examples = grouped(make_examples([3, 4, 5]), groups=[1, 1, 1], positives={0, 2})
    with pytest.raises(BatchError, match="group 1 has more than one positive"):
        assembly.collator(examples)


def test_group_not_contiguous(listwise_assembly):
    _, assembly = listwise_assembly
    examples = grouped(make_examples([3, 4, 5, 2]), groups=[1, 2, 1, 2], positives={0, 1})
    with pytest.raises(BatchError, match=r"group 1 is not contiguous: its examples are at positions \[0, 2\]"):
        assembly.collator(examples)


def test_missing_group(listwise_assembly):
    _, assembly = listwise_assembly
    examples = make_examples([3, 4])
    with pytest.raises(BatchError, match="listwise ranking needs 'group' .* example 0 has none"):
        assembly.collator(examples)


def test_group_ids_that_do_not_match_the_examples(listwise_assembly):
    model, assembly = listwise_assembly
    batch = assembly.collator(grouped(make_examples([3, 4, 5]), groups=[1, 1, 2], positives={0, 2}))
    batch["group_index"] = batch["group_index"][:-1]
    with pytest.raises(BatchError, match="group ids for 2 examples but 3 examples"):
        assembly.forward(model, batch)
    del batch["max_group_size"]
    with pytest.raises(BatchError, match="needs the group keys 'max_group_size'"):
        assembly.forward(model, batch)


def test_listwise_labels_must_be_binary(listwise_assembly):
    _, assembly = listwise_assembly
    examples = grouped(make_examples([3, 4]), groups=[1, 1], positives={0})
    examples[1]["label"] = 0.5
    with pytest.raises(BatchError, match="labels must be 1 .* or 0"):
        assembly.collator(examples)


def test_head_reranker_needs_one_label():
    model = model_for("bert", head="seq_cls", num_labels=2)
    assembly = assemble(model, {"task": "reranker", "task_options": {"pairs": False}})
    try:
        with pytest.raises(UnsupportedArchitectureError, match="needs num_labels=1; it has 2"):
            assembly.forward(model, assembly.collator(make_examples([3])))
    finally:
        assembly.undo()


def test_yes_no_needs_token_ids():
    model = model_for("llama", head="causal_lm")
    with pytest.raises(ConfigError, match="scorer yes_no needs yes_token_id"):
        assemble(model, {"task": "reranker", "task_options": {"scorer": "yes_no"}})
    with pytest.raises(ConfigError, match="objective of task 'reranker' must be one of 'pointwise', 'listwise'"):
        assemble(model, {"task": "reranker", "task_options": {"objective": "listwize"}})


def test_cross_encoder_pairs_need_token_type_ids():
    model = model_for("bert", head="seq_cls", num_labels=1)
    assembly = assemble(model, {"task": "reranker"})  # pairs: true by default
    try:
        with pytest.raises(BatchError, match="no 'token_type_ids'"):
            assembly.collator(make_examples([3, 4]))
    finally:
        assembly.undo()
