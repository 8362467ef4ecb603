"""What the benchmarks (and the demo) share to measure a step: device synchronisation, CPU activation memory,
thread count, interleaved timing rounds and the spread of a ratio over them, and a part of a step timed alone (the
calls a module saw, rerun outside the step's time) with the ideal speedup weighted by what that part costs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work (timings and memory peaks must cover it); nothing to do on other devices."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step()`` (which returns the loss),
    then runs the backward. On CPU, where no allocator counts, this is the memory padding inflates."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step()
    loss.backward()
    return sum(seen.values())


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside the block (``None``: left as they are), restored after."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def interleaved_rounds(steps: Mapping[str, Callable[[], object]], rounds: int,
                       enter: Callable[[str], None] = lambda variant: None) -> dict[str, list[float]]:
    """Seconds of one call of each variant's step, per round: every round runs every variant once, in an order that
    rotates each round, so that machine noise hits them alike. ``enter(variant)`` runs untimed before its step (to
    patch or unpatch a model)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            enter(name)
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


@dataclass(frozen=True)
class Ratio:
    """A speed ratio measured over interleaved rounds: the median of the per-round ratios and their range."""

    median: float
    low: float
    high: float
    rounds: int

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f} over {self.rounds} rounds)"


def round_ratio(baseline: list[float], times: list[float]) -> Ratio:
    """How many times faster ``times`` ran than ``baseline`` (seconds per round, same rounds): the ratio is taken
    within each round, then its median and range over the rounds."""
    if not times or len(times) != len(baseline):
        raise ValueError(f"need the same rounds on both sides, got {len(baseline)} and {len(times)}")
    ratios = [b / t for b, t in zip(baseline, times)]
    return Ratio(statistics.median(ratios), min(ratios), max(ratios), len(ratios))


#: One call of a module: the module, its positional and its keyword arguments.
Call = tuple[torch.nn.Module, tuple, dict]


@contextmanager
def calls_seen(modules: Sequence[torch.nn.Module]) -> Iterator[list[Call]]:
    """Every call of ``modules`` inside the block, in order (forward pre-hooks, removed after the block)."""
    calls: list[Call] = []
    handles = [module.register_forward_pre_hook(lambda module, args, kwargs: calls.append((module, args, kwargs)),
                                                with_kwargs=True) for module in modules]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def features(output: Any) -> torch.Tensor:
    """A module's output as one tensor: itself, or a model output's pooled (else last) hidden states."""
    if isinstance(output, torch.Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    return pooled if pooled is not None else output.last_hidden_state


def seconds_alone(call: Call, trained: bool, objective: Callable[[Any], torch.Tensor] | None = None) -> float:
    """Seconds of one call's module run again alone on the call's inputs: its own ``forward`` (hooks on the module
    do not see it), and if ``trained`` the backward — of ``objective(output)`` (a loss) when given, else of a
    gradient of ones on its :func:`features`; without autograd otherwise. The inputs are detached, and those that
    required a gradient in the call (activations) require one again, so the backward computes their gradient as the
    step did. Gradients accumulate in the module's parameters: clear them before (set to ``None``) to time what a
    step's backward does."""
    module, args, kwargs = call

    def alone(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().requires_grad_(trained and value.requires_grad)

    args, kwargs = tuple(map(alone, args)), {key: alone(value) for key, value in kwargs.items()}
    start = time.perf_counter()
    with torch.set_grad_enabled(trained):
        output = module.forward(*args, **kwargs)
        if trained:
            if objective is not None:
                objective(output).backward()
            else:
                out = features(output)
                out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def cost_weighted_ideal(seconds: float, part_seconds: float, units: tuple[int, int], part_units: tuple[int, int]
                        ) -> float:
    """The ideal speedup of a variant over a baseline, each unit weighted by what it cost the baseline.

    The baseline computes ``units[0]`` units and ``part_units[0]`` units of a part in ``seconds``, of which
    ``part_seconds`` on the part (timed alone); the variant ``units[1]`` and ``part_units[1]``. A part unit costs
    ``part_seconds / part_units[0]``, any other unit ``(seconds - part_seconds) / units[0]``; the ideal is
    ``seconds`` over what the variant's units cost at those rates. With ``part_seconds`` 0 it is the ratio of units;
    between 1 and that ratio when the part is not shared (``part_units`` equal) and ``0 <= part_seconds <=
    seconds``."""
    part, rest = part_seconds / part_units[0], (seconds - part_seconds) / units[0]
    return seconds / (units[1] * rest + part_units[1] * part)
