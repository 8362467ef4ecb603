"""The guards of :mod:`tests.ties`: each fails where rounding could decide a discontinuous value, or where a value
differs beyond what rounding could flip."""

from __future__ import annotations

import pytest
import torch

from tests.ties import (CLEAR, allowed_flips, assert_clear, assert_same_greedy, excess_over_flips, flip_shares,
                        label_margins, sorted_gaps, top2_gaps)


def test_sorted_gaps_and_a_near_tie_refused():
    gaps = sorted_gaps(torch.tensor([0.3, 0.1, 0.5, 2.0, 2.0 + 1e-7]), [3, 2])
    torch.testing.assert_close(gaps, torch.tensor([0.2, 0.2, 1e-7], dtype=torch.float64), atol=1e-7, rtol=1e-6)
    assert_clear(gaps[:2], "scores")
    with pytest.raises(AssertionError, match="rounding can flip them"):
        assert_clear(gaps, "scores")


def test_label_and_top2_margins():
    logits = torch.tensor([[[2.0, 1.0, 0.5], [0.1, 0.1 + 1e-6, 3.0]]])
    labels = torch.tensor([[1, 0]])
    torch.testing.assert_close(label_margins(logits, labels), torch.tensor([-1.0, -2.9], dtype=torch.float64))
    assert label_margins(logits, torch.tensor([[-100, 2]])).tolist() == pytest.approx([2.9 - 1e-6])
    torch.testing.assert_close(top2_gaps(logits), torch.tensor([[1.0, 2.9 - 1e-6]], dtype=torch.float64))
    assert allowed_flips(torch.tensor([0.0, -CLEAR / 2, CLEAR, 1.0])) == 2


def test_a_difference_beyond_the_near_ties_is_measured_and_too_many_ties_refused():
    shares = flip_shares([torch.tensor([0.5, 1e-5, -0.4, 0.3]), torch.tensor([0.2, 0.3, -0.1, 0.4])], 1)
    assert shares == [0.25, 0.0]
    assert excess_over_flips([0.75, 0.5], [0.5, 0.5], shares, "accuracy") <= 0  # the near-tie's flip
    assert excess_over_flips([0.5, 0.75], [0.5, 0.5], shares, "accuracy") == pytest.approx(0.25)  # none to flip
    with pytest.raises(AssertionError, match="too many near-ties"):
        excess_over_flips([0.5, 0.5], [0.5, 0.5], [0.5, 0.5], "accuracy")


def test_greedy_decoding_compared_up_to_a_near_tie_only():
    want = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 6, 7, 8]])
    gaps = torch.tensor([[0.5, 0.5, 1e-6], [0.5, 0.5, 0.5]])
    assert_same_greedy(want.clone(), want, gaps)
    parted = want.clone()
    parted[0, 4] = 9  # at the near-tie of row 0
    assert_same_greedy(parted, want, gaps)
    parted[1, 3] = 9  # clear of any tie
    with pytest.raises(AssertionError, match="clear of any tie"):
        assert_same_greedy(parted, want, gaps)
