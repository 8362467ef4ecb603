"""What a new user found feeding packed rows by hand: a packed row returned a KV cache of the whole row (transformers'
``use_cache`` defaults to ``config.use_cache``, True for Llama outside a Trainer), and masks that do not describe an
example (shorter, longer, nested) or nested labels were accepted without a word. Padded calls and ``generate()`` are
unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening, DynamicCache

from padfree_plugins import BatchError, BoundaryError, assemble
from padfree_plugins.packing.collator import PackingCollator
from padfree_plugins.packing.padded import pad_examples
from tests.conftest import make_examples, tiny_model
from tests.ties import assert_same_greedy, greedy

# -- no KV cache for a packed row -----------------------------------------------------------------------------------


@pytest.fixture
def llama():
    model = tiny_model("llama", "causal_lm")
    assert model.config.use_cache  # the default a user meets outside a Trainer
    assembly = assemble(model, {"task": "causal_lm"})
    yield model, assembly
    assembly.undo()


@pytest.mark.parametrize("use_cache", [None, True])
def test_a_packed_row_returns_no_cache(llama, use_cache):
    model, assembly = llama
    batch = assembly.collator(make_examples([5, 3, 4]))
    extra = {} if use_cache is None else {"use_cache": use_cache}
    with torch.no_grad():
        out = model(**batch.model_inputs(), **extra)
        reference = model(**batch.model_inputs(), use_cache=False)
    assert out.past_key_values is None
    torch.testing.assert_close(out.logits, reference.logits, atol=0, rtol=0)


def test_a_packed_row_given_positionally_returns_no_cache(llama):
    model, assembly = llama
    batch = assembly.collator(make_examples([4, 2]))
    boundaries = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with torch.no_grad():  # LlamaModel.forward(input_ids, attention_mask, position_ids, ...): use_cache from config
        out = model.model(batch["input_ids"], None, batch["position_ids"], **boundaries)
    assert out.past_key_values is None


def test_a_packed_row_refuses_a_cache(llama):
    model, assembly = llama
    batch = assembly.collator(make_examples([5, 3]))
    with pytest.raises(BoundaryError, match=r"cannot use a KV cache.*DynamicCache.*generate\(\)"):
        model(**batch.model_inputs(), past_key_values=DynamicCache(config=model.config))


def test_padded_calls_and_generate_keep_their_cache():
    model = tiny_model("llama", "causal_lm")
    examples = make_examples([6, 4], seed=5)
    padded = pad_examples(examples, pad_token_id=1, side="left")
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=1)
    with torch.no_grad():
        before, gaps = greedy(model, **padded, **{k: v for k, v in settings.items() if k != "do_sample"})
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        with torch.no_grad():
            assert isinstance(model(**padded).past_key_values, DynamicCache)
            after = model.generate(**padded, **settings)
        assert_same_greedy(after, before, gaps)
    finally:
        assembly.undo()


def test_new_tokens_after_a_cache_with_the_whole_mask(llama):
    """Several new tokens after a cache (assisted decoding, chunked prefill) come with a mask over cache + new tokens,
    longer than their position ids: the guard reads its last columns (it used to fail to broadcast)."""
    model, _ = llama
    ids = torch.tensor([make_examples([8], seed=4)[0]["input_ids"]])
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        first = model(input_ids=ids[:, :5], use_cache=True)
        rest = model(input_ids=ids[:, 5:], position_ids=torch.arange(5, 8)[None], attention_mask=torch.ones(1, 8),
                     past_key_values=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(rest, whole[:, 5:], atol=1e-5, rtol=0)


# -- masks and nested values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mask", "message"), [
    ([1, 1], r"example 1: 'attention_mask' has 2 values but input_ids has 3 tokens.*leave attention_mask out"),
    ([1, 1, 1, 1], r"example 1: 'attention_mask' has 4 values but input_ids has 3 tokens"),
    ([[1, 1, 1]], r"example 1: 'attention_mask' is a list holding one list.*unwrap it"),
    ([[1, 1, 1], [1, 1, 1]], r"example 1: 'attention_mask' must be one example's 1-D mask.*shape \(2, 3\)"),
    (torch.ones(3, 1), r"example 1: 'attention_mask' must be one example's 1-D mask"),
    ([1, 0, 1], r"example 1 is padded"),
])
def test_a_mask_that_does_not_describe_its_example_is_an_error(mask, message):
    with pytest.raises(BatchError, match=message):
        PackingCollator()([{"input_ids": [1, 2], "attention_mask": [1, 1]},
                           {"input_ids": [3, 4, 5], "attention_mask": mask}])


@pytest.mark.parametrize("mask", [[1, 1, 1], torch.ones(3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.long),
                                  np.ones(3, dtype=np.int8), [True, True, True]])
def test_an_all_ones_mask_of_the_example_is_fine(mask):
    batch = PackingCollator()([{"input_ids": [3, 4, 5], "attention_mask": mask}])
    assert "attention_mask" not in batch and batch["input_ids"].tolist() == [[3, 4, 5]]


@pytest.mark.parametrize(("example", "message"), [
    ({"input_ids": [3, 4, 5], "labels": [[3, 4, 5]]}, r"example 1: 'labels' is a list holding one list.*labels\[0\]"),
    ({"input_ids": [[3, 4, 5]], "labels": [3, 4, 5]}, r"example 1: 'input_ids' is a list holding one token list"),
    ({"input_ids": [3, 4, 5], "token_type_ids": [[0, 0, 1]]}, r"example 1: 'token_type_ids' is a list holding one"),
])
def test_nested_per_token_values_are_an_error(example, message):
    collator = PackingCollator(token_keys=("labels", "token_type_ids"))
    first = {key: [7] for key in example}
    with pytest.raises(BatchError, match=message):
        collator([first, example])


def test_row_shaped_arrays_and_tensors_are_still_one_example():
    """``tokenizer(text, return_tensors="pt")`` gives ``[1, L]`` tensors: still one example each."""
    batch = PackingCollator(token_keys=("labels",))([{"input_ids": torch.tensor([[3, 4, 5]]),
                                                      "attention_mask": torch.ones(1, 3, dtype=torch.long),
                                                      "labels": np.array([[3, 4, 5]])}])
    assert batch["labels"].tolist() == [[3, 4, 5]]


def test_a_flattened_row_with_a_mask_that_does_not_cover_it_is_refused():
    model = tiny_model("llama")
    flattened = DataCollatorWithFlattening(return_position_ids=True)(make_examples([4, 6]))
    ids, positions = flattened["input_ids"], flattened["position_ids"]
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        with pytest.raises(BoundaryError, match=r"attention_mask of shape \(1, 9\).*does not cover"):
            model(input_ids=ids, position_ids=positions, attention_mask=torch.ones(1, ids.shape[1] - 1))
        batch = assembly.collator(make_examples([4, 6]))
        for mask in (torch.ones(1, batch.num_tokens - 1), torch.ones_like(batch["input_ids"])):
            with pytest.raises(BoundaryError, match=r"must not carry an attention_mask.*Drop the key"):
                model(**batch.model_inputs(), attention_mask=mask)
    finally:
        assembly.undo()
