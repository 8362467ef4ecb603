"""Token-budget batching (``batching.strategy: tokens``) for sentence-transformers trainers.

sentence-transformers builds its dataloaders through ``trainer.get_batch_sampler(dataset, …)`` — for a single
dataset and for every dataset of a ``DatasetDict`` — then lets accelerate shard them. :class:`TokenBudgetBatches`
replaces that method for the training data: the batch sampler is padfree-plugins'
:class:`~padfree_plugins.sampler.TokenBudgetBatchSampler` (micro-batches filled up to ``max_tokens_per_batch``,
ranks balanced, every row once per epoch), and every other dataset (evaluation) keeps the trainer's own sampler.

A row's cost is the tokens of all its text columns (each text is packed separately), counted once by tokenizing
the dataset with the model's tokenizer, truncated as the model truncates. Special tokens are counted per column,
so a cross-encoder's (query, document) pair is counted one separator high: the budget is never exceeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from padfree_plugins.errors import BatchError, ConfigError
from padfree_plugins.patching import own_attribute, restore_attributes
from padfree_plugins.sampler import batching_config, token_budget_sampler, uses_token_budget


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


@dataclass
class BatchSamplerPatch:
    """``trainer.get_batch_sampler`` replaced; :meth:`undo` restores it."""

    trainer: Any
    saved: Any
    active: bool = True

    @classmethod
    def apply(cls, trainer: Any, model: Any, config: Any) -> "BatchSamplerPatch":
        saved = own_attribute(trainer, "get_batch_sampler")
        trainer.get_batch_sampler = TokenBudgetBatches(trainer, model, config, trainer.get_batch_sampler)
        return cls(trainer, saved)

    def undo(self) -> None:
        if not self.active:
            return
        restore_attributes(self.trainer, {"get_batch_sampler": self.saved})
        self.active = False
