"""Run by tests/test_token_budget_preference.py under torchrun (2 CPU processes, gloo): TRL ``DPOTrainer`` with
``batching.strategy: tokens`` through the ``trl_dpo`` plugin, SGD. Rank 0 writes the logged losses and reward margins
and the final weights to ``OUT`` (torch.save).

    python -m torch.distributed.run --nproc_per_node 2 tests/token_budget_preference_run.py OUT
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from padfree_plugins import accelerate
from tests.test_token_budget_preference import SGD, budget_config, dpo_trainer, logged


def main(out: str) -> None:
    trainer = dpo_trainer(tempfile.mkdtemp(), **SGD)
    accelerate(trainer, budget_config())
    trainer.train()
    if trainer.accelerator.num_processes != 2:
        sys.exit("expected 2 processes")
    if trainer.accelerator.is_main_process:
        torch.save({"losses": logged(trainer), "margins": logged(trainer, "rewards/margins"),
                    "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()}}, out)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results on disk, every rank past its last collective: skip the gloo teardown (tests/sharded_run.py)
