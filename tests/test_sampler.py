"""Token-budget batching: every example once per epoch, budget, balance, determinism, over-long examples, config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from padfree_plugins.batching.planning import balanced_partition, best_fit_decreasing, plan_epoch
from padfree_plugins.batching.sampler import (
    ChunkedDataset,
    Items,
    TokenBudgetBatchSampler,
    example_lengths,
    token_budget_dataloader,
)
from padfree_plugins.benchmarks.lengths import lognormal_lengths
from padfree_plugins.config.schema import BatchingConfig, load_config
from padfree_plugins.errors import BatchError, ConfigError
from tests.conftest import make_examples


def sampler_or_skip(lengths, budget, **kwargs) -> TokenBudgetBatchSampler:
    """A sampler whose first plan exists (tiny random sets can be impossible to spread over the ranks)."""
    sampler = TokenBudgetBatchSampler(lengths, budget, **kwargs)
    try:
        sampler.plan()
    except ValueError as error:
        assert "cannot be spread" in str(error)
        assume(False)
    return sampler


length_sets = st.lists(st.integers(1, 120), min_size=1, max_size=250)


# -- every example exactly once ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=length_sets, slack=st.integers(0, 300), num_replicas=st.sampled_from([1, 2, 3, 8]),
       window=st.integers(1, 64), seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_every_example_once_within_budget(lengths, slack, num_replicas, window, seed, epoch):
    assume(len(lengths) >= num_replicas)
    budget = max(lengths) + slack
    sampler = sampler_or_skip(lengths, budget, num_replicas=num_replicas, window=window, seed=seed)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert len(batches) == len(sampler) and len(batches) % num_replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(b and sum(lengths[i] for i in b) <= budget for b in batches)

    per_rank = []
    for rank in range(num_replicas):
        shard = TokenBudgetBatchSampler(lengths, budget, num_replicas=num_replicas, rank=rank, window=window,
                                        seed=seed)
        shard.set_epoch(epoch)
        per_rank.append(list(shard))
        assert len(per_rank[-1]) == len(shard) == len(batches) // num_replicas
        assert per_rank[-1] == batches[rank::num_replicas]
    union = [i for rank in per_rank for b in rank for i in b]
    assert sorted(union) == list(range(len(lengths)))  # union of ranks == all examples, no duplicates


@settings(max_examples=30, deadline=None)
@given(lengths=length_sets, num_replicas=st.sampled_from([2, 3, 4]), seed=st.integers(0, 5))
def test_accelerate_shards_give_every_example_once(lengths, num_replicas, seed):
    """Through accelerate's own BatchSamplerShard (what accelerator.prepare wraps the sampler in)."""
    from accelerate.data_loader import BatchSamplerShard

    assume(len(lengths) >= num_replicas)
    sampler = sampler_or_skip(lengths, 2 * max(lengths), num_replicas=num_replicas, seed=seed)
    plan = sampler.plan()
    shards = [list(BatchSamplerShard(sampler, num_replicas, rank)) for rank in range(num_replicas)]
    for rank, shard in enumerate(shards):
        assert shard == plan[rank::num_replicas]  # rank r trains micro-batch s*N + r: no padding, no repeats
        assert len(BatchSamplerShard(sampler, num_replicas, rank)) == len(shard)
    assert sorted(i for shard in shards for b in shard for i in b) == list(range(len(lengths)))


def test_drop_last_keeps_only_full_steps():
    lengths = lognormal_lengths(3000, 120, 0.6, 8, 1024, 0)
    sampler = TokenBudgetBatchSampler(lengths, 4096, num_replicas=4, drop_last=True)
    tokens = sampler.tokens_per_step()
    assert tokens.min() >= 0.95 * 4096
    used = [i for b in sampler for i in b]
    assert len(used) == len(set(used)) and len(used) > 0.95 * len(lengths)


# -- determinism and cheap, exact len ------------------------------------------------------------------------------


def test_same_seed_and_epoch_same_plan_other_epochs_reshuffle():
    lengths = lognormal_lengths(2000, 120, 0.6, 8, 1024, 1)
    a = TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, seed=7)
    b = TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, seed=7)
    other_seed = TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, seed=8)
    for epoch in (0, 1, 2):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)
    assert a.plan(0) != a.plan(1) != a.plan(2)
    assert a.plan(0) != other_seed.plan(0)
    first = [i for batch in a.plan(0) for i in batch]
    assert first != [i for batch in a.plan(1) for i in batch]  # a different order, not only other batches


