"""PackingCollator: the packed-batch contract, agreement with transformers' flattening collator, clear errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from padfree_plugins.errors import BatchError
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.packing.collator import PackingCollator, holds_several_texts

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKEN_KEYS = ("token_type_ids", "labels")


@st.composite
def batches(draw, max_examples: int = 20, max_len: int = 50):
    """(examples as python lists, options) with random lengths, keys and position_start."""
    n = draw(st.integers(1, max_examples))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    options = dict(
        position_start=draw(st.sampled_from([0, 2])),
        labels=draw(st.booleans()),
        token_type_ids=draw(st.booleans()),
        int_key=draw(st.booleans()),
        vec_dim=draw(st.sampled_from([0, 1, 3])),
    )
    examples = []
    for length in lengths:
        ex = {"input_ids": rng.integers(0, 32000, length).tolist()}
        if options["labels"]:
            ex["labels"] = np.where(rng.random(length) < 0.3, -100, rng.integers(0, 32000, length)).tolist()
        if options["token_type_ids"]:
            ex["token_type_ids"] = rng.integers(0, 2, length).tolist()
        if options["int_key"]:
            ex["label"] = int(rng.integers(0, 10))
        if options["vec_dim"]:
            ex["score"] = rng.standard_normal(options["vec_dim"]).tolist()
        examples.append(ex)
    return examples, options


def collator_for(options, **kwargs) -> PackingCollator:
    example_keys = (("label",) if options["int_key"] else ()) + (("score",) if options["vec_dim"] else ())
    return PackingCollator(position_start=options["position_start"], token_keys=TOKEN_KEYS,
                           example_keys=example_keys, **kwargs)


def convert(examples, kind: str):
    """The same examples with every list turned into a tensor / numpy array (or left as lists)."""
    make = {"list": lambda v: v, "numpy": np.asarray, "tensor": torch.tensor}[kind]
    return [{k: make(v) if isinstance(v, list) else v for k, v in ex.items()} for ex in examples]


def assert_same_batch(a, b):
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert type(a[key]) is type(b[key]) and a[key] == b[key], key


# -- the contract ---------------------------------------------------------------------------------------------------


@SETTINGS
@given(batches())
def test_packed_batch_contract(case):
    examples, options = case
    batch = collator_for(options)(examples)
    lengths = [len(ex["input_ids"]) for ex in examples]
    n, total = len(lengths), sum(lengths)

    assert isinstance(batch, PackedBatch)
    assert {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
            "seq_idx"} <= set(batch)
    ids = batch["input_ids"]
    assert ids.dtype == torch.int64 and ids.shape == (1, total)
    assert ids[0].tolist() == [t for ex in examples for t in ex["input_ids"]]

    cu = batch["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and cu.shape == (n + 1,)
    assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert batch["cu_seq_lens_k"].dtype == torch.int32 and torch.equal(batch["cu_seq_lens_k"], cu)
    for key in ("max_length_q", "max_length_k"):
        assert type(batch[key]) is int and batch[key] == max(lengths)

    start = options["position_start"]
    positions = batch["position_ids"]
    assert positions.dtype == torch.int64 and positions.shape == (1, total)
    assert positions[0].tolist() == [start + i for length in lengths for i in range(length)]

    seq_idx = batch["seq_idx"]
    assert seq_idx.dtype == torch.int32 and seq_idx.shape == (1, total)
    assert seq_idx[0].tolist() == [i for i, length in enumerate(lengths) for _ in range(length)]

    for key in TOKEN_KEYS:
        if options[key]:
            assert batch[key].dtype == torch.int64 and batch[key].shape == (1, total)
            assert batch[key][0].tolist() == [t for ex in examples for t in ex[key]]
            # aligned with input_ids: each example's slice is its own values
            for i, ex in enumerate(examples):
                assert batch[key][0, cu[i] : cu[i + 1]].tolist() == ex[key]
        else:
            assert key not in batch

    if options["int_key"]:
        assert batch["label"].dtype == torch.int64 and batch["label"].shape == (n,)
        assert batch["label"].tolist() == [ex["label"] for ex in examples]
    else:
        assert "label" not in batch
    if options["vec_dim"]:
        score = batch["score"]
        assert score.dtype == torch.float32 and score.shape == (n, options["vec_dim"])
        expected = torch.tensor([ex["score"] for ex in examples], dtype=torch.float32)
        assert torch.equal(score, expected)

    assert batch.num_examples == n and batch.num_tokens == total
    assert batch.lengths.tolist() == lengths


@SETTINGS
@given(batches())
def test_masked_first_keys(case):
    examples, options = case
    options["labels"] = True
    for ex in examples:
        ex.setdefault("labels", [7] * len(ex["input_ids"]))
    batch = collator_for(options, masked_first_keys=("labels", "not_a_key"))(examples)
    cu = batch["cu_seq_lens_q"].tolist()
    labels = batch["labels"][0]
    for i, ex in enumerate(examples):
        assert labels[cu[i]].item() == -100
        assert labels[cu[i] + 1 : cu[i + 1]].tolist() == ex["labels"][1:]
    # the caller's examples are untouched
    assert all(len(ex["labels"]) == len(ex["input_ids"]) for ex in examples)
    assert "not_a_key" not in batch
    if options["token_type_ids"]:
        assert batch["token_type_ids"][0].tolist() == [t for ex in examples for t in ex["token_type_ids"]]


def test_masked_first_keys_custom_ignore_index_and_inputs_not_mutated():
    labels = torch.tensor([5, 6, 7])
    batch = PackingCollator(token_keys=("labels",), masked_first_keys=("labels",), ignore_index=-1)(
        [{"input_ids": torch.tensor([1, 2, 3]), "labels": labels}]
    )
    assert batch["labels"].tolist() == [[-1, 6, 7]]
    assert labels.tolist() == [5, 6, 7]


@SETTINGS
@given(batches())
def test_lists_arrays_and_tensors_give_the_same_batch(case):
    examples, options = case
    collator = collator_for(options)
    reference = collator(convert(examples, "list"))
    for kind in ("numpy", "tensor"):
        assert_same_batch(collator(convert(examples, kind)), reference)


def test_row_shaped_inputs_and_other_int_dtypes_are_accepted():
    collator = PackingCollator(token_keys=("labels",))
    reference = collator([{"input_ids": [3, 4, 5], "labels": [1, 2, 3]}, {"input_ids": [9], "labels": [0]}])
    other = collator([
        {"input_ids": torch.tensor([[3, 4, 5]], dtype=torch.int32), "labels": np.array([[1, 2, 3]], dtype=np.int16)},
        {"input_ids": (9,), "labels": torch.tensor([0], dtype=torch.uint8)},
    ])
    assert_same_batch(other, reference)


def test_single_example_batch():
    batch = PackingCollator(position_start=2)([{"input_ids": [11, 12, 13, 14]}])
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14]]
    assert batch["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4]
    assert batch["max_length_q"] == batch["max_length_k"] == 4
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 0]]


def test_single_token_examples():
    batch = PackingCollator()([{"input_ids": [5]}, {"input_ids": [6]}, {"input_ids": [7]}])
    assert batch["position_ids"].tolist() == [[0, 0, 0]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 1, 2, 3]
    assert batch["max_length_q"] == 1
    assert batch["seq_idx"].tolist() == [[0, 1, 2]]


def test_any_iterable_of_examples():
    examples = [{"input_ids": [1, 2]}, {"input_ids": [3]}]
    assert_same_batch(PackingCollator()(iter(examples)), PackingCollator()(examples))
    assert_same_batch(PackingCollator()(tuple(examples)), PackingCollator()(examples))


def test_example_keys_from_tensors_bools_and_arrays():
    batch = PackingCollator(example_keys=("label", "flag", "vec"))([
        {"input_ids": [1], "label": torch.tensor(3), "flag": True, "vec": np.array([1, 2])},
        {"input_ids": [2, 3], "label": np.int64(4), "flag": False, "vec": torch.tensor([3, 4])},
    ])
    assert batch["label"].dtype == torch.int64 and batch["label"].tolist() == [3, 4]
    assert batch["flag"].dtype == torch.int64 and batch["flag"].tolist() == [1, 0]
    assert batch["vec"].dtype == torch.int64 and batch["vec"].tolist() == [[1, 2], [3, 4]]


def test_absent_or_none_token_keys_are_left_out():
    batch = PackingCollator(token_keys=("labels", "token_type_ids"))(
        [{"input_ids": [1, 2], "labels": None}, {"input_ids": [3], "labels": None}]
    )
    assert "labels" not in batch and "token_type_ids" not in batch


def test_all_ones_attention_mask_is_fine_and_dropped():
    batch = PackingCollator()([{"input_ids": [1, 2], "attention_mask": [1, 1]},
                               {"input_ids": [3], "attention_mask": torch.tensor([1])}])
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[1, 2, 3]]


def test_batch_helpers():
    examples = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": [3]}]
    batch = PackingCollator(token_keys=("labels",))(examples)
    assert set(batch.model_inputs()) == {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                         "max_length_q", "max_length_k"}
    assert "labels" in batch.model_inputs("labels", "missing") and "missing" not in batch.model_inputs("missing")
    moved = batch.to("cpu")
    assert isinstance(moved, PackedBatch) and moved is not batch
    assert_same_batch(moved, batch)


# -- agreement with transformers ------------------------------------------------------------------------------------


@SETTINGS
@given(batches())
def test_matches_transformers_flattening_collator(case):
    from transformers import DataCollatorWithFlattening

    examples, options = case
    start = options["position_start"]
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=start)
    theirs = hf(examples)
    ours = collator_for(options, masked_first_keys=("labels",))(examples)
    for key in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    for key in ("max_length_q", "max_length_k"):
        assert ours[key] == theirs[key] and type(ours[key]) is type(theirs[key]) is int
    if options["labels"]:  # both ignore the first label of every example
        assert torch.equal(ours["labels"], theirs["labels"])


# -- bad input -----------------------------------------------------------------------------------------------------


def test_empty_batch():
    with pytest.raises(BatchError, match="empty batch"):
        PackingCollator()([])
    with pytest.raises(BatchError, match="empty batch"):
        PackingCollator()(iter([]))


def test_single_dict_instead_of_list():
    with pytest.raises(BatchError, match="single dict") as info:
        PackingCollator()({"input_ids": [1, 2, 3]})
    assert "list of examples" in str(info.value)


def test_non_dict_example():
    with pytest.raises(BatchError, match=r"example 1 is a list, not a dict"):
        PackingCollator()([{"input_ids": [1]}, [1, 2]])


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=0, max_size=10), data=st.data())
def test_zero_length_example_is_named(lengths, data):
    position = data.draw(st.integers(0, len(lengths)))
    lengths = lengths[:position] + [0] + lengths[position:]
    empty = data.draw(st.sampled_from([[], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.long)]))
    examples = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    examples[position]["input_ids"] = empty
    with pytest.raises(BatchError) as info:
        PackingCollator()(examples)
    message = str(info.value)
    assert f"example {position} has no tokens" in message
    assert "1 empty example(s)" in message and "filter them out" in message


def test_missing_input_ids():
    with pytest.raises(BatchError) as info:
        PackingCollator()([{"input_ids": [1]}, {"labels": [1, 2]}])
    message = str(info.value)
    assert "example 1 is missing 'input_ids'" in message and "it has 'labels'" in message


def test_missing_required_example_key():
    collator = PackingCollator(example_keys=("label",), required_keys=("input_ids", "group"))
    with pytest.raises(BatchError, match=r"example 0 is missing 'group', 'label'"):
        collator([{"input_ids": [1]}])
    with pytest.raises(BatchError, match=r"example 2 is missing 'label'"):
        collator([{"input_ids": [1], "label": 0, "group": 1}] * 2 + [{"input_ids": [1], "group": 1}])


def test_required_token_key_that_is_none_everywhere():
    collator = PackingCollator(token_keys=("labels",), required_keys=("input_ids", "labels"))
    with pytest.raises(BatchError, match="every example needs 'labels'"):
        collator([{"input_ids": [1], "labels": None}])


def test_bad_example_key_values():
    collator = PackingCollator(example_keys=("label",))
    with pytest.raises(BatchError, match="'label' must be a number or a fixed-length list"):
        collator([{"input_ids": [1], "label": "cat"}, {"input_ids": [2], "label": "dog"}])
    with pytest.raises(BatchError, match="'label' must be a number or a fixed-length list"):
        collator([{"input_ids": [1], "label": [1, 2]}, {"input_ids": [2], "label": [1]}])


@pytest.mark.parametrize("missing_at", [0, 1, 2])
def test_token_key_in_some_examples_only(missing_at):
    examples = [{"input_ids": [1, 2], "token_type_ids": [0, 0]} for _ in range(3)]
    del examples[missing_at]["token_type_ids"]
    with pytest.raises(BatchError) as info:
        PackingCollator()(examples)
    message = str(info.value)
    assert "'token_type_ids' is present in some examples" in message
    assert f"not in example {missing_at}" in message and "every example or to none" in message


@pytest.mark.parametrize("on_overlong", ["error", "truncate"])
@pytest.mark.parametrize("max_length", [None, 10])
@pytest.mark.parametrize("label_len", [2, 4])
def test_token_key_length_mismatch(on_overlong, max_length, label_len):
    collator = PackingCollator(token_keys=("labels",), max_length=max_length, on_overlong=on_overlong)
    examples = [{"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2, 3], "labels": list(range(label_len))}]
    with pytest.raises(BatchError) as info:
        collator(examples)
    message = str(info.value)
    assert f"example 1: 'labels' has {label_len} values but input_ids has 3 tokens" in message
    assert "same length" in message


def test_token_key_longer_than_input_ids_of_an_overlong_example_is_still_an_error():
    collator = PackingCollator(token_keys=("labels",), max_length=2, on_overlong="truncate")
    with pytest.raises(BatchError, match="'labels' has 5 values but input_ids has 4 tokens"):
        collator([{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4, 5]}])


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.array([1.5, 2.5]), torch.tensor([1.0, 2.0]), ["a", "b"]])
def test_non_integer_input_ids(bad):
    with pytest.raises(BatchError, match=r"example 0: 'input_ids' must hold integers, got dtype"):
        PackingCollator()([{"input_ids": bad}])


def test_non_integer_token_key():
    with pytest.raises(BatchError, match=r"example 1: 'labels' must hold integers"):
        PackingCollator(token_keys=("labels",))([{"input_ids": [1], "labels": [1]},
                                                 {"input_ids": [1], "labels": [0.5]}])


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], torch.ones(3, 4, dtype=torch.long), np.ones((2, 1, 3), dtype=int)])
def test_batched_input_ids(bad):
    with pytest.raises(BatchError) as info:
        PackingCollator()([{"input_ids": [1]}, {"input_ids": bad}])
    message = str(info.value)
    assert "example 1: 'input_ids' must be 1-D" in message and "already-batched" in message


def _object_array(items):
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


@pytest.mark.parametrize(("ids", "several"), [
    ([1, 2, 3], False),  # one text
    ((1, 2, 3), False),
    ([torch.tensor(1), torch.tensor(2)], False),  # a list of 0-d tensors is one text too
    (np.array([1, 2, 3]), False),
    (torch.tensor([1, 2, 3]), False),
    (torch.tensor([[1, 2, 3]]), False),  # [1, L]: one text, what tokenizer(text, return_tensors="pt") gives
    (np.array([[1, 2, 3]]), False),
    ([], False),  # an empty row
    ((), False),
    (np.array([], dtype=np.int64), False),
    (torch.zeros(0, dtype=torch.long), False),
    (torch.zeros(0, 3, dtype=torch.long), False),  # no rows: no candidates
    (_object_array([]), False),
    (_object_array([1, 2, 3]), False),  # an object array is judged by its elements, like a list
    (None, False),
    ([[1, 2], [3]], True),  # a listwise row: one token list per candidate
    (([1, 2], (3,)), True),
    ([[1, 2]], True),  # a list with one candidate is still a list of texts
    ([np.array([1, 2]), np.array([3])], True),
    ([torch.tensor([1, 2]), torch.tensor([3])], True),
    (np.array([[1, 2], [3, 4]]), True),  # [k, L], k >= 2: k candidates of equal length
    (torch.tensor([[1, 2], [3, 4]]), True),
    (_object_array([[1, 2], [3]]), True),  # datasets' numpy format of ragged candidates
    (_object_array([np.array([1, 2]), np.array([3])]), True),
    (torch.ones(2, 2, 2, dtype=torch.long), False),  # 3-D: neither (packing refuses it as batched)
])
def test_holds_several_texts(ids, several):
    """The one test the task collators (expand a listwise row) and the token-budget sampler (count its tokens,
    refuse to split it) share."""
    assert holds_several_texts(ids) is several


def test_ragged_nested_input_ids():
    with pytest.raises(BatchError, match="example 0: 'input_ids'"):
        PackingCollator()([{"input_ids": [[1, 2], [3]]}])


@pytest.mark.parametrize("mask", [[1, 1, 0], np.array([0, 1, 1]), torch.tensor([1, 0, 1])])
def test_padded_example_is_rejected(mask):
    with pytest.raises(BatchError) as info:
        PackingCollator()([{"input_ids": [1, 2], "attention_mask": [1, 1]},
                           {"input_ids": [1, 2, 3], "attention_mask": mask}])
    message = str(info.value)
    assert "example 1 is padded" in message and "unpadded" in message


def test_overlong_example_error():
    collator = PackingCollator(max_length=4)
    assert collator([{"input_ids": [1, 2, 3, 4]}])["max_length_q"] == 4  # exactly max_length is fine
    with pytest.raises(BatchError) as info:
        collator([{"input_ids": [1, 2]}, {"input_ids": list(range(5))}, {"input_ids": list(range(9))}])
    message = str(info.value)
    assert "example 1 has 5 tokens, more than max_length=4" in message
    assert "2 such example(s)" in message and "on_overlong: truncate" in message


@SETTINGS
@given(batches(max_examples=8, max_len=30), st.integers(1, 30))
def test_overlong_truncate_is_consistent(case, max_length):
    examples, options = case
    collator = collator_for(options, max_length=max_length, on_overlong="truncate", masked_first_keys=("labels",))
    batch = collator(examples)
    cut = [{k: v[:max_length] if k in ("input_ids", *TOKEN_KEYS) else v for k, v in ex.items()} for ex in examples]
    expected = collator_for(options, masked_first_keys=("labels",))(cut)
    assert_same_batch(batch, expected)
    assert batch["max_length_q"] == min(max_length, max(len(ex["input_ids"]) for ex in examples))


def test_truncate_example():
    collator = PackingCollator(token_keys=("labels", "token_type_ids"), max_length=3, on_overlong="truncate")
    batch = collator([
        {"input_ids": [1, 2, 3, 4, 5], "labels": [11, 12, 13, 14, 15], "token_type_ids": [0, 0, 1, 1, 1]},
        {"input_ids": [6, 7], "labels": [16, 17], "token_type_ids": [1, 1]},
    ])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 6, 7]]
    assert batch["labels"].tolist() == [[11, 12, 13, 16, 17]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert batch["max_length_q"] == 3


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="on_overlong must be 'error' or 'truncate'"):
        PackingCollator(on_overlong="trunc")
    with pytest.raises(ValueError, match="max_length must be a positive integer"):
        PackingCollator(max_length=0)


# -- DataLoader workers ---------------------------------------------------------------------------------------------


def test_pickles_and_gives_the_same_output():
    collator = PackingCollator(position_start=2, token_keys=TOKEN_KEYS, example_keys=("label",), max_length=6,
                               on_overlong="truncate", masked_first_keys=("labels",), ignore_index=-1)
    examples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(n)), "label": n} for n in (3, 9, 1)]
    clone = pickle.loads(pickle.dumps(collator))
    assert clone == collator and clone is not collator
    assert_same_batch(clone(examples), collator(examples))
    batch = collator(examples)
    assert_same_batch(pickle.loads(pickle.dumps(batch)), batch)
    assert isinstance(pickle.loads(pickle.dumps(batch)), PackedBatch)


def test_dataloader_with_workers():
    from torch.utils.data import DataLoader

    dataset = [{"input_ids": list(range(1, n + 2)), "labels": list(range(n + 1))} for n in range(8)]
    collator = PackingCollator(token_keys=("labels",), masked_first_keys=("labels",))
    loader = DataLoader(dataset, batch_size=3, collate_fn=collator, num_workers=2)
    got = list(loader)
    assert len(got) == 3
    for i, batch in enumerate(got):
        assert isinstance(batch, PackedBatch)
        assert_same_batch(batch, collator(dataset[3 * i : 3 * i + 3]))


@pytest.mark.parametrize("ids, bad", [([5, -1, 7], -1), ([5, 99, 7], 99)])
def test_token_ids_outside_the_vocabulary_name_the_example(ids, bad):
    collator = PackingCollator(vocab_size=99)
    message = rf"example 1 has token id {bad}, outside the model's vocabulary \(ids 0 to 98\)"
    with pytest.raises(BatchError, match=message):
        collator([{"input_ids": [1, 2]}, {"input_ids": ids}])


def test_causal_lm_example_without_input_ids_is_named():
    from padfree_plugins import assemble
    from tests.conftest import tiny_model

    assembly = assemble(tiny_model("llama", head="causal_lm"), {"task": "causal_lm"})
    try:
        with pytest.raises(BatchError, match="example 1 is missing 'input_ids'; it has 'ids'"):
            assembly.collator([{"input_ids": [5, 6]}, {"ids": [1]}])
        with pytest.raises(BatchError, match=r"outside the model's vocabulary \(ids 0 to "):
            assembly.collator([{"input_ids": [5, 10**6]}])
    finally:
        assembly.undo()


@pytest.mark.parametrize("task", ["causal_lm", "embedding"])
def test_task_collators_take_any_iterable_of_rows(task):
    """A generator, a tuple or a ``datasets.Dataset`` of rows packs like a list: causal LM still derives its labels
    (it silently returned a batch without labels), the embedding collator does not fail on ``len()``."""
    import datasets

    from padfree_plugins import assemble
    from tests.conftest import make_examples, tiny_model

    rows = make_examples([5, 9, 3])
    if task == "embedding":
        rows = [{"anchor_input_ids": row["input_ids"]} for row in rows]
    model = tiny_model("llama", head="causal_lm" if task == "causal_lm" else "base")
    assembly = assemble(model, {"task": task})
    try:
        want = assembly.collator(rows)
        for given in (iter(rows), tuple(rows), datasets.Dataset.from_list(rows)):
            assert_same_batch(assembly.collator(given), want)
    finally:
        assembly.undo()
