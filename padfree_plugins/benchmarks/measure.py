"""What the benchmarks share to measure a step: device synchronisation and CPU activation memory."""

from __future__ import annotations

from collections.abc import Callable

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
