"""What the benchmarks (and the demo) share to measure a step: device synchronisation, CPU activation memory,
thread count, interleaved timing rounds and the spread of a ratio over them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

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
