"""Token-budget batching (``batching.strategy: tokens``) for sentence-transformers trainers.

sentence-transformers builds its dataloaders through ``trainer.get_batch_sampler(dataset, …)`` — for a single
dataset and for every dataset of a ``DatasetDict`` — then lets accelerate shard them. :class:`TokenBudgetBatches`
replaces that method for the training data: the batch sampler is padfree-plugins'
:class:`~padfree_plugins.batching.sampler.TokenBudgetBatchSampler` (micro-batches filled up to ``max_tokens_per_batch``,
ranks balanced, every row once per epoch), and every other dataset (evaluation) keeps the trainer's own sampler.
With several training datasets (a ``DatasetDict``), :class:`TokenBudgetMultiDataset` replaces
``get_multi_dataset_batch_sampler``: :class:`InterleavedSteps` interleaves the datasets' micro-batches a whole
step (one micro-batch per rank) at a time, round-robin or proportionally as ``multi_dataset_batch_sampler`` says,
so that the ranks of a step always share a dataset and a balanced token count.

A row's cost is the tokens of all its text columns (each text is packed separately), counted once by tokenizing
the dataset with the model's tokenizer, truncated as the model truncates. Special tokens are counted per column,
so a cross-encoder's (query, document) pair is counted one separator high: the budget is never exceeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from padfree_plugins.batching.sampler import (
    TokenBudgetBatchSampler,
    batching_config,
    check_whole_micro_batches,
    pass_epoch_on,
    token_budget_sampler,
    uses_token_budget,
)
from padfree_plugins.errors import BatchError, ConfigError
from padfree_plugins.modeling.patching import own_attribute, restore_attributes


def text_lengths(model: Any, dataset: Any, label_columns: Any = ()) -> np.ndarray:
    """Tokens of every row of ``dataset``: the sum over its text (string) columns, truncated like the model."""
    tokenizer, limit = model.tokenizer, model.max_seq_length
    total = np.zeros(len(dataset), dtype=np.int64)
    texts = [c for c in dataset.column_names if c not in set(label_columns or ()) and
             dataset.features[c].dtype == "string"] if hasattr(dataset, "features") else []
    if not texts:
        raise BatchError(f"token-budget batching found no text column in the training dataset (columns: "
                         f"{', '.join(getattr(dataset, 'column_names', []))}); it needs string columns to count tokens")
    for column in texts:
        encoded = tokenizer(list(dataset[column]), add_special_tokens=True, truncation=limit is not None,
                            max_length=limit)["input_ids"]
        total += np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    return total


def check_config(config: Any) -> None:
    """Refuse what cannot work on raw text before training starts."""
    if uses_token_budget(config) and batching_config(config).on_overlong_example == "split":
        raise ConfigError("batching.on_overlong_example: split cannot cut the raw texts of a sentence-transformers "
                          "dataset; use error, or raise max_tokens_per_batch above the longest row")


@dataclass
class TokenBudgetBatches:
    """The trainer's ``get_batch_sampler`` with token budgets for its training data (see the module docstring)."""

    trainer: Any
    model: Any
    config: Any
    original: Any
    lengths: dict[int, np.ndarray] = field(default_factory=dict)

    def training_datasets(self) -> list[Any]:
        data = self.trainer.train_dataset
        return list(data.values()) if hasattr(data, "values") else [data]

    def __call__(self, dataset: Any, batch_size: int, drop_last: bool, valid_label_columns: Any = None,
                 generator: Any = None, seed: int = 0) -> Any:
        if not any(dataset is train for train in self.training_datasets()):
            return self.original(dataset, batch_size=batch_size, drop_last=drop_last,
                                 valid_label_columns=valid_label_columns, generator=generator, seed=seed)
        if id(dataset) not in self.lengths:  # counted once per dataset, reused every epoch
            self.lengths[id(dataset)] = text_lengths(self.model, dataset, valid_label_columns)
        return token_budget_sampler(dataset, self.config, lengths=self.lengths[id(dataset)], seed=seed,
                                    num_replicas=self.trainer.accelerator.num_processes)


