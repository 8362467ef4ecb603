"""A fault for tests/test_bench_scale.py, loaded by every process that has this folder on ``PYTHONPATH``: under
sequence parallelism each rank reads only its own slice of the fused log-probabilities (zeros at the other ranks'
tokens) instead of gathering the whole row, so a DPO / GRPO step computes a different loss."""

import torch

from padfree_plugins.integrations import trl_fused


def no_gather(x: torch.Tensor, group) -> torch.Tensor:
    return torch.cat([x if rank == group.rank else torch.zeros_like(x) for rank in range(group.size)], dim=1)


trl_fused.gather_sequence = no_gather
