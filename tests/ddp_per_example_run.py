"""Run under ``accelerate launch`` (2 CPU processes) by tests/test_distributed.py: HF Trainer, bf16 mixed
precision, a tiny BERT classifier and / or embedder made padding-free by ``accelerate(trainer)``. Writes each rank's
losses and a checksum of its final weights (DDP keeps the ranks' weights equal only if the all-reduce ran)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import datasets
import torch
from accelerate import PartialState
from transformers import Trainer, TrainingArguments

from padfree_plugins import accelerate
from tests.conftest import make_examples
from tests.tasks_common import model_for


def reward(out: str) -> None:
    """TRL RewardTrainer, padded then padding-free (fp32): each rank's logged losses and metrics of both runs, and
    the padded run's share of pairs near a tie per step and in evaluation (``flips``: ``train``, ``eval``)."""
    from tests.test_reward import logged, recording_pair_margins, reward_trainer
    from tests.ties import flip_shares

    runs = {}
    for packed in (False, True):
        trainer, _ = reward_trainer(packed, max_steps=4)
        with contextlib.nullcontext([]) if packed else recording_pair_margins(trainer.model) as margins:
            trainer.train()
            trained = len(margins)
            evaluation = trainer.evaluate()
        runs["packed" if packed else "padded"] = {"log": logged(trainer), "eval": evaluation}
        if not packed:
            runs["flips"] = {"train": flip_shares(margins[:trained], trained // 4),
                             "eval": flip_shares(margins[trained:], len(margins) - trained)}
    rank = trainer.accelerator.process_index
    runs["processes"] = trainer.accelerator.num_processes
    with open(f"{out}.{rank}", "w") as file:
        json.dump(runs, file)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def main(tasks: str, out: str) -> None:
    """``tasks``: ``reward``, or ``seq_cls`` / ``embedding`` / both comma-separated (trained one after the other in
    this launch; each rank's file then holds ``{task: result}``)."""
    if tasks == "reward":
        return reward(out)
    runs = {task: train(task) for task in tasks.split(",")}
    state = PartialState()  # the trainers' process group
    with open(f"{out}.{state.process_index}", "w") as file:
        json.dump(runs if "," in tasks else runs[tasks], file)
    state.wait_for_everyone()  # a clean exit: no rank leaves while the other still talks to it
    torch.distributed.destroy_process_group()


def train(task: str) -> dict:
    """One bf16 HF Trainer run of ``task``: its rank's losses, process count and a checksum of its final weights."""
    lengths = [int(x) for x in torch.randint(2, 30, (64,), generator=torch.Generator().manual_seed(0))]
    texts = make_examples(lengths)
    if task == "seq_cls":
        model = model_for("bert", head="seq_cls", num_labels=2)
        rows = [{**text, "label": i % 2} for i, text in enumerate(texts)]
        config = {"task": "seq_cls", "attention": "exact"}
    else:
        model = model_for("bert")
        rows = [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"]}
                for a, b in zip(texts[::2], texts[1::2])]
        config = {"task": "embedding", "attention": "exact", "pooling": "mean",
                  "task_options": {"loss": "MultipleNegativesRankingLoss"}}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                             disable_tqdm=True, bf16=True, use_cpu=True, ddp_find_unused_parameters=task != "seq_cls")
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
    accelerate(trainer, config)
    trainer.train()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.accelerator.wait_for_everyone()  # both ranks done with this run's model before the next starts
    return {"processes": trainer.accelerator.num_processes, "checksum": checksum, "losses": losses}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The results are on disk and every rank is past its last collective: leave without the interpreter's teardown,
    # where a thread of the process group can still abort the process ("terminate called without an active
    # exception", SIGABRT after a finished run, seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