def test_len_is_exact_cached_and_the_same_every_epoch():
    lengths = lognormal_lengths(5000, 120, 0.6, 8, 1024, 2)
    sampler = TokenBudgetBatchSampler(lengths, 4096, num_replicas=8)
    plan = sampler.plan()
    assert sampler.plan() is plan  # computed once per epoch
    counts = set()
    for epoch in range(4):
        sampler.set_epoch(epoch)
        counts.add(len(sampler))
        assert len(sampler) == len(list(sampler))
    assert counts == {len(plan)}
    assert len(plan) // 8 == int(np.ceil(sum(lengths) / (8 * 4096)))  # as few steps as the tokens allow


def test_set_epoch_through_accelerate_reaches_the_sampler():
    """accelerate's prepared dataloader sets the epoch on ``batch_sampler.sampler`` when it wraps the sampler."""
    from accelerate.data_loader import prepare_data_loader

    lengths = lognormal_lengths(400, 60, 0.6, 4, 400, 3)
    examples = make_examples(lengths)
    loader = token_budget_dataloader(examples, lambda rows: rows, {"batching": {"strategy": "tokens",
                                     "max_tokens_per_batch": 1024}}, num_replicas=2)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=1, put_on_device=False)
    sampler = loader.batch_sampler
    prepared.set_epoch(3)
    assert sampler.epoch == 3
    assert len(prepared) == len(sampler) // 2


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_epoch_has_the_first_epochs_steps_and_every_example(drop_last):
    """HF Trainer sizes every epoch from the first: a shuffle that packs into more steps would leave examples out
    silently (48 examples, budget 192, window 16: some shuffles need 7 steps, others 6)."""
    rng = np.random.default_rng(79)
    rng.integers(30, 200), rng.choice([64, 128, 192])  # (how the audit that found it drew its case)
    lengths = np.clip(np.round(np.exp(rng.normal(np.log(20), 0.6, 48))), 2, 192).astype(int)
    sampler = TokenBudgetBatchSampler(lengths, 192, window=16, drop_last=drop_last)
    natural = {len(sampler._make_plan(epoch, None)) for epoch in range(12)}
    assert len(natural) > 1  # the shuffles really differ in how many steps they pack into
    steps = set()
    for epoch in range(12):
        sampler.set_epoch(epoch)
        steps.add(len(sampler))
        used = sorted(i for batch in sampler for i in batch)
        assert drop_last or used == list(range(48)), epoch
        assert all(lengths[batch].sum() <= 192 for batch in sampler)
    assert len(steps) == 1


def test_accelerates_per_rank_wrapper_passes_the_epoch_on(monkeypatch):
    """Under DDP, accelerate wraps the batch sampler (BatchSamplerShard, no set_epoch); once HF Trainer resumes
    mid-epoch it wraps that again and reaches only the shard wrapper: the epoch must get through it."""
    import types

    from accelerate.data_loader import BatchSamplerShard

    from padfree_plugins.batching.sampler import trainer_train_dataloader

    prepared = {}

    def prepare(loader):
        prepared["loader"] = types.SimpleNamespace(batch_sampler=BatchSamplerShard(loader.batch_sampler, 2, 0))
        return prepared["loader"]

    args = types.SimpleNamespace(dataloader_num_workers=0, dataloader_pin_memory=False, data_seed=None, seed=0)
    trainer = types.SimpleNamespace(train_dataset=make_examples(lognormal_lengths(40, 20, 0.6, 4, 100, 1)), args=args,
                                    accelerator=types.SimpleNamespace(num_processes=2, prepare=prepare))
    loader = trainer_train_dataloader(trainer, {"batching": {"strategy": "tokens", "max_tokens_per_batch": 128}},
                                      collator=lambda rows: rows)
    loader.batch_sampler.set_epoch(4)
    assert loader.batch_sampler.batch_sampler.epoch == 4


def test_an_iterable_dataset_keeps_example_count_batches():
    import types

    from torch.utils.data import IterableDataset

    from padfree_plugins.batching.sampler import trainer_train_dataloader

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(make_examples([3, 4]))

    trainer = types.SimpleNamespace(train_dataset=Stream())
    with pytest.warns(UserWarning, match="keeps the trainer's example-count batches"):
        assert trainer_train_dataloader(trainer, {"batching": {"strategy": "tokens",
                                                               "max_tokens_per_batch": 64}}) is None


