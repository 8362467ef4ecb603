"""``batching.group_prefixes``: micro-batches that keep the examples of one prompt together, so that prefix sharing
(:mod:`padfree_plugins.packing.prefixes`) finds them in one packed row.

An example's *prompt* is its unlabelled prefix: its tokens before the first one that predicts a label (as
:func:`~padfree_plugins.packing.prefixes.unlabelled_prefixes` reads a packed batch). Examples of an equal prompt
(best-of-N answers, several distilled answers per prompt) form a group. Every epoch the groups are shuffled (from
``(seed, epoch)``; a group keeps its dataset order) and laid into micro-batches of ``batch_size`` examples, first fit:
a group goes into the first micro-batch still open with room for it all, and a group larger than a micro-batch fills
whole micro-batches first. Full micro-batches come in the order they fill; those left open (only where groups do not
fill them) come last. The sampler yields their indices one after the other, so the trainer's own batching (every
``batch_size`` indices) cuts exactly these micro-batches.

It changes which examples meet in a micro-batch (and so in a step): the training is not the one of a random sampler,
but equals a padded run given the same sampler.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

#: The label of a token without one.
IGNORED = -100


def unlabelled_prompt(row: Mapping[str, Any]) -> tuple[int, ...]:
    """A dataset row's unlabelled prefix (token ids), read from ``labels`` (-100: none), else TRL's
    ``completion_mask`` or ``assistant_masks`` (0: none); empty where every token is labelled or nothing says which."""
    ids = list(row["input_ids"])
    if row.get("labels") is not None:
        labelled = [label != IGNORED for label in row["labels"]]
        labelled[:1] = [False]  # an example's first label is never trained (no token predicts it)
    else:
        mask = row.get("completion_mask", row.get("assistant_masks"))
        if mask is None:
            return ()
        labelled = [bool(value) for value in mask]
    first = next((index for index, value in enumerate(labelled) if value), len(ids))
    return tuple(ids[:max(0, first - 1)])


def prompt_groups(rows: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """The indices of rows of an equal, non-empty prompt, grouped in order of first appearance (a row without a
    prompt alone)."""
    groups: dict[Any, list[int]] = {}
    for index, prompt in enumerate(rows):
        groups.setdefault(prompt if prompt else ("alone", index), []).append(index)
    return list(groups.values())


def grouped_micro_batches(groups: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """``groups`` laid into micro-batches of ``batch_size`` indices, first fit (see the module docstring)."""
    full: list[list[int]] = []
    open_: list[list[int]] = []
    for group in groups:
        group = list(group)
        while len(group) >= batch_size:
            full.append(group[:batch_size])
            group = group[batch_size:]
        if not group:
            continue
        target = next((batch for batch in open_ if len(batch) + len(group) <= batch_size), None)
        if target is None:
            target = []
            open_.append(target)
        target.extend(group)
        if len(target) == batch_size:
            open_.remove(target)
            full.append(target)
    return full + open_


class PrefixGroupSampler(Sampler[int]):
    """The epoch's indices in micro-batches of whole prompt groups (:func:`grouped_micro_batches` of the groups
    shuffled from ``(seed, epoch)``). Accelerate's prepared dataloader calls ``set_epoch`` every epoch. No
    ``generator`` attribute: accelerate would take it for a torch generator to synchronise."""

    def __init__(self, prompts: Sequence[tuple[int, ...]], batch_size: int, seed: int = 0):
        self.groups, self.batch_size, self.seed, self.epoch = prompt_groups(prompts), int(batch_size), seed, 0
        self.n = len(prompts)

    @classmethod
    def of(cls, dataset: Any, batch_size: int, seed: int = 0) -> PrefixGroupSampler:
        """The sampler of a dataset of token rows (``input_ids`` and ``labels`` / ``completion_mask``)."""
        return cls([unlabelled_prompt(dataset[index]) for index in range(len(dataset))], batch_size, seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def micro_batches(self, epoch: int | None = None) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        order = rng.permutation(len(self.groups)).tolist()
        return grouped_micro_batches([self.groups[index] for index in order], self.batch_size)

    def __iter__(self) -> Iterator[int]:
        return iter([index for batch in self.micro_batches() for index in batch])

    def __len__(self) -> int:
        return self.n
