"""Prefix sharing for HF ``Trainer`` / TRL ``SFTTrainer``: the examples of a packed micro-batch that begin with the
same unlabelled tokens (best-of-N answers to one prompt, the turns of one conversation) hold them once.

Every comparison trains the same tiny model on the same micro-batches (``train_sampling_strategy: sequential``) padded
and packed with sharing, and checks that the packed run's attention calls did share (``record_attention_calls``); a
sibling leak in the shared attention fails the comparison.
"""

from __future__ import annotations

import contextlib
import random

import datasets
import pytest
import torch

from padfree_plugins import ConfigError
from padfree_plugins.batching.prefix_groups import PrefixGroupSampler, grouped_micro_batches, unlabelled_prompt
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.packing.prefixes import (
    EXAMPLE_SEGMENTS_KEY,
    SHARED_PREFIXES_KEY,
    WHOLE_TOKENS_KEY,
    share_unlabelled,
    unlabelled_prefixes,
    whole_examples,
)
from padfree_plugins.testing.faults import branch_sees_a_sibling_branch, completions_see_a_sibling
from tests.test_trainer import make_trainer
from tests.ties import excess_over_flips, flip_shares, recording_token_margins

trl = pytest.importorskip("trl")

STEPS = 10
#: Steps of the hybrid case (its exact mixers are slow on CPU; a state that leaks shows in the first step).
HYBRID_STEPS = 3


def best_of_n(prompts: int = 20, answers: int = 4, seed: int = 0, prompt_tokens: tuple[int, int] = (12, 30)
              ) -> list[dict]:
    """``answers`` rows per prompt, one after the other: the prompt (``prompt_tokens``: its least and most tokens;
    labels -100, ~60% of the tokens) then an answer of its own (labelled)."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(5, 128) for _ in range(rng.randrange(*prompt_tokens))]
        for _ in range(answers):
            answer = [rng.randrange(5, 128) for _ in range(rng.randrange(4, 2 * len(prompt) // 3 + 2))]
            out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def conversation_turns(conversations: int = 16, turns: int = 4, seed: int = 1) -> list[dict]:
    """A conversation split into one example per turn: example ``t`` holds turns ``0..t``, only its last turn
    labelled; consecutive examples of a conversation share every earlier turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        history: list[int] = []
        for _ in range(turns):
            question = [rng.randrange(5, 128) for _ in range(rng.randrange(3, 8))]
            answer = [rng.randrange(5, 128) for _ in range(rng.randrange(2, 6))]
            out.append({"input_ids": history + question + answer,
                        "labels": [-100] * (len(history) + len(question)) + answer})
            history = history + question + answer
    return out


def run(kind: str, rows: list[dict], packed: bool, fault=None, **overrides) -> tuple[list[dict], list, list]:
    """``STEPS`` steps on ``rows`` in order; the log history, per attention call (shared prompts, depth), and (padded)
    the token margins of the accuracy's argmax."""
    settings = dict(max_steps=STEPS, train_sampling_strategy="sequential", per_device_train_batch_size=4)
    settings.update(overrides)
    trainer, _ = make_trainer(kind, packed=False, train=datasets.Dataset.from_list(rows), **settings)
    if packed:
        from padfree_plugins import accelerate

        accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
    margins: list = []
    with record_attention_calls() as calls, (fault or contextlib.nullcontext)(), \
            (contextlib.nullcontext(margins) if packed or kind != "sft" else recording_token_margins(trainer.model)) \
            as margins:
        trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return history, [(call.shared_prompts, call.shared_depth) for call in calls], margins


