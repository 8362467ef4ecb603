"""``batching.strategy: tokens`` for TRL's ``DPOTrainer`` and ``KTOTrainer``: micro-batches of whole rows
up to the budget, a row counted as its forwards compute it (DPO: prompt + chosen and prompt + rejected, the prompt
once when shared; KTO: prompt + completion and prompt + its KL completion, as TRL builds it into the row). Training
equals TRL's padded run on the very same micro-batches (DPO on 2 processes too); every pair is used once per epoch,
no micro-batch goes over the budget; a row longer than the budget is refused at ``accelerate()``."""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import pytest
import torch

from padfree_plugins import BatchError, ConfigError, accelerate
from padfree_plugins.batching.sampler import trainer_train_dataloader
from padfree_plugins.integrations import trl_dpo
from tests.test_trl_preference import assert_same_run, pairs, policy, tokenizer, trained_reference, unpaired

trl = pytest.importorskip("trl")

BUDGET = 160
STEPS = 20
#: Plain SGD at a constant rate for the 2-process comparison: Adam would turn float-level gradient differences (the
#: ranks' all-reduce order) into weight differences up to its learning rate.
SGD = dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_steps=8)


#: The trainers' arguments (those of tests/test_trl_preference.py).
OPTIONS = dict(per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[],
               seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True)


def preference_trainer(kind: str, out: str, **settings):
    """A DPO trainer on :func:`pairs` or a KTO trainer on :func:`unpaired`, with a reference model, padded."""
    model = policy()
    trainer_class, config_class, data = ((trl.DPOTrainer, trl.DPOConfig, pairs()) if kind == "dpo"
                                         else (trl.KTOTrainer, trl.KTOConfig, unpaired()))
    return trainer_class(model=model, ref_model=copy.deepcopy(model).eval(),
                         args=config_class(output_dir=out, **{**OPTIONS, **settings}), train_dataset=data,
                         processing_class=copy.deepcopy(tokenizer()))


def dpo_trainer(out: str, **settings):
    return preference_trainer("dpo", out, **settings)


def budget_config(sharing: str = "auto") -> dict:
    return {"task": "causal_lm", "prefix_sharing": sharing,
            "batching": {"strategy": "tokens", "max_tokens_per_batch": BUDGET}}


def planned_like(trainer, shared: bool):
    """``trainer`` (padded, not accelerated) fed the token-budget micro-batches the accelerated run plans."""
    config = budget_config()
    lengths = trl_dpo.pair_lengths(trainer.train_dataset, trainer.args.max_length, shared)
    trainer.get_train_dataloader = lambda: trainer_train_dataloader(trainer, config, trainer.data_collator,
                                                                    lengths=lengths)
    return trainer


@pytest.mark.parametrize("sharing", ["auto", "off"])
def test_token_budget_dpo_trains_as_trls_padded_run_on_the_same_micro_batches(sharing, packed_calls):
    """20 steps of micro-batches of whole pairs (as many as fit 160 tokens): every logged value within 1e-4 of TRL's
    padded run on the same micro-batches (DPO's loss is a mean over the pairs of a micro-batch, as TRL defines it:
    a pair weighs more in a micro-batch of few pairs, padded or not)."""
    with tempfile.TemporaryDirectory() as out:
        reference = planned_like(dpo_trainer(out), shared=sharing == "auto")
        want = trained_reference(reference)
        trainer = dpo_trainer(out)
        accelerate(trainer, budget_config(sharing))
        trainer.train()
    assert packed_calls and all(packed_calls)
    assert_same_run(trainer.state.log_history, want)


def micro_batches(trainer) -> list[dict]:
    return list(trainer.get_train_dataloader())