# -- balance -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_replicas", [2, 8])
@pytest.mark.parametrize("budget", [4096, 16384])
def test_rank_token_spread_within_5_percent(num_replicas, budget):
    lengths = lognormal_lengths(20000, 120, 0.6, 8, 2048, 0)  # lognormal, median 120, sigma 0.6
    sampler = TokenBudgetBatchSampler(lengths, budget, num_replicas=num_replicas)
    for epoch in (0, 1):
        tokens = sampler.tokens_per_step(epoch)
        spread = tokens.max(axis=1) / tokens.min(axis=1)
        assert spread.max() <= 1.05, (epoch, spread.max())
        assert tokens.sum() == sum(lengths)
        assert tokens.mean() >= 0.97 * budget  # and the budget is used


def test_packing_helpers():
    lengths = [5, 4, 3, 3, 2, 1]
    bins = best_fit_decreasing(list(range(6)), lengths, 6)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 6 for b in bins) and len(bins) == 3
    natural = plan_epoch(lengths, 6, order=range(6), rng=np.random.default_rng(0), num_replicas=1)
    stretched = plan_epoch(lengths, 6, order=range(6), rng=np.random.default_rng(0), num_replicas=1, num_steps=5)
    assert len(natural) == 3 and len(stretched) == 5  # the tail spread over the steps asked for
    assert sorted(i for b in stretched for i in b) == list(range(6))
    parts = balanced_partition(list(range(6)), lengths, 2, 10)
    assert sorted(sum(lengths[i] for i in p) for p in parts) == [9, 9]
    assert balanced_partition(list(range(6)), lengths, 2, 8) is None


# -- over-long examples --------------------------------------------------------------------------------------------


def test_overlong_example_is_a_clear_error():
    with pytest.raises(BatchError) as info:
        TokenBudgetBatchSampler([10, 300, 20, 500], 256)
    message = str(info.value)
    for fragment in ("example 1 has 300 tokens", "max_tokens_per_batch=256", "2 such example(s)", "longest 500",
                     "on_overlong_example: split"):
        assert fragment in message, (fragment, message)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=60), budget=st.integers(1, 64))
def test_split_covers_every_token_once(lengths, budget):
    items = Items.from_lengths(np.asarray(lengths), budget, "split")
    assert (items.lengths >= 1).all() and (items.lengths <= budget).all()
    for example, length in enumerate(lengths):
        chunks = np.flatnonzero(items.example == example)
        assert items.start[chunks[0]] == 0 and items.stop[chunks[-1]] == length
        assert (items.start[chunks[1:]] == items.stop[chunks[:-1]]).all()  # contiguous, in order


