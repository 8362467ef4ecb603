"""The batching plan kept in every checkpoint, and checked when a run resumes from one.

HF ``Trainer`` resumes mid-epoch by skipping the batches the checkpoint's step count says were trained. Those are
batches of the plan the run trains *now*: had the plan changed (``batching.strategy``, ``max_tokens_per_batch``, the
seed, the number of processes, the dataset …), the run would skip another plan's steps, training some examples twice
that epoch and others never. So every checkpoint keeps the plan's fingerprint (:data:`FINGERPRINT_FILE`, written by
:func:`plan_callback`), and ``train(resume_from_checkpoint=…)`` refuses a checkpoint of another plan before anything
is loaded (:class:`ResumeGuard`), saying what to do: restore the checkpoint's settings, start afresh, or resume the
weights and optimizer without skipping data (``ignore_data_skip=True``, which the trainer honours by starting the
epoch from its first batch).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from padfree_plugins.batching.sampler import example_lengths, uses_token_budget
from padfree_plugins.errors import ConfigError
from padfree_plugins.modeling.patching import own_attribute

#: The file, in every checkpoint directory, that holds the batching plan's fingerprint.
FINGERPRINT_FILE = "padfree_batching.json"


def batching_seed(trainer: Any, config: Any) -> int:
    """The seed of padfree-plugins' batching: ``batching.seed``, else the trainer's ``data_seed``, else its ``seed``."""
    seed, args = config.batching.seed, trainer.args
    return int(seed if seed is not None else (args.data_seed if args.data_seed is not None else args.seed))


def plan_fingerprint(trainer: Any, config: Any, lengths: Callable[[], Any] | None = None) -> dict[str, Any]:
    """What decides the trainer's batches under ``config``: ``{"strategy": "examples"}`` for the trainer's own
    batches (with ``batching.group_prefixes``: that, the seed, the micro-batch size and the number of rows); for a
    token budget, the budget's settings, the seed, the number of processes and every row's size (``lengths()``, else
    read from the training set as the token-budget dataloader reads them), hashed."""
    batching, dataset = config.batching, trainer.train_dataset
    seed = batching_seed(trainer, config)
    if getattr(batching, "group_prefixes", False) and dataset is not None and hasattr(dataset, "__len__"):
        return {"strategy": "examples", "group_prefixes": True, "seed": seed,
                "batch_size": int(trainer.args.per_device_train_batch_size), "examples": len(dataset)}
    if not uses_token_budget(config) or dataset is None or not hasattr(dataset, "__len__"):
        return {"strategy": "examples"}
    sizes = lengths() if lengths is not None else None
    if sizes is None:
        sizes = example_lengths(dataset, length_column=batching.length_column)
    sizes = np.asarray(sizes, dtype=np.int64)
    return {"strategy": "tokens", "max_tokens_per_batch": batching.max_tokens_per_batch,
            "max_pixels_per_batch": batching.max_pixels_per_batch, "window": batching.window,
            "drop_last": batching.drop_last, "on_overlong_example": batching.on_overlong_example, "seed": seed,
            "processes": int(trainer.accelerator.num_processes), "examples": int(sizes.size),
            "sizes_sha256": hashlib.sha256(sizes.tobytes()).hexdigest()[:16]}


#: How a setting of the fingerprint is named in messages.
SETTING_NAMES = {"strategy": "batching.strategy", "max_tokens_per_batch": "batching.max_tokens_per_batch",
                 "max_pixels_per_batch": "batching.max_pixels_per_batch", "window": "batching.window",
                 "drop_last": "batching.drop_last", "on_overlong_example": "batching.on_overlong_example",
                 "group_prefixes": "batching.group_prefixes", "batch_size": "per_device_train_batch_size",
                 "seed": "the data seed (batching.seed, else TrainingArguments data_seed / seed)",
                 "processes": "the number of processes", "examples": "the training set's rows",
                 "sizes_sha256": "the training set's row lengths (a hash)"}


def plan_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Every setting in which two fingerprints differ, as ``name: saved -> now``."""
    keys = dict.fromkeys((*saved, *now))
    return [f"{SETTING_NAMES.get(key, key)}: {saved.get(key)} -> {now.get(key)}" for key in keys
            if saved.get(key) != now.get(key)]


