"""The timing helpers the benchmarks and the demo share: interleaved rounds and a ratio with its spread."""

from __future__ import annotations

import pytest

import torch

from padfree_plugins.benchmarks.measure import (
    Ratio,
    calls_seen,
    cost_weighted_ideal,
    interleaved_rounds,
    round_ratio,
    seconds_alone,
)


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


def test_cost_weighted_ideal_weighs_each_unit_by_what_it_cost_the_baseline():
    # 10 s: 4 on the part (200 part units: 0.02 s each), 6 on 600 other units (0.01 s each)
    assert cost_weighted_ideal(10.0, 4.0, (600, 200), (200, 200)) == pytest.approx(10 / (200 * 0.01 + 200 * 0.02))
    assert cost_weighted_ideal(10.0, 0.0, (600, 200), (50, 50)) == pytest.approx(3.0)  # nothing on the part
    assert cost_weighted_ideal(10.0, 10.0, (600, 200), (50, 50)) == pytest.approx(1.0)  # all on the part
    assert cost_weighted_ideal(10.0, 4.0, (600, 600), (200, 50)) == pytest.approx(10 / (6 + 1))  # the part shared


def test_a_call_seen_in_a_step_reruns_alone_with_its_gradients():
    """The module's own forward on the call's inputs (its hooks do not see it), the backward of the objective:
    the same parameter and input gradients as in the step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    hidden = x * 2  # an activation: requires a gradient
    with calls_seen([layer]) as calls:
        (layer(hidden) ** 2).sum().backward()
    expected = layer.weight.grad.clone()
    assert len(calls) == 1 and calls[0][0] is layer
    layer.weight.grad = None
    with calls_seen([layer]) as again:
        assert seconds_alone(calls[0], trained=True, objective=lambda out: (out ** 2).sum()) > 0
    assert again == []  # its own forward: the hooks do not count it
    assert torch.allclose(layer.weight.grad, expected)
    layer.weight.grad = None
    seconds_alone(calls[0], trained=False)
    assert layer.weight.grad is None  # without autograd
    seconds_alone(calls[0], trained=True)  # no objective: a gradient of ones on its output
    assert torch.allclose(layer.weight.grad, torch.ones(5, 3).T @ hidden.detach())
