"""What the benchmarks share to measure a step: device synchronisation, CPU activation memory, thread count."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
