"""The timing helpers the benchmarks and the demo share: interleaved rounds and a ratio with its spread."""

from __future__ import annotations

import pytest

from padfree_plugins.benchmarks.measure import Ratio, interleaved_rounds, round_ratio


def test_interleaved_rounds_run_every_variant_once_a_round_in_a_rotating_order():
    calls, entered = [], []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved_rounds(steps, 4, entered.append)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert entered == calls  # entered (untimed) right before each step
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for seconds in times.values() for t in seconds)


def test_round_ratio_takes_the_ratio_within_each_round():
    # a round that slowed both sides alike (round 2) leaves its ratio as it is: 2, 2, 3
    ratio = round_ratio([2.0, 20.0, 3.0], [1.0, 10.0, 1.0])
    assert ratio == Ratio(median=2.0, low=2.0, high=3.0, rounds=3)
    assert str(ratio) == "2.00x (2.00-3.00 over 3 rounds)"
    # the ratio of medians would mix rounds: 3.0 / 1.0
    assert round_ratio([2.0, 20.0, 3.0], [1.0, 10.0, 1.0]).median != 3.0


@pytest.mark.parametrize("baseline, times", [([1.0, 2.0], [1.0]), ([], [])])
def test_round_ratio_needs_the_same_rounds_on_both_sides(baseline, times):
    with pytest.raises(ValueError, match="same rounds"):
        round_ratio(baseline, times)