def test_split_examples_train_as_independent_chunks():
    from padfree_plugins.packing.collator import PackingCollator

    lengths = [30, 250, 12, 100, 7]
    examples = make_examples(lengths, seed=4)
    for ex in examples:
        ex["labels"] = list(ex["input_ids"])
        ex["score"] = 1.5
    config = {"batching": {"strategy": "tokens", "max_tokens_per_batch": 64, "on_overlong_example": "split"}}
    collator = PackingCollator(token_keys=("labels",), masked_first_keys=("labels",))
    loader = token_budget_dataloader(examples, collator, config)
    assert isinstance(loader.dataset, ChunkedDataset) and len(loader.dataset) == 1 + 4 + 1 + 2 + 1
    total, pieces = 0, []
    for batch in loader:
        assert batch.num_tokens <= 64
        total += batch.num_tokens
        cu = batch["cu_seq_lens_q"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            pieces.append(batch["input_ids"][0, a:b].tolist())
            assert batch["position_ids"][0, a].item() == 0  # positions restart in every chunk
            assert batch["labels"][0, a].item() == -100
    assert total == sum(lengths)
    view = loader.dataset
    assert sorted(map(tuple, pieces)) == sorted(tuple(view[i]["input_ids"]) for i in range(len(view)))
    for example, ex in enumerate(examples):  # every example is the concatenation of its chunks, in order
        chunks = [view[int(i)]["input_ids"] for i in np.flatnonzero(view.items.example == example)]
        assert sum(chunks, []) == ex["input_ids"]
    chunk = view[2]  # example 1, tokens 64:128
    assert chunk["input_ids"] == examples[1]["input_ids"][64:128] and chunk["labels"] == examples[1]["labels"][64:128]
    assert chunk["score"] == 1.5
    assert view[0] is examples[0]  # whole examples are served as they are


# -- lengths and config ----------------------------------------------------------------------------------------------


def test_lengths_from_list_column_input_ids_and_rows():
    import datasets

    ids = [[1, 2, 3], [4], [5, 6]]
    rows = [{"input_ids": x} for x in ids]
    assert example_lengths(lengths=[3, 1, 2]).tolist() == [3, 1, 2]
    assert example_lengths(rows).tolist() == [3, 1, 2]
    table = datasets.Dataset.from_dict({"input_ids": ids})
    assert example_lengths(table).tolist() == [3, 1, 2]
    assert example_lengths(table.select([2, 0])).tolist() == [2, 3]  # respects the indices mapping
    with_column = table.add_column("length", [3, 1, 2])
    assert example_lengths(with_column).tolist() == [3, 1, 2]  # the column, checked against input_ids
    with pytest.raises(BatchError, match="'length' column .* says example 0 has 30 tokens, but its input_ids hold 3"):
        example_lengths(table.add_column("length", [30, 1, 2]))
    with pytest.raises(BatchError, match="2 lengths for a dataset of 3"):
        example_lengths(rows, lengths=[1, 2])
    with pytest.raises(BatchError, match="example 1 has no tokens"):
        example_lengths(lengths=[3, 0])
    with pytest.raises(BatchError, match="neither a 'length' column nor 'input_ids'"):
        example_lengths(datasets.Dataset.from_dict({"text": ["a"]}))


def test_grouped_rows_count_every_candidates_tokens():
    """A listwise reranker row holds a query's candidates (``input_ids`` a list of token lists): its cost is their
    tokens, not their number (a budget of 64 gave micro-batches of 1899 tokens); such rows cannot be split."""
    import datasets

    rows = [{"input_ids": [[1, 2, 3], [4, 5]], "labels": [1, 0]},
            {"input_ids": [[6], [7, 8], [9]], "labels": [1, 0, 0]}]
    assert example_lengths(rows).tolist() == [5, 4]
    assert example_lengths(datasets.Dataset.from_list(rows)).tolist() == [5, 4]
    assert example_lengths(datasets.Dataset.from_list(rows).select([1, 0])).tolist() == [4, 5]
    tensors = [{"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}, {"input_ids": _object_array([[1, 2], [3]])},
               {"input_ids": [torch.tensor([1, 2]), torch.tensor([3])]}, {"input_ids": torch.tensor([[1, 2, 3, 4]])}]
    assert example_lengths(tensors).tolist() == [6, 3, 3, 4]  # the last, [1, L], is one text of 4 tokens


def _object_array(items):
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


@pytest.mark.parametrize("arrow", [False, True])
def test_grouped_rows_over_budget_cannot_be_split_refused_before_training(arrow):
    """``on_overlong_example: split`` cannot cut a listwise row (its candidates form one group): refused when the
    dataloader is built (the trainer's get_train_dataloader), not when training reaches the row."""
    import datasets

    rows = [{"input_ids": [[1, 2], [4, 5]], "labels": [1, 0]},
            {"input_ids": [[6, 7, 8, 9], [7, 8], [9]], "labels": [1, 0, 0]},
            {"input_ids": [[1, 2, 3], [2, 3, 4, 5, 6]], "labels": [1, 0]}]
    dataset = datasets.Dataset.from_list(rows) if arrow else rows
    config = {"batching": {"strategy": "tokens", "max_tokens_per_batch": 6, "on_overlong_example": "split"}}
    with pytest.raises(BatchError) as info:
        token_budget_dataloader(dataset, lambda batch: batch, config)
    message = str(info.value)
    assert "example 1 holds several texts" in message and "7 tokens in all" in message
    assert "max_tokens_per_batch=6 (2 such rows, the longest 8 tokens)" in message
    assert "cannot split such rows" in message and "at least 8" in message and "on_overlong_example: error" in message
    # within the budget, listwise rows are served whole and single-text examples beside them are still split
    loader = token_budget_dataloader(dataset, lambda batch: batch, {"batching": {**config["batching"],
                                                                                 "max_tokens_per_batch": 8}})
    assert sorted(len(row["input_ids"]) for batch in loader for row in batch) == [2, 2, 3]  # candidates per row
    loader = token_budget_dataloader(rows[:1] + [{"input_ids": list(range(9))}], lambda batch: batch, config)
    assert len(loader.dataset) == 3
    # a ChunkedDataset used directly still refuses the row when it is read
    view = ChunkedDataset(rows, Items.from_lengths(example_lengths(rows), 6, "split"))
    with pytest.raises(BatchError, match="example 1 holds several texts"):
        view[1]


def test_split_cuts_one_row_tensors_along_their_tokens():
    """A ``[1, L]`` tensor is one text of ``L`` tokens (as the collator reads it): split along its tokens."""
    rows = [{"input_ids": torch.arange(10).reshape(1, 10), "labels": torch.arange(10).reshape(1, 10)}]
    view = ChunkedDataset(rows, Items.from_lengths(example_lengths(rows), 4, "split"))
    assert [view[i]["input_ids"].tolist() for i in range(len(view))] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    assert view[2]["labels"].tolist() == [[8, 9]]


def test_batching_config_section():
    config = load_config("configs/token_budget.yaml")
    assert config.batching.strategy == "tokens" and config.batching.max_tokens_per_batch == 4096
    assert load_config(None).batching == BatchingConfig()
    with pytest.raises(ConfigError, match="Did you mean 'max_tokens_per_batch'"):
        load_config({"batching": {"max_token_per_batch": 10}})
    with pytest.raises(ConfigError, match="Did you mean 'tokens'"):
        load_config({"batching": {"strategy": "token"}})
    with pytest.raises(ConfigError, match="max_tokens_per_batch must be at least 1"):
        load_config({"batching": {"max_tokens_per_batch": 0}})
    with pytest.raises(ConfigError, match="on_overlong_example must be one of 'error', 'split'"):
        load_config({"batching": {"on_overlong_example": "truncate"}})
    with pytest.raises(ConfigError, match="max_tokens_per_batch is not set"):
        load_config({"batching": {"strategy": "tokens"}})


# -- benchmark ---------------------------------------------------------------------------------------------------


def test_bench_batching_command_meets_the_balance_target():
    import json

    from typer.testing import CliRunner

    from padfree_plugins.cli.app import app

    result = CliRunner().invoke(app, ["bench", "batching", "--examples", "3000", "--time-steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    token_rows = [r for r in report["balance"] if r["batching"].startswith("tokens")]
    example_rows = [r for r in report["balance"] if r["batching"].startswith("examples")]
    assert {(r["law"], r["ranks"]) for r in token_rows} == {(law, n) for law in ("lognormal", "mix", "dpo-pairs") for n in (2, 8)}
    for r in token_rows:
        assert r["spread_max"] <= 1.05 and r["idle"] < 0.01, r
    assert all(r["spread_mean"] > 1.05 for r in example_rows)  # what token budgets fix
    assert {r["ranks"] for r in report["throughput"]} == {2, 8} and set(report["gain"]) == {"2", "8"}


def test_column_lengths_reads_list_lengths_and_names_a_missing_column():
    import datasets

    from padfree_plugins.batching.sampler import column_lengths

    rows = datasets.Dataset.from_list([{"prompt_ids": [1, 2], "chosen_ids": [3]}, {"prompt_ids": [4], "chosen_ids": []}])
    got = column_lengths(rows, ("prompt_ids", "chosen_ids"), "DPO pairs")
    assert got["prompt_ids"].tolist() == [2, 1] and got["chosen_ids"].tolist() == [1, 0]
    with pytest.raises(BatchError, match="plans DPO pairs from prompt_ids, rejected_ids; the training dataset lacks "
                                         "rejected_ids"):
        column_lengths(rows, ("prompt_ids", "rejected_ids"), "DPO pairs")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 100), st.integers(0, 5000)), min_size=2, max_size=60),
       st.integers(100, 300), st.integers(5000, 20000), st.integers(1, 3))
def test_combined_loads_keep_both_budgets(items, max_tokens, max_pixels, ranks):
    """Planned by their combined loads, micro-batches hold at most ``max_tokens`` tokens and ``max_pixels`` pixels,
    every item once; an item's load is its larger share, never less than its tokens."""
    from padfree_plugins.batching.sampler import combined_loads

    tokens, pixels = np.array([t for t, _ in items]), np.array([p for _, p in items])
    loads = combined_loads(tokens, pixels, max_tokens, max_pixels)
    assert (loads >= tokens).all() and (loads * max_pixels >= pixels * max_tokens).all()
    try:
        plan = plan_epoch(loads, max_tokens, order=np.arange(len(items)), rng=np.random.default_rng(0),
                          num_replicas=ranks)
    except ValueError as error:  # too few items to give every rank a micro-batch in every step
        assume("cannot be spread" not in str(error) and "cannot give each" not in str(error))
        raise
    assert sorted(i for batch in plan for i in batch) == list(range(len(items)))
    for batch in plan:
        assert tokens[batch].sum() <= max_tokens and pixels[batch].sum() <= max_pixels
