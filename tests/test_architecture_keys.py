"""Model inputs an architecture declares beyond the task's keys (``Architecture.token_keys`` / ``example_keys``) travel
through the collator and the forward: X-MOD's per-example ``lang_ids``, RoCBert's per-token shape / pronunciation
ids, LayoutLM's per-token boxes (``[L, 4]`` -> ``[1, T, 4]``) — packed equals padded for ``hidden_states`` and
``seq_cls`` with nothing added to the batch by hand. A parameter of the model's forward that no declaration carries is
refused (rather than dropped); ordinary extra columns stay ignored."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import BatchError, assemble
from padfree_plugins.modeling import heads
from padfree_plugins.packing.collator import PackingCollator
from tests.conftest import make_examples
from tests.tasks_common import assert_grads_close, grads, model_for, padded

LENGTHS = [1, 7, 13, 7, 30, 3]
LANGUAGES = [0, 1, 1, 0, 0, 1]  # en_XX, de_DE (default_language) per example
TOKEN_KEYS = {"roc_bert": ("input_shape_ids", "input_pronunciation_ids"), "layoutlm": ("bbox",)}
HIDDEN = {"task": "hidden_states", "attention": "exact"}
SEQ_CLS = {"task": "seq_cls", "attention": "exact"}


def with_inputs(name: str, examples: list[dict]) -> list[dict]:
    """``examples`` with the family's own inputs, as a dataset gives them (Python lists; boxes as lists of 4)."""
    generator = torch.Generator().manual_seed(5)
    if name == "xmod":
        return [{**ex, "lang_ids": lang} for ex, lang in zip(examples, LANGUAGES)]
    out = []
    for ex in examples:
        n, ex = len(ex["input_ids"]), dict(ex)
        for key in TOKEN_KEYS[name]:
            if key == "bbox":  # x0 <= x1, y0 <= y1 as LayoutLM's boxes are
                boxes = torch.randint(0, 1000, (n, 2, 2), generator=generator).sort(dim=1).values
                ex[key] = boxes.reshape(n, 4).tolist()
            else:
                ex[key] = torch.randint(5, 64, (n,), generator=generator).tolist()
        out.append(ex)
    return out


def padded_inputs(name: str, examples: list[dict]) -> dict:
    """The reference padded batch: tokens, mask and the family's inputs (one language per row, zeros past the end)."""
    batch = padded(examples)
    if name == "xmod":
        batch["lang_ids"] = torch.tensor([ex["lang_ids"] for ex in examples])
        return batch
    longest = batch["input_ids"].shape[1]
    for key in TOKEN_KEYS[name]:
        rows = [torch.tensor(ex[key]) for ex in examples]
        values = torch.zeros(len(rows), longest, *rows[0].shape[1:], dtype=torch.long)
        for i, row in enumerate(rows):
            values[i, : len(row)] = row
        batch[key] = values
    return batch


FAMILIES = ("xmod", "roc_bert", "layoutlm")


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_states_with_the_family_inputs_equal_padded(name):
    """Through ``assembly.collator`` and ``assembly.forward`` (and ``batch.model_inputs()``), every example's hidden
    states equal the padded model's with its inputs — which differ from those without them (the inputs matter)."""
    model = model_for(name)
    examples = with_inputs(name, make_examples(LENGTHS))
    with torch.no_grad():
        reference = padded_inputs(name, examples)
        want = model(**reference).last_hidden_state
        without = model(**padded(examples)).last_hidden_state
    assembly = assemble(model, HIDDEN)
    try:
        batch = assembly.collator(examples)
        with torch.no_grad():
            got = assembly.forward(model, batch).last_hidden_state
            direct = model(**batch.model_inputs()).last_hidden_state
    finally:
        assembly.undo()
    cu = batch["cu_seq_lens_q"].tolist()
    changed = 0.0
    for i, n in enumerate(batch.lengths.tolist()):
        for packed in (got, direct):
            torch.testing.assert_close(packed[0, cu[i] : cu[i + 1]], want[i, :n], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"example {i}: {m}")
        changed = max(changed, float((want[i, :n] - without[i, :n]).abs().max()))
    assert changed > 1e-3, "the family's inputs change nothing: the test would not see them dropped"


@pytest.mark.parametrize("name", FAMILIES)
def test_seq_cls_with_the_family_inputs_equals_padded(name):
    """The per-example heads get the inputs from the collator: logits, loss and gradients equal the padded model's."""
    check_seq_cls(name)


@pytest.mark.parametrize("name", FAMILIES)
def test_seq_cls_reads_the_declared_inputs_from_the_batch(name, monkeypatch):
    """Without the heads' own list of family inputs, the declared ones reach the base through the batch's
    ``model_keys`` (what a plugin's new architecture gets)."""
    monkeypatch.setattr(heads, "FAMILY_INPUT_KEYS", ())
    check_seq_cls(name)


