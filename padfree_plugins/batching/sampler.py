"""Token-budget batching (multipack): micro-batches filled up to a token budget, balanced across ranks.

With padding gone, a micro-batch costs its token count, not its example count, and in data-parallel training the
rank with the most tokens holds the others up. :class:`TokenBudgetBatchSampler` fills every micro-batch up to
``max_tokens_per_batch`` by bin packing and gives the ``N`` ranks of each step nearly the same number of tokens
(the plan is in :mod:`padfree_plugins.batching.planning`). Every rank computes the same plan from the same seed and
epoch,
so no communication is needed.

Two ways to shard across ranks:

* ``rank=None`` (the default, for ``accelerator.prepare``): the sampler yields all micro-batches, step-major —
  step ``s`` is micro-batches ``s*N … s*N+N-1`` — and accelerate's ``BatchSamplerShard`` hands micro-batch
  ``s*N+r`` to rank ``r``. The count is always a multiple of ``N``, so accelerate never pads or repeats.
* ``rank=r``: the sampler yields only rank ``r``'s micro-batches (for loops that shard themselves).

Over-long examples (more tokens than the budget) are an error, or, with ``on_overlong="split"``, are cut into
chunks of at most the budget that are trained as **independent examples**: each chunk is its own packed example,
positions restart at the architecture's start, attention never crosses from one chunk into another, and a causal-LM
chunk does not learn its first token (the collator masks every example's first label). Continuing positions would
not give a chunk its missing context (the earlier chunk is in another micro-batch), so chunks are not pretended
to be one sequence. Sampler items are then chunks, and :meth:`TokenBudgetBatchSampler.dataset_view` (called by
:func:`token_budget_dataloader`) serves them from the original dataset.

A row holding several texts (a listwise row: one query's candidates, see
:func:`~padfree_plugins.packing.collator.holds_several_texts`) counts all their tokens and is never split: one over the
budget is refused when the dataloader is built. Trainers refuse accelerate's ``split_batches=True``
(:func:`check_whole_micro_batches`), which would cut every planned micro-batch across the ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from padfree_plugins.batching.planning import plan_epoch
from padfree_plugins.config.schema import BatchingConfig, PadfreeConfig, load_config
from padfree_plugins.errors import BatchError, ConfigError
from padfree_plugins.packing.batch import INDEX_KEY
from padfree_plugins.packing.collator import holds_several_texts

#: Per-token keys a split example is cut along (besides the collator's own token keys).
SPLIT_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids")
#: Shuffles of epoch 0 that set every epoch's step count (see ``TokenBudgetBatchSampler._pinned_steps``).
PIN_DRAWS = 3
#: Draws of an epoch's shuffle before giving up on its pinned step count (with a warning).
MAX_REDRAWS = 16


# -- lengths ---------------------------------------------------------------------------------------------------------


def example_lengths(dataset: Any = None, *, lengths: Sequence[int] | np.ndarray | None = None,
                    length_column: str = "length", input_key: str = "input_ids") -> np.ndarray:
    """Token count of every example, int64, computed once: from ``lengths``, else the dataset's
    ``length_column`` (checked against ``input_ids`` when both are there: a :class:`BatchError` names the first wrong
    row), else from ``input_ids`` (one vectorised Arrow pass for a ``datasets.Dataset``, one pass over the examples
    otherwise)."""
    if lengths is not None:
        array = np.asarray(lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)
    elif dataset is None:
        raise ValueError("give a dataset or a list of lengths")
    elif hasattr(dataset, "column_names") and hasattr(dataset, "with_format"):  # a datasets.Dataset
        table = dataset.with_format("arrow")
        if length_column in dataset.column_names:
            array = _length_column(table[length_column], length_column)
            if input_key in dataset.column_names:
                _check_length_column(array, _arrow_token_counts(table[input_key]), length_column, input_key)
        elif input_key in dataset.column_names:
            array = _arrow_token_counts(table[input_key])
        else:
            raise BatchError(f"the dataset has neither a {length_column!r} column nor {input_key!r}; its columns are "
                             f"{', '.join(dataset.column_names)}. Tokenize it first or pass lengths=")
    else:
        try:
            array = np.fromiter((token_count(dataset[i][input_key]) for i in range(len(dataset))), dtype=np.int64)
        except (KeyError, TypeError) as exc:
            raise BatchError(f"cannot read the length of the examples from {input_key!r} ({exc}); "
                             "pass lengths=") from None
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise BatchError(f"lengths must be a flat list of integers, got shape {array.shape} dtype {array.dtype}")
    array = array.astype(np.int64)
    if dataset is not None and lengths is not None and len(array) != len(dataset):
        raise BatchError(f"{len(array)} lengths for a dataset of {len(dataset)} examples")
    if array.size and array.min() < 1:
        raise BatchError(f"example {int(np.argmin(array))} has no tokens; filter empty examples out of the dataset")
    return array


def _length_column(column: Any, name: str) -> np.ndarray:
    """The token counts of a dataset's length column (an Arrow column); a :class:`BatchError` naming it when it
    holds anything but integers."""
    import pyarrow as pa

    if not pa.types.is_integer(column.type) or column.null_count:
        what = "missing values" if pa.types.is_integer(column.type) else f"{column.type} values"
        raise BatchError(f"the dataset's {name!r} column (batching.length_column) holds {what}, not token counts: "
                         f"cast it (dataset.cast_column({name!r}, datasets.Value('int64'))), recompute it, or remove "
                         "it (the lengths are then read from input_ids)")
    return column.to_numpy()


def _check_length_column(claimed: np.ndarray, real: np.ndarray, name: str, input_key: str) -> None:
    """Refuse a length column that differs from the rows' own token counts (a token budget planned from it would be
    exceeded), naming the first wrong row."""
    wrong = np.flatnonzero(claimed != real)
    if wrong.size:
        row = int(wrong[0])
        raise BatchError(f"the dataset's {name!r} column (batching.length_column) says example {row} has "
                         f"{int(claimed[row])} tokens, but its {input_key} hold {int(real[row])} ({wrong.size} such "
                         "example(s)): token budgets planned from it would be exceeded. Recompute it "
                         f"(dataset.map(lambda row: {{{name!r}: len(row[{input_key!r}])}})) or remove it (the lengths "
                         f"are then read from {input_key})")


def _one_row(ids: Any) -> bool:
    """Whether ``ids`` is a ``[1, L]`` array or tensor: one text of ``L`` tokens (see :func:`holds_several_texts`)."""
    return isinstance(ids, (np.ndarray, torch.Tensor)) and ids.ndim == 2 and ids.shape[0] == 1


def _text_length(ids: Any) -> int:
    return int(ids.shape[1]) if _one_row(ids) else len(ids)


def token_count(ids: Any) -> int:
    """Tokens of one example's ``input_ids``: its length, or the sum of its texts' lengths when it holds several
    (:func:`~padfree_plugins.packing.collator.holds_several_texts`, the collators' test)."""
    return sum(_text_length(text) for text in ids) if holds_several_texts(ids) else _text_length(ids)


def column_lengths(dataset: Any, keys: Sequence[str], rows: str) -> dict[str, np.ndarray]:
    """The length of every row's ``keys`` (lists of token ids), int64 each: one vectorised Arrow pass for a
    ``datasets.Dataset``, one pass over the rows otherwise. A missing column is a :class:`BatchError` that says what
    the budget plans (``rows``, e.g. "DPO pairs")."""
    columns = tuple(getattr(dataset, "column_names", ()))
    missing = [key for key in keys if key not in columns]
    if missing:
        raise BatchError(f"batching.strategy: tokens plans {rows} from {', '.join(keys)}; the training dataset lacks "
                         f"{', '.join(missing)} (its columns: {', '.join(columns)})")
    if hasattr(dataset, "with_format"):
        import pyarrow.compute as pc

        table = dataset.with_format("arrow")
        return {key: pc.list_value_length(table[key]).to_numpy(zero_copy_only=False).astype(np.int64) for key in keys}
    return {key: np.fromiter((len(dataset[i][key]) for i in range(len(dataset))), dtype=np.int64, count=len(dataset))
            for key in keys}


def _arrow_token_counts(column: Any) -> np.ndarray:
    """:func:`token_count` of every row of an Arrow list column, vectorised."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(column.type.value_type) or pa.types.is_large_list(column.type.value_type)):
        return pc.list_value_length(column).to_numpy(zero_copy_only=False)
    texts = pc.list_value_length(pc.list_flatten(column)).to_numpy(zero_copy_only=False)
    rows = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
    return np.bincount(rows, weights=texts, minlength=len(column)).astype(np.int64)


# -- items: whole examples, or chunks of over-long ones ---------------------------------------------------------------


@dataclass(frozen=True)
class Items:
    """What the sampler packs: example ``example[i]``, tokens ``start[i]:stop[i]`` (whole examples unless split)."""

    example: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self.stop - self.start

    @property
    def split(self) -> bool:
        """Whether some example was cut into chunks (items are then not example indices)."""
        return len(self.example) != len(np.unique(self.example))

    def __len__(self) -> int:
        return len(self.example)

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, budget: int, on_overlong: str) -> "Items":
        over = np.flatnonzero(lengths > budget)
        whole = cls(np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64), lengths.copy())
        if not over.size:
            return whole
        if on_overlong != "split":
            i = int(over[0])
            raise BatchError(
                f"example {i} has {int(lengths[i])} tokens, more than batching.max_tokens_per_batch={budget} "
                f"({over.size} such example(s), the longest {int(lengths[over].max())} tokens). Raise "
                "max_tokens_per_batch, truncate when tokenizing (max_length / on_overlong: truncate), or set "
                "batching.on_overlong_example: split to train them as chunks")
        chunks = -(-lengths // budget)  # ceil; 1 for examples that fit
        example = np.repeat(np.arange(len(lengths)), chunks)
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)
        start = (np.arange(len(example)) - first) * budget
        stop = np.minimum(start + budget, lengths[example])
        return cls(example, start, stop)


class ChunkedDataset(Dataset):
    """``dataset`` seen through :class:`Items`: item ``i`` is example ``example[i]`` cut to ``start:stop`` along
    its per-token keys (``token_keys``); other keys are copied."""

    def __init__(self, dataset: Any, items: Items, token_keys: Sequence[str] = SPLIT_KEYS):
        self.dataset, self.items, self.token_keys = dataset, items, tuple(token_keys)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Mapping[str, Any]:
        index = int(self.items.example[i])
        example = self.dataset[index]
        start, stop = int(self.items.start[i]), int(self.items.stop[i])
        if start == 0 and stop == token_count(example["input_ids"]):
            return example
        if holds_several_texts(example["input_ids"]):
            raise BatchError(_unsplittable_message(index, token_count(example["input_ids"])))
        return {key: _cut(value, start, stop) if key in self.token_keys and value is not None else value
                for key, value in example.items()}


def _cut(value: Any, start: int, stop: int) -> Any:
    """Tokens ``start:stop`` of a per-token value (along the tokens of a ``[1, L]`` array or tensor)."""
    return value[:, start:stop] if _one_row(value) else value[start:stop]


def _unsplittable_message(index: int, length: int, budget: int | None = None, count: int = 1,
                         longest: int | None = None) -> str:
    """The error for rows holding several texts (listwise rows: one query's candidates) over the budget."""
    longest = max(length, longest or 0)
    limit = f"={budget}" if budget is not None else ""
    more = f" ({count} such rows, the longest {longest} tokens)" if count > 1 else ""
    return (f"example {index} holds several texts (a listwise row: one query's candidates, {length} tokens in all) "
            f"and is longer than batching.max_tokens_per_batch{limit}{more}. batching.on_overlong_example: split "
            "cannot split such rows (their candidates are ranked against each other, so they must stay in one "
            f"micro-batch): raise max_tokens_per_batch to at least {longest}, or use on_overlong_example: error "
            "(which refuses every over-long example) and shorten or drop the long rows")


def _split_grouped_rows(dataset: Any, items: Items, input_key: str = "input_ids") -> np.ndarray:
    """The examples that ``items`` splits into chunks and whose ``input_ids`` hold several texts (listwise rows,
    which cannot be split). Only the split examples are read; for a ``datasets.Dataset`` its column type decides
    (``list<list<int>>``), with no row read."""
    split = np.unique(items.example[items.start > 0])
    if not split.size:
        return split
    if hasattr(dataset, "column_names") and hasattr(dataset, "with_format"):  # a datasets.Dataset
        if input_key not in dataset.column_names:
            return split[:0]
        import pyarrow as pa

        kind = dataset.with_format("arrow")[:0][input_key].type

        def is_list(type_: Any) -> bool:
            return pa.types.is_list(type_) or pa.types.is_large_list(type_)

        return split if is_list(kind) and is_list(kind.value_type) else split[:0]
    return np.asarray([i for i in split.tolist() if isinstance(row := dataset[i], Mapping)
                       and holds_several_texts(row.get(input_key))], dtype=np.int64)


# -- dataset indices in the rows (for the collator's errors) -----------------------------------------------------------


class IndexedRows(Dataset):
    """A map-style dataset whose rows (dicts) carry their index in it (:data:`INDEX_KEY`)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        row = self.dataset[i]
        return {**row, INDEX_KEY: int(i)} if isinstance(row, Mapping) else row


def indexed_rows(dataset: Any) -> Any:
    """``dataset`` for a ``DataLoader`` whose collator names bad examples by their dataset index: every row it
    fetches carries its index under :data:`INDEX_KEY` (the packing collator reads it and packs nothing of it). A
    ``datasets.Dataset`` stays one (:class:`~padfree_plugins.batching.indexed_dataset.IndexedDataset`, the same tables);
    another map-style dataset is wrapped (:class:`IndexedRows`); an iterable one, which has no indices, is returned as
    it is (its errors name positions in the batch)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency of the train extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        from padfree_plugins.batching.indexed_dataset import IndexedDataset

        return dataset if isinstance(dataset, IndexedDataset) else IndexedDataset.of(dataset)
    if (isinstance(dataset, (torch.utils.data.IterableDataset, IndexedRows, ChunkedDataset))
            or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__")
            or datasets is not None and isinstance(dataset, datasets.IterableDataset)):
        return dataset
    return IndexedRows(dataset)


@dataclass
class IndexingDataloaders:
    """A trainer's ``_get_dataloader`` (every dataloader ``Trainer`` builds: training, evaluation, prediction) given
    :func:`indexed_rows` of its dataset, for a collator that names bad examples by dataset index."""

    get_dataloader: Any

    def __call__(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        return self.get_dataloader(indexed_rows(dataset), *args, **kwargs)


# -- the sampler -----------------------------------------------------------------------------------------------------


class EpochShuffle(Sampler[int]):
    """The epoch's shuffled order of ``n`` items, from ``(seed, epoch)``. It holds the epoch for the batch sampler
    (accelerate's prepared dataloader calls ``set_epoch`` on it every epoch). No ``generator`` attribute: accelerate
    would take it for a torch generator to synchronise."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def rng(self, epoch: int | None = None) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng().permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Micro-batches of at most ``max_tokens_per_batch`` tokens, balanced across ``num_replicas`` ranks.

    Deterministic for ``(seed, epoch)``; call :meth:`set_epoch` every epoch, as with ``DistributedSampler``
    (accelerate's prepared dataloader and HF ``Trainer`` do). Every item is used exactly once per epoch unless
    ``drop_last``. The plan of an epoch is computed once, on first use, and cached; ``len()`` is exact and the
    same every epoch, since HF ``Trainer`` sizes every epoch from the first: the step count is pinned from a few
    shuffles of epoch 0, every epoch's last steps are spread over exactly that many steps, and an epoch whose
    shuffle packs worse is drawn again (deterministically) until it fits.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens_per_batch: int, *, num_replicas: int = 1,
                 rank: int | None = None, window: int = 1024, seed: int = 0, drop_last: bool = False,
                 on_overlong: str = "error"):
        if max_tokens_per_batch is None or max_tokens_per_batch < 1:
            raise ConfigError(f"max_tokens_per_batch must be a positive integer, got {max_tokens_per_batch!r}")
        if num_replicas < 1 or (rank is not None and not 0 <= rank < num_replicas):
            raise ValueError(f"rank {rank} out of range for num_replicas={num_replicas}")
        self.max_tokens_per_batch, self.num_replicas, self.rank = int(max_tokens_per_batch), num_replicas, rank
        self.window, self.drop_last = window, drop_last
        self.items = Items.from_lengths(example_lengths(lengths=lengths), self.max_tokens_per_batch, on_overlong)
        self.lengths = self.items.lengths
        if len(self.items) < num_replicas:
            raise BatchError(f"{len(self.items)} example(s) cannot give each of {num_replicas} ranks a micro-batch")
        self.sampler = EpochShuffle(len(self.items), seed)
        self._plan: tuple[int, list[list[int]]] | None = None
        self._num_steps: int | None = None  # pinned from epoch 0

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def plan(self, epoch: int | None = None) -> list[list[int]]:
        """All micro-batches of ``epoch`` (default: the current one) for all ranks, step-major."""
        epoch = self.epoch if epoch is None else epoch
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        if self._num_steps is None:
            self._num_steps = self._pinned_steps()
        for attempt in range(MAX_REDRAWS):
            batches = self._make_plan(epoch, self._num_steps, attempt)
            if len(batches) == self._num_steps * self.num_replicas:
                break
        else:
            warnings.warn(f"epoch {epoch} packs into {len(batches) // self.num_replicas} steps, not the "
                          f"{self._num_steps} of every epoch: a trainer that sizes epochs from the first may miss "
                          "or lack batches; a larger max_tokens_per_batch or window packs more evenly", stacklevel=2)
        self._plan = (epoch, batches)
        return batches

    def _pinned_steps(self) -> int:
        """Every epoch's step count: the most steps a few shuffles of epoch 0 pack into (the fewest with
        ``drop_last``, which cuts every epoch to it), so that a typical shuffle fits."""
        counts = [len(self._make_plan(0, None, attempt)) // self.num_replicas for attempt in range(PIN_DRAWS)]
        return min(counts) if self.drop_last else max(counts)

    def _make_plan(self, epoch: int, num_steps: int | None, attempt: int = 0) -> list[list[int]]:
        generator = self.sampler.rng(epoch) if attempt == 0 else np.random.default_rng(
            [self.sampler.seed, epoch, attempt])
        order = generator.permutation(len(self.items))
        return plan_epoch(self.lengths, self.max_tokens_per_batch, order=order, rng=generator,
                          num_replicas=self.num_replicas, window=self.window, drop_last=self.drop_last,
                          num_steps=num_steps)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.plan()
        if self.rank is not None:
            batches = batches[self.rank :: self.num_replicas]
        return iter([list(b) for b in batches])

    def __len__(self) -> int:
        count = len(self.plan())
        return count if self.rank is None else count // self.num_replicas

    def tokens_per_step(self, epoch: int | None = None) -> np.ndarray:
        """Tokens of every micro-batch, ``[steps, num_replicas]`` (rank ``r`` in column ``r``)."""
        tokens = [int(self.lengths[b].sum()) for b in self.plan(epoch)]
        return np.asarray(tokens, dtype=np.int64).reshape(-1, self.num_replicas)

    def dataset_view(self, dataset: Any, token_keys: Sequence[str] = ()) -> Any:
        """``dataset`` itself, or a :class:`ChunkedDataset` serving the chunks of split examples. A split example
        whose ``input_ids`` hold several texts (a listwise row) is a :class:`BatchError` here, before training."""
        if not self.items.split:
            return dataset
        grouped = _split_grouped_rows(dataset, self.items)
        if grouped.size:
            full = np.zeros(int(self.items.example.max()) + 1, dtype=np.int64)
            np.maximum.at(full, self.items.example, self.items.stop)  # every example's length: its last chunk's stop
            raise BatchError(_unsplittable_message(int(grouped[0]), int(full[grouped[0]]), self.max_tokens_per_batch,
                                                  grouped.size, int(full[grouped].max())))
        return ChunkedDataset(dataset, self.items, tuple(dict.fromkeys((*SPLIT_KEYS, *token_keys))))


# -- integration -------------------------------------------------------------------------------------------------------


def collator_token_keys(collator: Any) -> tuple[str, ...]:
    """The per-token keys a (possibly wrapped) packing collator concatenates: its ``token_keys``, looked up
    through ``.collator`` / ``.packing`` wrappers (a split example is cut along them)."""
    for _ in range(4):
        if hasattr(collator, "token_keys"):
            return tuple(collator.token_keys)
        collator = getattr(collator, "collator", None) or getattr(collator, "packing", None)
    return ()


def batching_config(config: PadfreeConfig | BatchingConfig | dict | str | None) -> BatchingConfig:
    """The ``batching`` section of a config (a ``PadfreeConfig``, a path, a dict) or a ``BatchingConfig``."""
    if isinstance(config, BatchingConfig):
        return config
    return load_config(config).batching


def uses_token_budget(config: PadfreeConfig | BatchingConfig | dict | str | None) -> bool:
    """Whether ``config`` asks for token-budget batching (``batching.strategy: tokens``)."""
    return batching_config(config).strategy == "tokens"


def check_whole_micro_batches(accelerator: Any) -> None:
    """Token budgets plan whole micro-batches per rank; accelerate's ``split_batches=True`` would cut each one
    across the ranks instead (no balance, and the step count the plan pinned would no longer hold)."""
    if getattr(accelerator, "split_batches", False):
        raise ConfigError(
            "batching.strategy: tokens gives every rank whole micro-batches, but the accelerator has "
            "split_batches=True, which would cut each micro-batch across the ranks: leave split_batches off "
            "(accelerator_config), or use batching.strategy: examples"
        )


def combined_loads(tokens: Sequence[int] | np.ndarray, pixels: Sequence[int] | np.ndarray, max_tokens: int,
                   max_pixels: int) -> np.ndarray:
    """Each item's share of two budgets in token units, ``max(tokens, ⌈pixels × max_tokens / max_pixels⌉)``: a
    micro-batch whose loads sum to at most ``max_tokens`` holds at most ``max_tokens`` tokens and ``max_pixels``
    pixels (the larger share of each item counted whole: a plan within both budgets, a little looser where the two
    bind in different items)."""
    tokens, pixels = np.asarray(tokens, dtype=np.int64), np.asarray(pixels, dtype=np.int64)
    return np.maximum(tokens, -((-pixels * max_tokens) // max_pixels))


def token_budget_sampler(dataset: Any, config: PadfreeConfig | BatchingConfig | dict | str | None, *,
                         num_replicas: int = 1, rank: int | None = None, lengths: Sequence[int] | None = None,
                         seed: int | None = None) -> TokenBudgetBatchSampler:
    """A :class:`TokenBudgetBatchSampler` for ``dataset`` from the ``batching`` section of ``config``.
    ``seed`` is used when the config's ``batching.seed`` is null (default 0)."""
    cfg = batching_config(config)  # strategy: tokens without max_tokens_per_batch is a ConfigError on loading
    array = example_lengths(dataset, lengths=lengths, length_column=cfg.length_column)
    return TokenBudgetBatchSampler(array, cfg.max_tokens_per_batch, num_replicas=num_replicas, rank=rank,
                                   window=cfg.window, drop_last=cfg.drop_last, on_overlong=cfg.on_overlong_example,
                                   seed=cfg.seed if cfg.seed is not None else (seed or 0))


def token_budget_dataloader(dataset: Any, collator: Any, config: PadfreeConfig | BatchingConfig | dict | str | None,
                            *, num_replicas: int = 1, rank: int | None = None, lengths: Sequence[int] | None = None,
                            seed: int | None = None, **dataloader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` of packed micro-batches under the token budget of ``config``.

    With ``rank=None`` (default) pass it to ``accelerator.prepare``, which gives every rank its micro-batches;
    ``num_replicas`` must then be ``accelerator.num_processes``. ``dataloader_kwargs`` go to ``DataLoader``
    (``num_workers``, ``pin_memory``, …; not ``batch_size``/``shuffle``/``sampler``, which the sampler replaces).
    """
    sampler = token_budget_sampler(dataset, config, num_replicas=num_replicas, rank=rank, lengths=lengths, seed=seed)
    view = sampler.dataset_view(dataset, collator_token_keys(collator))
    return DataLoader(view, batch_sampler=sampler, collate_fn=collator, **dataloader_kwargs)


def trainer_train_dataloader(trainer: Any, config: PadfreeConfig | BatchingConfig | dict | str | None,
                             collator: Any = None, lengths: Sequence[int] | np.ndarray | None = None
                             ) -> DataLoader | None:
    """For an HF ``Trainer`` (or a subclass: TRL, sentence-transformers): its training dataloader under the token
    budget, prepared by ``trainer.accelerator``; ``None`` when ``batching.strategy`` is ``examples`` (keep the
    trainer's own). Call it from ``get_train_dataloader``. ``lengths``: every row's tokens, for rows that are not
    one ``input_ids`` (a preference pair: what its forwards compute); read from the dataset otherwise."""
    if not uses_token_budget(config):
        return None
    if trainer.train_dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset) or not hasattr(trainer.train_dataset,
                                                                                          "__len__"):
        warnings.warn("batching.strategy: tokens needs a dataset with a length (a token budget plans each epoch "
                      "from every example's length); this iterable dataset keeps the trainer's example-count "
                      "batches, still padding-free", stacklevel=2)
        return None
    args = trainer.args
    kwargs: dict[str, Any] = {"num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory}
    if args.dataloader_num_workers > 0:
        kwargs.update(persistent_workers=args.dataloader_persistent_workers,
                      prefetch_factor=args.dataloader_prefetch_factor)
    dataset = trainer.train_dataset
    if hasattr(dataset, "column_names") and hasattr(trainer, "_remove_unused_columns"):
        # lengths first (the length column, if any, is not a model input), then drop what the model does not take,
        # as Trainer's own get_train_dataloader does
        if lengths is None:
            lengths = example_lengths(dataset, length_column=batching_config(config).length_column)
        dataset = trainer._remove_unused_columns(dataset, description="training")
    if isinstance(trainer.__dict__.get("_get_dataloader"), IndexingDataloaders):  # rows named as the trainer's are
        dataset = indexed_rows(dataset)
    seed = args.data_seed if args.data_seed is not None else args.seed
    loader = token_budget_dataloader(dataset, collator or trainer.data_collator, config, lengths=lengths,
                                     num_replicas=trainer.accelerator.num_processes, seed=seed, **kwargs)
    return pass_epoch_on(trainer.accelerator.prepare(loader), loader.batch_sampler)


def pass_epoch_on(prepared: Any, batch_sampler: Any) -> Any:
    """Give accelerate's per-rank wrapper of ``batch_sampler`` (``BatchSamplerShard``, under DDP) the sampler's
    ``set_epoch``, and return ``prepared``: once HF ``Trainer`` resumes mid-epoch it wraps the shard again to skip
    batches and sets the epoch on the shard alone, so without it the sampler would replay epoch 0's plan."""
    shard = getattr(prepared, "batch_sampler", None)
    if getattr(shard, "batch_sampler", None) is batch_sampler and not hasattr(shard, "set_epoch"):
        shard.set_epoch = batch_sampler.set_epoch
    return prepared