def plan_callback(fingerprint: Callable[[], dict[str, Any]]) -> Any:
    """A ``TrainerCallback`` that writes the plan's fingerprint (``fingerprint()``) into every checkpoint the trainer
    saves. (transformers' trainer modules are imported here, not with this module: ``list`` stays light.)"""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class PlanCallback(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if args.should_save and os.path.isdir(folder):
                with open(os.path.join(folder, FINGERPRINT_FILE), "w") as file:
                    json.dump(fingerprint(), file, indent=1)

    return PlanCallback()


@dataclass
class ResumeGuard:
    """The trainer's ``train`` checking a checkpoint's plan before resuming from it, and a :func:`plan_callback`
    (:meth:`install`; :meth:`remove` takes the callback off, the caller restores ``train`` from what it saved)."""

    trainer: Any
    fingerprint: Callable[[], dict[str, Any]]
    own_train: Any = None
    callback: Any = None
    #: The plan of the current ``train()`` call (computed once per call, written into its checkpoints).
    current: dict[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def install(cls, trainer: Any, fingerprint: Callable[[], dict[str, Any]], saved: dict[str, Any]) -> ResumeGuard:
        guard = cls(trainer, fingerprint)
        saved["train"] = own_attribute(trainer, "train")
        guard.own_train = trainer.train
        guard.callback = plan_callback(guard.plan)
        trainer.add_callback(guard.callback)
        trainer.train = guard.train
        return guard

    def remove(self) -> None:
        if self.callback is not None:
            self.trainer.remove_callback(self.callback)
            self.callback = None

    def plan(self) -> dict[str, Any]:
        if self.current is None:
            self.current = self.fingerprint()
        return self.current

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The trainer's ``train``, after :meth:`check` of the checkpoint it resumes from (if any)."""
        checkpoint = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        self.current = None  # the dataset or the process count may have changed since the last call
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.trainer.args.output_dir)  # none found: the trainer says so
        if isinstance(checkpoint, (str, os.PathLike)):
            self.check(str(checkpoint))
        return self.own_train(*args, **kwargs)

    def check(self, checkpoint: str) -> None:
        """Refuse (a :class:`ConfigError`, nothing loaded yet) to resume from a checkpoint of another plan, unless
        ``ignore_data_skip`` (no batch is skipped); warn when a token-budget run resumes from a checkpoint that
        records no plan."""
        if self.trainer.args.ignore_data_skip:
            return
        path = os.path.join(checkpoint, FINGERPRINT_FILE)
        now = self.plan()
        if not os.path.isfile(path):
            if now["strategy"] == "tokens" and os.path.isdir(checkpoint):
                warnings.warn(f"{checkpoint} records no batching plan (saved without padfree-plugins, or by an older "
                              "version): resuming skips its steps in this run's token-budget plan, which is right "
                              "only if it trained this very plan. If not, set ignore_data_skip=True or start afresh",
                              stacklevel=3)
            return
        with open(path) as file:
            saved = json.load(file)
        differences = plan_differences(saved, now)
        if differences:
            raise ConfigError(
                f"{checkpoint} was trained with another batching plan ({'; '.join(differences)}): resuming would "
                "skip the steps it trained in this run's plan, which holds other batches, so some examples would "
                "be trained twice this epoch and others never. Restore the checkpoint's settings (the acceleration "
                "config, the seed, the processes and the dataset it was trained with: "
                f"{FINGERPRINT_FILE} in the checkpoint lists them); or start a fresh run (no "
                "resume_from_checkpoint); or keep the weights and the optimizer but not the data position: "
                "TrainingArguments(ignore_data_skip=True), which restarts the epoch from its first batch")