def check_seq_cls(name):
    model = model_for(name, head="seq_cls", num_labels=3)
    examples = [{**ex, "label": i % 3} for i, ex in enumerate(with_inputs(name, make_examples(LENGTHS)))]
    labels = torch.tensor([ex["label"] for ex in examples])
    want = model(**padded_inputs(name, examples), labels=labels)
    want.loss.backward()
    want_grads = grads(model)
    with torch.no_grad():
        without = model(**padded(examples)).logits
    assembly = assemble(model, SEQ_CLS)
    try:
        got = assembly.forward(model, assembly.collator(examples))
        got.loss.backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want_grads)
    assert (without - want.logits).abs().max() > 1e-4  # ten times the tolerance: the inputs matter


def test_declared_inputs_are_packed_and_recorded():
    """Per-token values keep their trailing dimension ([L, 4] -> [1, T, 4]; tensors too); per-example ones are
    stacked [n]; both are recorded in ``model_keys``; without them the batch is as before."""
    model = model_for("layoutlm")
    examples = with_inputs("layoutlm", make_examples([3, 5]))
    assembly = assemble(model, HIDDEN)
    try:
        batch = assembly.collator(examples)
        assert batch["bbox"].shape == (1, 8, 4) and batch["bbox"].dtype == torch.long
        torch.testing.assert_close(batch["bbox"][0], torch.tensor([box for ex in examples for box in ex["bbox"]]))
        assert "bbox" in batch.model_keys and "bbox" in batch.model_inputs()
        as_tensors = assembly.collator([{**ex, "bbox": torch.tensor(ex["bbox"])} for ex in examples])
        torch.testing.assert_close(as_tensors["bbox"], batch["bbox"])
        plain = assembly.collator(make_examples([3, 5]))
        assert "bbox" not in plain and "bbox" not in plain.model_inputs()
    finally:
        assembly.undo()
    model = model_for("xmod")
    assembly = assemble(model, HIDDEN)
    try:
        batch = assembly.collator(with_inputs("xmod", make_examples([3, 5, 2])))
        torch.testing.assert_close(batch["lang_ids"], torch.tensor(LANGUAGES[:3]))
        assert "lang_ids" in batch.model_keys
    finally:
        assembly.undo()


@pytest.mark.parametrize(("name", "key"), [("xmod", "lang_ids"), ("layoutlm", "bbox")])
def test_declared_inputs_in_some_examples_only_are_an_error(name, key):
    model = model_for(name)
    examples = with_inputs(name, make_examples([3, 5, 2]))
    del examples[1][key]
    assembly = assemble(model, HIDDEN)
    try:
        with pytest.raises(BatchError, match=f"'{key}' is present in some examples but not in example 1"):
            assembly.collator(examples)
    finally:
        assembly.undo()


def test_boxes_of_the_wrong_length_are_an_error():
    model = model_for("layoutlm")
    examples = with_inputs("layoutlm", make_examples([3, 5]))
    examples[1]["bbox"] = examples[1]["bbox"][:4]
    assembly = assemble(model, HIDDEN)
    try:
        with pytest.raises(BatchError, match="example 1: 'bbox' has 4 values but input_ids has 5 tokens"):
            assembly.collator(examples)
    finally:
        assembly.undo()


@pytest.mark.parametrize("task", ["hidden_states", "seq_cls"])
def test_an_undeclared_forward_input_is_refused(task):
    """ERNIE's forward takes ``task_type_ids``, which no declaration carries: an example carrying it is refused with
    the key and how to declare it, instead of the model silently running with task type 0."""
    model = model_for("ernie", head="base" if task == "hidden_states" else "seq_cls",
                      **({"num_labels": 3} if task == "seq_cls" else {}))
    examples = [{**ex, "task_type_ids": [1] * len(ex["input_ids"]), "label": 1} for ex in make_examples([3, 5])]
    assembly = assemble(model, {"task": task, "attention": "exact"})
    try:
        with pytest.raises(BatchError, match=r"example 0 carries 'task_type_ids'.*token_keys=\('task_type_ids',\)"):
            assembly.collator(examples)
        assembly.collator([{k: v for k, v in ex.items() if k != "task_type_ids"} for ex in examples])
    finally:
        assembly.undo()


def test_ordinary_extra_columns_are_still_ignored():
    """Columns that are no input of the model's forward (a text, a source, an id) are left out as before, and the
    keys the framework handles (masks, token types, labels) are not refused."""
    model = model_for("bert", head="seq_cls", num_labels=3)
    examples = [{**ex, "text": "a b c", "source": "wiki", "idx": i, "label": i % 3,
                 "attention_mask": [1] * len(ex["input_ids"]), "token_type_ids": [0] * len(ex["input_ids"])}
                for i, ex in enumerate(make_examples([3, 5, 2]))]
    assembly = assemble(model, SEQ_CLS)
    try:
        batch = assembly.collator(examples)
        assert not {"text", "source", "idx"} & batch.keys()
        assert assembly.forward(model, batch).logits.shape == (3, 3)
    finally:
        assembly.undo()


def test_a_bare_packing_collator_refuses_nothing():
    """Without assembly (a collator built by hand) nothing is refused: no model, no forward to read."""
    batch = PackingCollator()([{"input_ids": [5, 6], "inputs_embeds": [0.0, 1.0]}])
    assert "inputs_embeds" not in batch
