"""Worker of tests/test_sequence_parallel_trl.py: TRL ``DPOTrainer`` under ``sequence_parallel: {size: 2}`` on 2 CPU
processes (gloo).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_trl_run.py \
        MODE[,MODE...] OUT

Each mode trains :func:`dpo_trainer` (sigmoid loss, a separate reference model, 2 pairs per rank a step): ``exact``
as built; the faults, which must not equal one process: ``no-gather`` (each rank reads its own slice's per-token
outputs only, zeros at the other rank's tokens: no gather) and ``first-range`` (each rank keeps the joined row's
first tokens, not its own range). After training, ``exact`` evaluates (:data:`EVAL_PAIRS` pairs, 2 a rank:
``evaluate()`` and ``predict()`` with :func:`~tests.distributed_common.token_metrics`), then predicts once more with
``first-range`` (``evaluation``; ``evaluation_cuts``: per rank, whether a completion crossed the cut of each of the
evaluation's split fused calls). Rank 0 writes ``{mode: {"losses", "margins", "state", "seen"}}`` to ``OUT``
(torch.save); ``seen``: per rank, per sequence-parallel fused call of training, (the joined row's tokens, the slice's).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile

import torch
import torch.distributed as dist

from padfree_plugins.integrations import trl_fused
from padfree_plugins.packing.batch import packed_tokens
from tests.distributed_common import evaluated, finish, leave, token_metrics

STEPS = 3
SP_CONFIG = {"task": "causal_lm", "sequence_parallel": {"size": 2}}
FAULTS = ("no-gather", "first-range")
#: The evaluation set: one batch of 2 pairs per rank (the one-process reference evaluates them 2 at a time too), pairs
#: 4-7 of tests/test_trl_preference.py ``pairs``: a completion crosses the cut of each of their split calls.
EVAL_PAIRS, EVAL_BATCH = 4, 2


def dpo_trainer(output_dir: str, config: dict, batch_size: int):
    """TRL ``DPOTrainer`` (sigmoid, a separate reference model) on the tiny Llama of tests/test_trl_preference.py,
    padding-free through ``accelerate(trainer, config)``. SGD at a high rate: the weights move far beyond 1e-5."""
    import trl

    from padfree_plugins import accelerate
    from tests.test_trainer import tokenizer
    from tests.test_trl_preference import pairs, policy

    model = policy()
    args = trl.DPOConfig(output_dir=output_dir, per_device_train_batch_size=batch_size, max_steps=STEPS,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                         report_to=[], seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False,
                         disable_tqdm=True, per_device_eval_batch_size=EVAL_BATCH)
    trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                             train_dataset=pairs(4 * STEPS), eval_dataset=pairs(2 * EVAL_PAIRS).select(range(EVAL_PAIRS, 2 * EVAL_PAIRS)),
                             processing_class=copy.deepcopy(tokenizer()), compute_metrics=token_metrics)
    if accelerate(trainer, config).trainer_plugin != "trl_dpo":
        sys.exit("dpo: accelerate() did not take the trl_dpo plugin")
    return trainer


def logged(trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def result(trainer) -> dict:
    return {"losses": logged(trainer), "margins": logged(trainer, "rewards/margins"),
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()}}


def no_gather(x: torch.Tensor, group) -> torch.Tensor:
    """The fault ``no-gather``: this rank's slice in its place of the whole row, zeros at the other ranks'."""
    pieces = [x if rank == group.rank else torch.zeros_like(x) for rank in range(group.size)]
    return torch.cat(pieces, dim=1)


def first_range(whole: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """The fault ``first-range``: the joined row's first tokens, whichever rank's they are."""
    return whole[:, :sizes[rank]]


def crosses(joined: int, cut: int, bounds: list[int], labelled: list[bool]) -> bool:
    """Whether a completion of a joined row (its boundaries ``bounds``; ``labelled``: which tokens predict a label)
    crosses the cut after ``cut`` tokens: a segment with labelled tokens on both sides of it."""
    return any(start < cut < end and any(labelled[start:cut]) and any(labelled[cut:end])
               for start, end in zip(bounds, bounds[1:]))


@contextlib.contextmanager
def replacing(owner, name: str, value):
    """Within the block, ``owner.name`` is ``value``."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def train(mode: str, seen: list) -> dict:
    saved = trl_fused.gather_sequence, trl_fused.own_tokens, trl_fused.slice_row
    if mode == "no-gather":
        trl_fused.gather_sequence = no_gather
    elif mode == "first-range":
        trl_fused.own_tokens = first_range

    def recording_slice_row(row, rank, size, *args, **kwargs):
        local = saved[2](row, rank, size, *args, **kwargs)
        seen.append((int(row["cu_seq_lens_q"][-1]), packed_tokens(local), row["cu_seq_lens_q"].tolist(),
                     (row["shift_labels"][0] != -100).tolist()))
        return local

    trl_fused.slice_row = recording_slice_row
    try:
        trainer = dpo_trainer(tempfile.mkdtemp(), SP_CONFIG, batch_size=2)
        trainer.train()
        run = result(trainer)
        if mode == "exact":  # evaluation and prediction, then prediction under the fault first-range
            trained = len(seen)
            run["evaluation"] = evaluated(trainer, replacing(trl_fused, "own_tokens", first_range))
            run["evaluation_cuts"] = [crosses(*call) for call in seen[trained:]]
            del seen[trained:]
        return run
    finally:
        trl_fused.gather_sequence, trl_fused.own_tokens, trl_fused.slice_row = saved


def main(modes: list[str], out: str) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    if state.num_processes != 2:
        sys.exit("launch with torchrun --nproc_per_node 2: one sequence-parallel group of 2")
    results = {}
    for mode in modes:
        seen: list = []
        run = train(mode, seen)
        everyone: list = [None] * 2
        dist.all_gather_object(everyone, seen)
        results[mode] = {**run, "seen": [[call[:2] for call in calls] for calls in everyone],
                         "processes": state.num_processes}
        if "evaluation_cuts" in run:
            cuts: list = [None] * 2
            dist.all_gather_object(cuts, run["evaluation_cuts"])
            results[mode]["evaluation_cuts"] = cuts
    finish(results, out)


if __name__ == "__main__":
    chosen = sys.argv[1].split(",")
    unknown = [mode for mode in chosen if mode not in ("exact", *FAULTS)]
    if unknown:
        sys.exit(f"modes must be among exact, {', '.join(FAULTS)}, not {unknown}")
    main(chosen, sys.argv[2])
    leave()