def assert_same_log(got: list[dict], want: list[dict], margins: list, accumulation: int = 1) -> None:
    """Every logged value within 1e-4 of its scale; the token accuracy within what its near-ties allow
    (``accumulation``: forwards per logged step)."""
    assert len(got) == len(want) and len(want) in (STEPS, HYBRID_STEPS)
    for entry_got, entry_want in zip(got, want):
        assert set(entry_got) == set(entry_want)
        for key, value in entry_want.items():
            if key != "mean_token_accuracy":
                assert entry_got[key] == pytest.approx(value, abs=1e-4 * max(1.0, abs(value))), key
    if "mean_token_accuracy" in want[0]:
        shares = flip_shares([torch.cat(rows) for rows in margins], accumulation)
        accuracies = [[entry["mean_token_accuracy"] for entry in log] for log in (got, want)]
        assert excess_over_flips(*accuracies, shares, "mean_token_accuracy") <= 1e-6
    first, last = ([entry["loss"] for entry in half] for half in (want[:len(want) // 2], want[-(len(want) // 2):]))
    assert sum(last) < sum(first), "the reference did not train: the comparison would prove little"


CASES = {"sft": ("sft", {}), "sft-accumulation2": ("sft", dict(gradient_accumulation_steps=2)),
         "sft-lora": ("sft", dict(lora=True)), "hf": ("hf", {})}


@pytest.mark.parametrize("case", CASES)
def test_best_of_n_sft_shares_every_prompt_and_logs_the_padded_values(case):
    kind, overrides = CASES[case]
    want, _, margins = run(kind, best_of_n(), packed=False, **overrides)
    got, calls, _ = run(kind, best_of_n(), packed=True, **overrides)
    assert calls and all(shared > 0 for shared, _ in calls), "a packed forward shared no prompt"
    assert_same_log(got, want, margins, overrides.get("gradient_accumulation_steps", 1))


def test_best_of_n_sft_on_a_hybrid_shares_prompts_worth_their_chunks():
    """A gated-delta hybrid (Qwen3.5): mixers pad every run to a chunk, so prompts are shared where they save chunks
    (long prompts here); the state at a prompt's end carries into each answer."""
    rows, settings = best_of_n(prompts=4, prompt_tokens=(70, 100)), dict(architecture="qwen3_5_text",
                                                                          max_steps=HYBRID_STEPS)
    want, _, margins = run("sft", rows, packed=False, **settings)
    got, calls, _ = run("sft", rows, packed=True, **settings)
    assert calls and all(shared > 0 for shared, _ in calls), "a packed forward shared no prompt"
    assert_same_log(got, want, margins)


def test_a_conversation_split_into_turns_shares_a_tree_and_logs_the_padded_values():
    want, _, margins = run("sft", conversation_turns(), packed=False)
    got, calls, _ = run("sft", conversation_turns(), packed=True)
    assert max(depth for _, depth in calls) >= 2, "no prefix tree of two levels or more"
    assert_same_log(got, want, margins)


@pytest.mark.parametrize("fault, rows", [(completions_see_a_sibling, best_of_n),
                                         (branch_sees_a_sibling_branch, conversation_turns)])
def test_a_completion_seeing_a_sibling_fails_the_comparison(fault, rows):
    want, _, margins = run("sft", rows(), packed=False)
    got, _, _ = run("sft", rows(), packed=True, fault=fault)
    with pytest.raises(AssertionError, match="loss"):  # the first step's loss already moves by ~5e-4
        assert_same_log(got, want, margins)


def test_shared_batch_holds_only_unlabelled_prefixes_and_gives_the_examples_back_whole():
    """The shared prefix stops before the first token that predicts a label; the batch gives every example back
    whole (tokens, labels, positions, boundaries) and counts its tokens whole."""
    trainer, _ = make_trainer("hf", packed=True, train=datasets.Dataset.from_list(best_of_n(2)))
    rows = [dict(trainer.train_dataset[index]) for index in range(4)]
    collator = trainer.data_collator
    plain = collator.collator([{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows])
    prompt = sum(label == -100 for label in rows[0]["labels"])
    assert [len(prefix) for prefix in unlabelled_prefixes(plain)] == [prompt - 1] * 4  # its last token predicts
    shared = share_unlabelled(plain)
    assert shared[SHARED_PREFIXES_KEY].parents == (-1, 0, 0, 0, 0)
    assert shared["input_ids"].shape[1] == plain.num_tokens - 3 * (prompt - 1) == shared.num_tokens
    assert shared[WHOLE_TOKENS_KEY] == plain.num_tokens and shared[EXAMPLE_SEGMENTS_KEY].tolist() == [1, 2, 3, 4]
    whole = whole_examples(shared)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "seq_idx"):
        if key in plain:
            assert torch.equal(whole[key].long(), plain[key].long()), key
    assert SHARED_PREFIXES_KEY not in whole
    batch = collator(rows)
    assert SHARED_PREFIXES_KEY in batch  # the trainer's collator shares (prefix_sharing: auto)
    first_token_only = [{"input_ids": [7] + row["input_ids"][1:], "labels": row["labels"]} for row in best_of_n(4, 1)]
    assert SHARED_PREFIXES_KEY in share_unlabelled(collator.collator(first_token_only))
    assert SHARED_PREFIXES_KEY not in collator(first_token_only)  # 3 tokens saved: fewer than MIN_TOKENS_SAVED


def test_prefix_sharing_off_and_on_with_what_cannot_share():
    """``off`` shares nothing; ``on`` with NEFTune (its noise is scaled per example) is refused, nothing changed."""
    rows = datasets.Dataset.from_list(best_of_n(2))
    trainer, _ = make_trainer("sft", packed=False, train=rows)
    from padfree_plugins import accelerate

    acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "off"})
    assert SHARED_PREFIXES_KEY not in trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(4)])
    acceleration.undo()
    trainer, _ = make_trainer("sft", packed=False, train=rows, neftune_noise_alpha=5.0)
    collator = trainer.data_collator
    with pytest.raises(ConfigError, match="prefix_sharing: on with SFTTrainer: NEFTune"):
        accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
    assert trainer.data_collator is collator


