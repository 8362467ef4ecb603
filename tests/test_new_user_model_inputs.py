"""What a new user found calling a packed batch by hand (the recipe of docs/lower-level.md): every key the task's
model needs reaches it (``token_type_ids`` of sentence pairs, causal-LM ``labels``), keys a bare model would misread
never do, and a head that pools one token per row refuses a packed row instead of answering once for all examples."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch

from padfree_plugins import BoundaryError, assemble, patch_of
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.packing.collator import PackingCollator
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from padfree_plugins.packing.padded import pad_examples
from tests.conftest import make_examples, split_packed, tiny_model

CONTRACT_KEYS = {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def sentence_pairs():
    """Two (sentence A, sentence B) examples with BERT token types: 0 for A, 1 for B."""
    examples = make_examples([7, 5], seed=3)
    examples[0]["token_type_ids"] = [0, 0, 0, 1, 1, 1, 1]
    examples[1]["token_type_ids"] = [0, 0, 1, 1, 1]
    return examples


def test_bert_sentence_pairs_keep_their_token_types_through_model_inputs():
    """``model(**batch.model_inputs())`` on sentence pairs used to drop ``token_type_ids``: every token then took
    type 0, and the pair vectors came out ~1 off the padded model's."""
    model = tiny_model("bert")
    examples = sentence_pairs()
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([ex["input_ids"]]), token_type_ids=torch.tensor([ex["token_type_ids"]]))
                 .last_hidden_state[0] for ex in examples]
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        batch = assembly.collator(examples)
        inputs = batch.model_inputs()
        assert set(inputs) == CONTRACT_KEYS | {"token_type_ids"}
        with torch.no_grad():
            packed = model(**inputs).last_hidden_state
            through_forward = assembly.forward(model, batch).last_hidden_state
        for got, want in zip(split_packed(packed, batch), alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(through_forward, packed, atol=0, rtol=0)
        moved = batch.to("cpu")  # what a user does before the forward: the record travels with the copy
        assert "token_type_ids" in moved.model_inputs()
    finally:
        assembly.undo()


def test_causal_lm_model_inputs_carry_labels_and_give_the_padded_loss():
    """``model(**batch.model_inputs()).loss`` used to be ``None`` (labels dropped): it is the padded model's loss."""
    model = tiny_model("llama", "causal_lm")
    examples = make_examples([6, 3, 9], seed=1)
    padded = pad_examples(examples, ("input_ids", "labels"), pad_token_id=0)
    with torch.no_grad():
        want = model(**padded, use_cache=False).loss
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = assembly.collator(examples)
        inputs = batch.model_inputs()
        assert set(inputs) == CONTRACT_KEYS | {"labels"}
        with torch.no_grad():
            got = model(**inputs).loss
            through_forward = assembly.forward(model, batch).loss
        assert got is not None
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(through_forward, got, atol=0, rtol=0)
    finally:
        assembly.undo()


def test_labelled_logits_keys_are_only_passed_when_named():
    """``logits_to_keep`` / ``shift_labels`` (what trainers add) would make a bare model return logits for some
    positions only: ``model_inputs()`` leaves them out unless they are asked for."""
    model = tiny_model("llama", "causal_lm")
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = keep_labelled_logits(assembly.collator(make_examples([4, 5])))
        assert {"logits_to_keep", "shift_labels"} <= set(batch)
        assert set(batch.model_inputs()) == CONTRACT_KEYS | {"labels"}
        asked = batch.model_inputs("logits_to_keep", "shift_labels")
        assert {"logits_to_keep", "shift_labels", "labels"} <= set(asked)
        with torch.no_grad():
            assert model(**batch.model_inputs()).logits.shape[1] == batch.num_tokens
    finally:
        assembly.undo()


@pytest.mark.parametrize("task", ["seq_cls", "reranker", "embedding"])
def test_per_example_keys_never_reach_the_model(task):
    """A class label / relevance label is one value per example (``[n]``): never a model input of a packed row."""
    model = tiny_model("bert", "seq_cls", num_labels=1) if task == "reranker" else tiny_model(
        "bert", "seq_cls" if task == "seq_cls" else "base", num_labels=3)
    assembly = assemble(model, {"task": task})
    try:
        label = 1.0 if task == "reranker" else 1
        examples = [{**ex, "label": label} for ex in sentence_pairs()]
        batch = assembly.collator(examples)
        assert "labels" in batch and batch["labels"].shape[0] == 2
        assert "labels" not in batch.model_inputs()
        assert "token_type_ids" in batch.model_inputs()
    finally:
        assembly.undo()


def test_the_record_survives_copies_and_a_rebuilt_batch_falls_back_to_per_token_keys():
    collator = PackingCollator(token_keys=("token_type_ids", "labels"), model_keys=("token_type_ids", "labels"),
                               example_keys=("label",))
    batch = collator([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "token_type_ids": [0, 1, 1], "label": 2},
                      {"input_ids": [8, 9], "labels": [8, 9], "token_type_ids": [0, 1], "label": 0}])
    assert batch.model_keys == ("token_type_ids", "labels")
    for copied in (batch.to("cpu"), pickle.loads(pickle.dumps(batch)), copy.copy(batch), copy.deepcopy(batch)):
        assert set(copied.model_inputs()) == CONTRACT_KEYS | {"token_type_ids", "labels"}
    rebuilt = PackedBatch(dict(batch))  # what Trainer / accelerate do when they move a batch to a device
    assert rebuilt.model_keys is None
    assert set(rebuilt.model_inputs()) == CONTRACT_KEYS | {"token_type_ids", "labels"}
    per_example = PackedBatch({**batch, "labels": torch.tensor([2, 0])})  # labels [n], not per token
    assert set(per_example.model_inputs()) == CONTRACT_KEYS | {"token_type_ids"}
    # a plain collator records only token_type_ids: keys it merely carries are named when wanted
    plain = PackingCollator(token_keys=("labels",))([{"input_ids": [1, 2], "labels": [1, 2]}])
    assert plain.model_keys == () and "labels" not in plain.model_inputs()


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_a_sequence_classifier_refuses_a_packed_row_in_its_own_forward(model_type):
    """``*ForSequenceClassification`` pools one token per row: on a packed row of two examples it used to return one
    logit row for both. It refuses; ``assembly.forward`` gives one per example; padded calls are unchanged."""
    model = tiny_model(model_type, "seq_cls", num_labels=3, pad_token_id=0)
    examples = [{**ex, "label": i} for i, ex in enumerate(make_examples([5, 4], seed=2))]
    padded = pad_examples(examples, pad_token_id=0)
    with torch.no_grad():
        before = model(**padded).logits
    assembly = assemble(model, {"task": "seq_cls"})
    try:
        batch = assembly.collator(examples)
        with pytest.raises(BoundaryError, match=r"pools one token per row.*2 examples.*assembly\.forward"):
            model(**batch.model_inputs())
        with torch.no_grad():
            per_example = assembly.forward(model, batch).logits
            after = model(**padded).logits
        assert per_example.shape == (2, 3)
        torch.testing.assert_close(per_example, before, atol=1e-5, rtol=0)
        torch.testing.assert_close(after, before, atol=0, rtol=0)
    finally:
        assembly.undo()


def page_recipe() -> str:
    """The first code block of docs/lower-level.md ("Assemble a model yourself")."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "lower-level.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_recipe_runs_sentence_pairs_exactly():
    """The recipe as docs/lower-level.md prints it, on BERT sentence pairs: the pair vectors equal padded ones."""
    model = tiny_model("bert")
    examples = sentence_pairs()
    padded = pad_examples(examples, ("input_ids", "token_type_ids"), pad_token_id=0)
    with torch.no_grad():
        want = model(**padded).last_hidden_state
        namespace = {"model": model, "examples": examples}
        exec(compile(page_recipe(), "docs/lower-level.md", "exec"), namespace)  # noqa: S102 - the page's own code
    padded_out, mask = namespace["padded"], namespace["mask"]
    torch.testing.assert_close(padded_out * mask[..., None], want * mask[..., None], atol=1e-5, rtol=0)
    assert patch_of(model) is None  # the recipe ends with undo()