def test_every_pair_once_an_epoch_and_no_micro_batch_over_the_budget():
    """Prompts not shared, so a micro-batch's tokens are exactly its padded rows' real tokens (TRL's mask): each at
    most the budget, every pair in exactly one micro-batch of the epoch, more than one size of micro-batch."""
    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(out)
        accelerate(trainer, budget_config("off"))
        batches = micro_batches(trainer)
    tokens = [int(batch["attention_mask"].sum()) for batch in batches]
    assert max(tokens) <= BUDGET, tokens
    sizes = [batch["input_ids"].shape[0] // 2 for batch in batches]  # chosen rows, then rejected rows
    assert sum(sizes) == len(pairs()) and len(set(sizes)) > 1, sizes
    sampler = trainer.get_train_dataloader().batch_sampler
    seen = sorted(index for batch in sampler for index in batch)
    assert seen == list(range(len(pairs())))


def test_a_budget_that_counts_half_a_pair_is_caught(monkeypatch):
    """The deliberate fault: the budget counts only prompt + chosen. Micro-batches then go over the budget, and the
    test above fails."""
    original = trl_dpo.pair_lengths

    def chosen_only(dataset, max_length, shared, chunk=1):
        return original(dataset, max_length, shared, chunk) // 2

    monkeypatch.setattr(trl_dpo, "pair_lengths", chosen_only)
    with pytest.raises(AssertionError):
        test_every_pair_once_an_epoch_and_no_micro_batch_over_the_budget()


@pytest.mark.parametrize("case", ["pair over the budget", "split"])
def test_bad_budgets_are_refused_at_accelerate_and_leave_the_trainer_alone(case):
    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(out)
        config = budget_config()
        if case == "split":
            config["batching"]["on_overlong_example"] = "split"
            error, message = ConfigError, "cannot cut DPOTrainer's rows"
        else:
            config["batching"]["max_tokens_per_batch"] = 20
            error, message = BatchError, "more than batching.max_tokens_per_batch=20 .* a row is never split"
        with pytest.raises(error, match=message):
            accelerate(trainer, config)
        assert "get_train_dataloader" not in vars(trainer)
        assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"


def logged(trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


#: The 2-process tests and the kind of run each compares.
LAUNCHED = {"test_two_processes_train_as_one_on_the_same_global_batches": "dpo",
            "test_two_processes_of_kto_train_as_trls_padded_run_on_the_same_micro_batches": "kto"}


def launched(request, tmp_path_factory, kind: str) -> dict:
    """``kind``'s run, from one 2-process launch (tests/token_budget_preference_run.py) of every kind this session
    selected, one after the other (once per session: tests/shared_launch.py)."""
    from tests.shared_launch import launch_once, selected
    from tests.test_distributed import ROOT, free_port, run_group

    kinds = selected(request, lambda item: LAUNCHED.get(item.originalname))
    assert kind in kinds

    def run(out, kinds):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
               "DS_ACCELERATOR": "cpu"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(ROOT / "tests" / "token_budget_preference_run.py"), ",".join(kinds),
                   str(out)]
        return run_group(command, env, timeout=180 + 120 * len(kinds), results=[out])

    returncode, output, runs = launch_once(request, tmp_path_factory, "preference", kinds, run)
    assert returncode == 0 and runs is not None, output[-6000:]
    return runs[kind] if len(kinds) > 1 else runs


def test_two_processes_train_as_one_on_the_same_global_batches(request, tmp_path_factory, tmp_path):
    """2 processes (DDP, gloo), each its rank's micro-batches of the plan, against one padded process that trains
    both micro-batches of every step with gradient accumulation 2, in the plan's order (the DPO loss is a mean over
    a micro-batch's pairs: DDP averages the ranks' gradients, accumulation averages the micro-batches'): losses,
    reward margins and final weights within 1e-5."""
    from padfree_plugins.batching.sampler import token_budget_dataloader

    run = launched(request, tmp_path_factory, "dpo")
    reference = dpo_trainer(str(tmp_path / "reference"), gradient_accumulation_steps=2, **SGD)
    initial = {name: p.detach().clone() for name, p in reference.model.named_parameters()}
    lengths = trl_dpo.pair_lengths(reference.train_dataset, reference.args.max_length, True)
    dataset = reference._remove_unused_columns(reference.train_dataset, description="training")
    reference.get_train_dataloader = lambda: token_budget_dataloader(
        dataset, reference.data_collator, budget_config(), num_replicas=2, lengths=lengths, seed=0)
    reference.train()
    losses = max(abs(a - b) for a, b in zip(run["losses"], logged(reference)))
    margins = max(abs(a - b) for a, b in zip(run["margins"], logged(reference, "rewards/margins")))
    weights = max((run["state"][k] - p.detach()).abs().max().item() for k, p in reference.model.named_parameters())
    moved = max((p.detach() - initial[k]).abs().max().item() for k, p in reference.model.named_parameters())
    print(f"losses {losses:.1e}, margins {margins:.1e}, weights {weights:.1e} (moved {moved:.1e})")
    assert len(run["losses"]) == len(logged(reference)) == SGD["max_steps"]
    assert losses < 1e-5 and margins < 1e-5 and weights < 1e-5
    assert moved > 1e-3


def test_token_budget_kto_trains_as_trls_padded_run_on_the_same_micro_batches(packed_calls):
    """KTO with its KL term: 20 steps of micro-batches of whole rows up to 160 tokens (each row's completion and KL
    completion counted), every logged value within 1e-4 of TRL's padded run on the same micro-batches; no
    micro-batch's two calls together over the budget."""
    from padfree_plugins.integrations import trl_kto

    with tempfile.TemporaryDirectory() as out:
        reference = preference_trainer("kto", out)
        assert reference.calculate_KL
        lengths = trl_kto.kto_row_lengths(reference.train_dataset, reference.args.max_length, True)
        reference.get_train_dataloader = lambda: trainer_train_dataloader(reference, budget_config(),
                                                                          reference.data_collator, lengths=lengths)
        reference.train()
        trainer = preference_trainer("kto", out)
        accelerate(trainer, budget_config())
        batches = list(trainer.get_train_dataloader())
        trainer.train()
    tokens = [int(batch["attention_mask"].sum() + batch["KL_attention_mask"].sum()) for batch in batches]
    assert max(tokens) <= BUDGET and len({batch["input_ids"].shape[0] for batch in batches}) > 1, tokens
    # a call of one row has no padding, and runs as TRL's own (packing it would change nothing); the others pack
    assert sum(packed_calls) > len(packed_calls) / 2, packed_calls
    assert_same_run(trainer.state.log_history, reference.state.log_history)


def test_a_kto_dataset_too_small_for_its_kl_term_is_refused_under_a_budget():
    """One row: its KL completion would be its own (TRL gives each row another row's completion), so a budget of it
    is a ConfigError at accelerate() that says why, the trainer untouched."""
    with tempfile.TemporaryDirectory() as out:
        trainer = preference_trainer("kto", out)
        trainer.train_dataset = trainer.train_dataset.select([0])
        assert trainer.calculate_KL
        with pytest.raises(ConfigError, match="dataset of 1 row.* too small for its KL term"):
            accelerate(trainer, budget_config())
        assert "get_train_dataloader" not in vars(trainer)


def test_two_processes_of_kto_train_as_trls_padded_run_on_the_same_micro_batches(request, tmp_path_factory):
    """KTO with its KL term on 2 processes (DDP, gloo) under a budget: TRL's padded KTO on the same 2 processes, fed
    the very same micro-batches, gives the same losses, reward margins and final weights (1e-5). KTO's KL term is
    gathered across the ranks (TRL's), which one process with accumulation would not reproduce."""
    run = launched(request, tmp_path_factory, "kto")
    want = run["reference"]
    losses = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    margins = max(abs(a - b) for a, b in zip(run["margins"], want["margins"]))
    weights = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    print(f"losses {losses:.1e}, margins {margins:.1e}, weights {weights:.1e}")
    assert len(run["losses"]) == len(want["losses"]) == SGD["max_steps"]
    assert losses < 1e-5 and margins < 1e-5 and weights < 1e-5
    assert max(want["losses"]) - min(want["losses"]) > 1e-3, "the reference did not train"