# -- batching.group_prefixes ---------------------------------------------------------------------------------------


def interleaved(rows: list[dict], answers: int = 4) -> list[dict]:
    """``rows`` (``answers`` per prompt, one after the other) reordered so that no two answers of a prompt are
    neighbours: a sequential or random sampler rarely puts them in one micro-batch."""
    return [rows[start + offset] for offset in range(answers) for start in range(0, len(rows), answers)]


def test_prompt_groups_are_laid_into_whole_micro_batches():
    assert grouped_micro_batches([[0, 1, 2], [3], [4, 5], [6, 7, 8, 9, 10], [11]], 4) == \
        [[0, 1, 2, 3], [6, 7, 8, 9], [4, 5, 10, 11]]
    rows = interleaved(best_of_n())
    sampler = PrefixGroupSampler([unlabelled_prompt(row) for row in rows], batch_size=8, seed=3)
    prompts = [unlabelled_prompt(row) for row in rows]
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = sampler.micro_batches()
        assert sorted(index for batch in batches for index in batch) == list(range(len(rows)))
        assert all(len(batch) == 8 for batch in batches)
        for batch in batches:  # every prompt of a micro-batch has all its 4 answers there
            assert all(sum(prompts[i] == prompts[j] for j in batch) == 4 for i in batch)
    assert sampler.micro_batches(0) != sampler.micro_batches(1)  # groups reshuffled every epoch
    assert unlabelled_prompt(rows[0]) == tuple(rows[0]["input_ids"][:rows[0]["labels"].count(-100) - 1])
    assert unlabelled_prompt({"input_ids": [5, 6, 7], "completion_mask": [0, 0, 1]}) == (5,)
    assert unlabelled_prompt({"input_ids": [5, 6, 7]}) == ()


