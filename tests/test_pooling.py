"""Poolers and the Reverter on packed rows equal the same operation done per example, values and gradients."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree_plugins.errors import ConfigError
from padfree_plugins.modeling.pooling import POOLERS, make_pooler
from padfree_plugins.packing.collator import PackingCollator
from padfree_plugins.packing.repad import Reverter

SETTINGS = settings(max_examples=100, deadline=None)
lengths_strategy = st.lists(st.integers(1, 12), min_size=1, max_size=10)


def packed_batch(lengths):
    return PackingCollator()([{"input_ids": [1] * n} for n in lengths])


def reference_pool(mode: str, piece: torch.Tensor) -> torch.Tensor:
    return {"first": piece[0], "cls": piece[0], "last": piece[-1], "mean": piece.mean(0),
            "max": piece.max(0).values}[mode]


def random_hidden(total: int, width: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(1, total, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def per_example_pool(mode, hidden, batch):
    cu = batch["cu_seq_lens_q"].tolist()
    return torch.stack([reference_pool(mode, hidden[0, cu[i] : cu[i + 1]]) for i in range(len(cu) - 1)])


# -- poolers --------------------------------------------------------------------------------------------------------


@SETTINGS
@given(lengths=lengths_strategy, width=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       mode=st.sampled_from(sorted(POOLERS)), use_seq_idx=st.booleans())
def test_pooler_equals_per_example_values_and_grads(lengths, width, seed, mode, use_seq_idx):
    batch = packed_batch(lengths)
    if not use_seq_idx:
        del batch["seq_idx"]  # poolers fall back to cu_seq_lens
    pooler = make_pooler(mode)
    hidden = random_hidden(sum(lengths), width, seed).requires_grad_()
    reference_hidden = hidden.detach().clone().requires_grad_()

    pooled = pooler(hidden, batch)
    expected = per_example_pool(mode, reference_hidden, batch)
    assert pooled.shape == (len(lengths), width) and pooled.dtype == hidden.dtype
    torch.testing.assert_close(pooled, expected, atol=1e-12, rtol=1e-12)

    weights = torch.randn(len(lengths), width, generator=torch.Generator().manual_seed(seed + 1), dtype=hidden.dtype)
    (pooled * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, atol=1e-6, rtol=0)
    # tokens of an example only receive gradient from that example's vector
    if mode in ("first", "cls", "last"):
        assert int((hidden.grad[0].abs().sum(-1) > 0).sum()) <= len(lengths)


@pytest.mark.parametrize("mode", sorted(POOLERS))
def test_pooler_on_two_dim_rows_and_float32(mode):
    lengths = [1, 4, 1, 2]
    batch = packed_batch(lengths)
    hidden = random_hidden(sum(lengths), 5, 0, torch.float32)
    pooler = make_pooler(mode)
    torch.testing.assert_close(pooler(hidden[0], batch), pooler(hidden, batch))
    torch.testing.assert_close(pooler(hidden, batch), per_example_pool(mode, hidden, batch))


@pytest.mark.parametrize("mode", sorted(POOLERS))
def test_pooler_with_all_length_one_examples(mode):
    batch = packed_batch([1, 1, 1])
    hidden = random_hidden(3, 4, 1)
    torch.testing.assert_close(make_pooler(mode)(hidden, batch), hidden[0])


def test_max_pooler_with_negative_values():
    """``include_self=False``: the zero fill must not leak into the maximum of all-negative examples."""
    batch = packed_batch([2, 1])
    hidden = -torch.arange(1.0, 7.0).reshape(1, 3, 2)
    assert make_pooler("max")(hidden, batch).tolist() == [[-1.0, -2.0], [-5.0, -6.0]]


@pytest.mark.parametrize("mode", sorted(POOLERS))
def test_pooler_rejects_a_batched_tensor(mode):
    batch = packed_batch([2, 2])
    with pytest.raises(ValueError, match=r"packed hidden states are \[1, T, H\]; got shape \(2, 2, 3\)"):
        make_pooler(mode)(torch.zeros(2, 2, 3), batch)


@pytest.mark.parametrize("mode", sorted(POOLERS))
def test_poolers_pickle(mode):
    pooler = make_pooler(mode)
    clone = pickle.loads(pickle.dumps(pooler))
    batch = packed_batch([2, 3])
    hidden = random_hidden(5, 3, 2)
    assert type(clone) is type(pooler)
    torch.testing.assert_close(clone(hidden, batch), pooler(hidden, batch))


def test_cls_is_first():
    assert type(make_pooler("cls")) is type(make_pooler("first"))


@pytest.mark.parametrize(("mode", "suggestion"), [("maen", "mean"), ("lats", "last"), ("frist", "first")])
def test_unknown_mode_suggests(mode, suggestion):
    with pytest.raises(ConfigError) as info:
        make_pooler(mode)
    message = str(info.value)
    assert f"unknown pooling mode {mode!r}" in message and f"Did you mean {suggestion!r}?" in message
    assert "Builtin modes: first, cls, last, mean, max" in message


def test_unknown_mode_without_close_match():
    with pytest.raises(ConfigError) as info:
        make_pooler("attention")
    assert "Did you mean" not in str(info.value) and "Builtin modes" in str(info.value)


# -- reverter -------------------------------------------------------------------------------------------------------


def manual_pad(packed, batch, side, pad_value):
    """Pad example slices by hand, one at a time: the reference."""
    cu = batch["cu_seq_lens_q"].tolist()
    longest = max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    rows, masks = [], []
    for i in range(len(cu) - 1):
        piece = packed[0, cu[i] : cu[i + 1]]
        fill = piece.new_full((longest - piece.shape[0], *piece.shape[1:]), pad_value)
        ones = torch.ones(piece.shape[0], dtype=torch.long)
        zeros = torch.zeros(longest - piece.shape[0], dtype=torch.long)
        if side == "right":
            rows.append(torch.cat([piece, fill]))
            masks.append(torch.cat([ones, zeros]))
        else:
            rows.append(torch.cat([fill, piece]))
            masks.append(torch.cat([zeros, ones]))
    return torch.stack(rows), torch.stack(masks)


@SETTINGS
@given(lengths=lengths_strategy, seed=st.integers(0, 2**31 - 1), side=st.sampled_from(["right", "left"]),
       pad_value=st.sampled_from([0.0, -1.5]), trailing=st.sampled_from([(), (3,), (2, 2)]))
def test_reverter_equals_manual_padding(lengths, seed, side, pad_value, trailing):
    batch = packed_batch(lengths)
    total = sum(lengths)
    packed = torch.randn(1, total, *trailing, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64).requires_grad_()
    reference_input = packed.detach().clone().requires_grad_()

    padded, mask = Reverter(side=side, pad_value=pad_value)(packed, batch)
    expected, expected_mask = manual_pad(reference_input, batch, side, pad_value)
    assert padded.shape == (len(lengths), max(lengths), *trailing)
    assert mask.dtype == torch.long and mask.shape == (len(lengths), max(lengths))
    assert torch.equal(padded, expected)
    assert torch.equal(mask, expected_mask)
    assert mask.sum(1).tolist() == lengths
    # the real tokens come back in order: padded[mask] is the packed row
    assert torch.equal(padded[mask.bool()], packed[0])

    weights = torch.randn(padded.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    (padded * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(packed.grad, reference_input.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(packed.grad[0], weights[mask.bool()], atol=1e-12, rtol=0)


def test_reverter_gradcheck():
    batch = packed_batch([2, 1, 3])
    packed = torch.randn(1, 6, 2, dtype=torch.float64, requires_grad=True)
    for side in ("right", "left"):
        assert torch.autograd.gradcheck(lambda x: Reverter(side=side)(x, batch)[0], (packed,))


def test_reverter_small_example():
    batch = packed_batch([2, 1])
    packed = torch.tensor([[[1.0], [2.0], [3.0]]])
    padded, mask = Reverter()(packed, batch)
    assert padded.tolist() == [[[1.0], [2.0]], [[3.0], [0.0]]]
    assert mask.tolist() == [[1, 1], [1, 0]]
    padded, mask = Reverter(side="left", pad_value=9.0)(packed, batch)
    assert padded.tolist() == [[[1.0], [2.0]], [[9.0], [3.0]]]
    assert mask.tolist() == [[1, 1], [0, 1]]


def test_reverter_on_integer_token_keys():
    """Labels ``[1, T]`` come back padded with an integer pad value and keep their dtype."""
    batch = PackingCollator(token_keys=("labels",))([{"input_ids": [1, 2, 3], "labels": [4, 5, 6]},
                                                    {"input_ids": [7], "labels": [8]}])
    padded, mask = Reverter(pad_value=-100)(batch["labels"], batch)
    assert padded.dtype == torch.long
    assert padded.tolist() == [[4, 5, 6], [8, -100, -100]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_reverter_single_example_is_the_row():
    batch = packed_batch([4])
    packed = torch.randn(1, 4, 3)
    padded, mask = Reverter(side="left")(packed, batch)
    assert torch.equal(padded, packed) and mask.tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize("shape", [(5,), (2, 5, 3), (5, 3), (2, 5)])
def test_reverter_rejects_non_packed_input(shape):
    batch = packed_batch([2, 3])
    with pytest.raises(ValueError, match=r"packed outputs are \[1, T, \.\.\.\]"):
        Reverter()(torch.zeros(shape), batch)


def test_reverter_pickles():
    reverter = Reverter(side="left", pad_value=-1.0)
    clone = pickle.loads(pickle.dumps(reverter))
    assert clone == reverter
    batch = packed_batch([1, 3])
    packed = torch.randn(1, 4, 2)
    for a, b in zip(clone(packed, batch), reverter(packed, batch)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens", [4, 6])
@pytest.mark.parametrize("mode", sorted(POOLERS))
def test_pooler_rejects_hidden_states_of_another_length(mode, tokens):
    """Never silently wrong: first/last would otherwise gather from rows that belong to no example."""
    batch = packed_batch([3, 2])
    with pytest.raises(ValueError, match=rf"hidden states have {tokens} tokens but the packed batch has 5"):
        make_pooler(mode)(torch.zeros(1, tokens, 3), batch)


@pytest.mark.parametrize("tokens", [4, 6])
def test_reverter_rejects_outputs_of_another_length(tokens):
    batch = packed_batch([3, 2])
    with pytest.raises(ValueError, match=rf"packed outputs have {tokens} tokens but the packed batch has 5"):
        Reverter()(torch.zeros(1, tokens, 3), batch)


def test_boundaries_only_batch_is_enough():
    """A batch with nothing but the boundaries (e.g. rebuilt by other code) still pools and re-pads."""
    full = packed_batch([3, 1, 2])
    batch = {"cu_seq_lens_q": full["cu_seq_lens_q"], "max_length_q": full["max_length_q"]}
    hidden = random_hidden(6, 2, 3)
    for mode in sorted(POOLERS):
        torch.testing.assert_close(make_pooler(mode)(hidden, batch), per_example_pool(mode, hidden, full))
    for a, b in zip(Reverter()(hidden, batch), Reverter()(hidden, full)):
        assert torch.equal(a, b)
