"""Run by tests/test_token_budget_preference.py under torchrun (2 CPU processes, gloo), SGD:

* ``dpo``: TRL ``DPOTrainer`` with ``batching.strategy: tokens`` through the ``trl_dpo`` plugin;
* ``kto``: TRL ``KTOTrainer`` (with its KL term, gathered across the ranks) the same way, then TRL's padded KTO run
  fed the very same micro-batches on the same 2 processes (its reference: KTO's KL term is gathered across ranks,
  not across accumulation steps, so one process cannot stand in for two).

Rank 0 writes the logged losses and reward margins (``reference``: the padded run's, for ``kto``) and the final
weights to ``OUT`` (torch.save); both kinds (``dpo,kto``) run one after the other in one launch, ``OUT`` then
holding ``{kind: result}`` (``KIND``: ``dpo`` or ``kto``).

    python -m torch.distributed.run --nproc_per_node 2 tests/token_budget_preference_run.py KIND[,KIND] OUT
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from padfree_plugins import accelerate
from padfree_plugins.batching.sampler import trainer_train_dataloader
from padfree_plugins.integrations.trl_kto import kto_row_lengths
from tests.test_token_budget_preference import SGD, budget_config, dpo_trainer, logged, preference_trainer


def results(trainer) -> dict:
    return {"losses": logged(trainer), "margins": logged(trainer, "rewards/margins"),
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()}}


def main(kinds: str, out: str) -> None:
    """``kinds``: ``dpo``, ``kto`` or both comma-separated (one after the other in this launch; ``OUT`` then holds
    ``{kind: result}``)."""
    runs = {kind: run(kind) for kind in kinds.split(",")}
    if torch.distributed.get_rank() == 0:
        partial = Path(f"{out}.partial")
        torch.save(runs if "," in kinds else runs[kinds], partial)
        os.replace(partial, out)  # the result appears whole (run_group watches for it)
    torch.distributed.barrier()


def run(kind: str) -> dict:
    trainer = dpo_trainer(tempfile.mkdtemp(), **SGD) if kind == "dpo" else \
        preference_trainer("kto", tempfile.mkdtemp(), **SGD)
    acceleration = accelerate(trainer, budget_config())
    trainer.train()
    if trainer.accelerator.num_processes != 2:
        sys.exit("expected 2 processes")
    found = results(trainer)
    acceleration.undo()  # nothing of this run's patching reaches the next run of the launch
    if kind == "kto":
        padded = preference_trainer("kto", tempfile.mkdtemp(), **SGD)
        lengths = kto_row_lengths(padded.train_dataset, padded.args.max_length, True)
        padded.get_train_dataloader = lambda: trainer_train_dataloader(padded, budget_config(), padded.data_collator,
                                                                       lengths=lengths)
        padded.train()
        found["reference"] = results(padded)
    return found


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results on disk, every rank past its last collective: skip the gloo teardown (tests/sharded_run.py)