@pytest.mark.parametrize("kind", ["sft", "hf"])
def test_grouped_micro_batches_share_every_prompt_and_train_the_padded_run_of_the_same_batches(kind):
    """Answers of a prompt scattered over the dataset: ``batching.group_prefixes`` brings them into one micro-batch
    (8 examples: two prompts), every forward shares, and the log equals a padded run given the same sampler."""
    from padfree_plugins import accelerate

    rows = interleaved(best_of_n())
    settings = dict(max_steps=STEPS, per_device_train_batch_size=8, train=datasets.Dataset.from_list(rows))
    logs, orders = {}, {}
    for packed in (False, True):
        trainer, _ = make_trainer(kind, packed=False, **settings)
        if packed:
            accelerate(trainer, {"task": "causal_lm", "batching": {"group_prefixes": True}})
        else:  # the reference: the same micro-batches, padded
            sampler = PrefixGroupSampler([unlabelled_prompt(row) for row in rows], 8, seed=0)
            trainer._get_train_sampler = lambda *args, **kwargs: sampler
        orders[packed] = list(trainer._get_train_sampler(trainer.train_dataset))
        with record_attention_calls() as calls, (contextlib.nullcontext([]) if packed or kind != "sft"
                                                 else recording_token_margins(trainer.model)) as margins:
            trainer.train()
        logs[packed] = [entry for entry in trainer.state.log_history if "loss" in entry], calls, margins
    assert orders[True] == orders[False] != list(range(len(rows)))
    (want, _, margins), (got, calls, _) = logs[False], logs[True]
    assert calls and all(call.shared_prompts == 2 for call in calls)
    assert_same_log(got, want, margins)


def test_group_prefixes_is_off_by_default_and_refused_where_it_cannot_apply():
    from padfree_plugins import accelerate
    from padfree_plugins.config.schema import BatchingConfig
    from padfree_plugins.integrations.resume import plan_differences, plan_fingerprint

    assert BatchingConfig().group_prefixes is False
    trainer, acceleration = make_trainer("hf", packed=True)
    assert "_get_train_sampler" not in vars(trainer) and plan_fingerprint(trainer, acceleration.assembly.config) == \
        {"strategy": "examples"}
    acceleration.undo()
    acceleration = accelerate(trainer, {"task": "causal_lm", "batching": {"group_prefixes": True}})
    assert isinstance(trainer._get_train_sampler(), PrefixGroupSampler)
    grouped = plan_fingerprint(trainer, acceleration.assembly.config)
    assert "batching.group_prefixes: None -> True" in plan_differences({"strategy": "examples"}, grouped)
    assert grouped == {"strategy": "examples", "group_prefixes": True,
                                                              "seed": 0, "batch_size": 4,
                                                              "examples": len(trainer.train_dataset)}
    acceleration.undo()
    assert "_get_train_sampler" not in vars(trainer)
    with pytest.raises(ConfigError, match="group_prefixes lays whole prompt groups"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"group_prefixes": True, "strategy": "tokens",
                                                               "max_tokens_per_batch": 256}})
    from tests.test_prefix_sharing import whole_example_trainer

    own = whole_example_trainer("own loss")
    with pytest.raises(ConfigError, match="batching.group_prefixes: OwnLoss keeps"):
        accelerate(own, {"task": "causal_lm", "batching": {"group_prefixes": True}})


@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_evaluation_and_prediction_of_shared_batches_are_the_padded_ones(kind):
    """A loss-only evaluation runs the shared batch (the padded loss); prediction gives every example whole back
    (the padded run's logits at every labelled position, re-padded per example)."""
    from padfree_plugins import accelerate

    rows = datasets.Dataset.from_list(best_of_n(3))
    got = {}
    for packed in (False, True):
        trainer, _ = make_trainer(kind, packed=False, per_device_eval_batch_size=4)
        if packed:
            accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
        with record_attention_calls() as calls:
            loss = trainer.evaluate(eval_dataset=rows)["eval_loss"]
        prediction = trainer.predict(rows)
        got[packed] = loss, prediction, calls
    (want_loss, want, _), (loss, prediction, calls) = got[False], got[True]
    assert calls and all(call.shared_prompts > 0 for call in calls)  # the loss-only evaluation shared
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert prediction.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], abs=1e-5)
    labelled = torch.as_tensor(want.label_ids) != -100
    assert torch.equal(torch.as_tensor(prediction.label_ids) != -100, labelled)
    torch.testing.assert_close(torch.as_tensor(prediction.predictions)[labelled],
                               torch.as_tensor(want.predictions)[labelled], atol=1e-4, rtol=0)