class InterleavedSteps:
    """The micro-batches of several datasets' token-budget samplers, one whole step at a time: ``round_robin``
    (a step of each dataset in turn, until one runs out, as sentence-transformers' ``RoundRobinBatchSampler``) or
    ``proportional`` (every step of every dataset, in a seeded random order, as ``ProportionalBatchSampler``)."""

    def __init__(self, offsets: list[int], samplers: list[TokenBudgetBatchSampler], policy: str, seed: int = 0):
        self.offsets, self.samplers, self.policy, self.seed, self.epoch = offsets, samplers, policy, seed, 0
        self.num_replicas = samplers[0].num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def steps(self) -> list[list[list[list[int]]]]:
        """Per dataset, its steps: ``num_replicas`` micro-batches each, indices into the concatenated dataset."""
        out = []
        for offset, sampler in zip(self.offsets, self.samplers):
            batches = [[offset + i for i in batch] for batch in sampler.plan()]
            out.append([batches[k:k + self.num_replicas] for k in range(0, len(batches), self.num_replicas)])
        return out

    def order(self, counts: list[int]) -> list[int]:
        """The dataset of each step, in order."""
        if self.policy == "round_robin":
            return [d for _ in range(min(counts)) for d in range(len(counts))]
        order = np.repeat(np.arange(len(counts)), counts)
        return np.random.default_rng((self.seed, self.epoch)).permutation(order).tolist()

    def __iter__(self):
        per_dataset = self.steps()
        cursors = [iter(steps) for steps in per_dataset]
        for dataset in self.order([len(steps) for steps in per_dataset]):
            yield from next(cursors[dataset])

    def __len__(self) -> int:
        return len(self.order([len(steps) for steps in self.steps()])) * self.num_replicas


@dataclass
class TokenBudgetMultiDataset:
    """The trainer's ``get_multi_dataset_batch_sampler`` for token-budget samplers (see the module docstring)."""

    trainer: Any
    original: Any

    def __call__(self, dataset: Any, batch_samplers: list, generator: Any = None, seed: int | None = 0) -> Any:
        if not all(isinstance(sampler, TokenBudgetBatchSampler) for sampler in batch_samplers):
            return self.original(dataset, batch_samplers=batch_samplers, generator=generator, seed=seed)
        policy = getattr(self.trainer.args.multi_dataset_batch_sampler, "value",
                         self.trainer.args.multi_dataset_batch_sampler)
        if policy not in ("round_robin", "proportional"):
            raise ConfigError(f"batching.strategy: tokens interleaves several training datasets round_robin or "
                              f"proportional; multi_dataset_batch_sampler={policy!r} is neither")
        offsets = [0, *np.cumsum([len(part) for part in dataset.datasets])[:-1].tolist()]
        return InterleavedSteps(offsets, batch_samplers, policy, seed or 0)


@dataclass
class EpochThroughShards:
    """The trainer's ``get_train_dataloader``, with the epoch passed on to a token-budget sampler through
    accelerate's per-rank wrapper (see :func:`padfree_plugins.batching.sampler.pass_epoch_on`): resuming mid-epoch
    under DDP
    would otherwise replay epoch 0's batches."""

    original: Any

    def __call__(self) -> Any:
        loader = self.original()
        sampler = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if isinstance(sampler, (TokenBudgetBatchSampler, InterleavedSteps)):
            pass_epoch_on(loader, sampler)
        return loader


@dataclass
class BatchSamplerPatch:
    """``trainer.get_batch_sampler``, ``get_multi_dataset_batch_sampler`` and ``get_train_dataloader`` replaced;
    :meth:`undo` restores them."""

    trainer: Any
    saved: Any
    active: bool = True

    @classmethod
    def apply(cls, trainer: Any, model: Any, config: Any) -> "BatchSamplerPatch":
        check_whole_micro_batches(trainer.accelerator)
        names = ("get_batch_sampler", "get_multi_dataset_batch_sampler", "get_train_dataloader")
        saved = {name: own_attribute(trainer, name) for name in names}
        trainer.get_batch_sampler = TokenBudgetBatches(trainer, model, config, trainer.get_batch_sampler)
        trainer.get_multi_dataset_batch_sampler = TokenBudgetMultiDataset(trainer,
                                                                          trainer.get_multi_dataset_batch_sampler)
        trainer.get_train_dataloader = EpochThroughShards(trainer.get_train_dataloader)
        return cls(trainer, saved)

    def undo(self) -> None:
        if not self.active:
            return
        restore_attributes(self.trainer, self.saved)
        self.active = False
