"""TRL ``RewardTrainer`` padding-free: the same loss curve, metrics and evaluation as TRL's padded run.

With ``pad_token`` set to the EOS that TRL appends to every text, the decoder head skips that trailing pad-id token
in padded training, and the packed head does the same (``heads._last_not_pad``).
"""

from __future__ import annotations

import copy
import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from padfree_plugins import AttentionBackend, ConfigError, PadfreeError, PluginHost, accelerate, hookimpl, patch_of
from padfree_plugins.contract.declarations import FEATURES
from padfree_plugins.integrations.trl_reward import PreferenceCollator, pair_prefixes
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.modeling.attention.backends import exact_varlen
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY
from padfree_plugins.testing.faults import completion_positions_restart, completions_see_a_sibling
from tests.conftest import tiny_config
from tests.test_trainer import tokenizer
from tests.ties import excess_over_flips, flip_shares

trl = pytest.importorskip("trl")

WORDS = "a tiny corpus for a tiny tokenizer".split()
STEPS = 8


def preference_rows(n: int, seed: int, margin: bool = False, prompts: bool = False) -> list[dict]:
    """``n`` random pairs; ``prompts``: each with a prompt of 4-16 words too, which TRL writes before both texts."""
    rng = random.Random(seed)
    text = lambda low=1, high=12: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))  # noqa: E731
    rows = [{"chosen": text(), "rejected": text()} for _ in range(n)]
    if prompts:
        for row in rows:
            row["prompt"] = text(4, 16) + " "
    if margin:
        for row in rows:
            row["margin"] = rng.uniform(0.0, 1.0)
    return rows


def reward_trainer(packed: bool, architecture: str = "llama", margin: bool = False, prompts: bool = False,
                   sharing: str = "auto", model: dict | None = None, **overrides):
    """TRL's RewardTrainer on a tiny ``architecture`` (``model``: more of its config), ``overrides`` of its
    RewardConfig; accelerated when ``packed``. Weights of 0.1 spread (not 0.02): rewards that differ, so that every
    pair's reward margin lies clear of rounding (at 0.02 a third of them lay within 1e-3)."""
    torch.manual_seed(0)
    config = tiny_config(architecture, num_key_value_heads=2, num_labels=1, vocab_size=len(tokenizer()),
                         **{"initializer_range": 0.1, **(model or {})})
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                    per_device_eval_batch_size=5, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                    report_to="none", seed=0, disable_tqdm=True, bf16=False, dataloader_pin_memory=False)
    settings.update(overrides)
    trainer = trl.RewardTrainer(model=model, args=trl.RewardConfig(**settings),
                                train_dataset=datasets.Dataset.from_list(preference_rows(40, 0, margin, prompts)),
                                eval_dataset=datasets.Dataset.from_list(preference_rows(13, 1, margin, prompts)),
                                processing_class=copy.deepcopy(tokenizer()))  # TRL sets its pad token
    acceleration = accelerate(trainer, {"prefix_sharing": sharing}) if packed else None
    return trainer, acceleration


def logged(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@contextmanager
def recording_pair_margins(model) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of the (padded) reward model appends its pairs' reward margins to the list it
    yields (TRL's batch: the chosen texts, then the rejected)."""
    margins: list[torch.Tensor] = []

    def record(module, args, output):
        chosen, rejected = output.logits.detach().squeeze(-1).chunk(2)
        margins.append(chosen - rejected)

    handle = model.register_forward_hook(record)
    try:
        yield margins
    finally:
        handle.remove()


def assert_accuracies(got: list[float], want: list[float], shares: list[float]) -> None:
    """Each reward accuracy equals the reference's, up to the share of its pairs whose margin rounding could flip
    (:func:`tests.ties.excess_over_flips`)."""
    excess = excess_over_flips(got, want, shares, "reward accuracy")
    assert excess <= 1e-6, f"reward accuracies {got} != {want}, beyond the near-ties of their margins ({shares})"


CASES = {"llama": dict(), "qwen3": dict(architecture="qwen3"), "margin": dict(margin=True),
         "center-rewards": dict(center_rewards_coefficient=0.1), "accumulation2": dict(gradient_accumulation_steps=2),
         "eos-as-pad": dict(pad_token="</s>"),
         # prefix sharing (the default, auto): each pair's prompt once in the packed row
         "prompts shared": dict(prompts=True),
         "prompts shared, margin, accumulation2": dict(prompts=True, margin=True, gradient_accumulation_steps=2),
         "prompts shared, eos-as-pad, qwen3": dict(prompts=True, pad_token="</s>", architecture="qwen3"),
         "prompts, sharing off": dict(prompts=True, sharing="off")}


def reward_run(packed: bool, **settings) -> tuple[list[dict], dict, Any, int, dict | None]:
    """Train, evaluate and predict; the logged steps, the evaluation, the predictions, how many prompts the
    training's packed attention calls shared and, padded, the accuracies' :func:`flip_shares` (``train``: per
    logged step, ``eval``)."""
    trainer, acceleration = reward_trainer(packed, **settings)
    with recording_pair_margins(trainer.model) if not packed else nullcontext([]) as margins:
        with record_attention_calls() as calls:
            trainer.train()
        trained = len(margins)
        evaluation = trainer.evaluate()
    if acceleration is not None:
        assert acceleration.assembly.config.task == "seq_cls"
    shares = None
    if not packed:
        shares = {"train": flip_shares(margins[:trained], trained // trainer.args.max_steps),
                  "eval": flip_shares(margins[trained:], len(margins) - trained)}
    return (logged(trainer), evaluation, trainer.predict(trainer.eval_dataset),
            sum(call.shared_prompts for call in calls), shares)


@pytest.mark.parametrize("settings", CASES.values(), ids=CASES.keys())
def test_reward_trainer_trains_trls_padded_curve_with_its_metrics(settings):
    runs = [reward_run(packed, **settings) for packed in (False, True)]
    (want, want_eval, want_pred, _, shares), (got, got_eval, got_pred, shared, _) = runs
    if settings.get("prompts") and settings.get("sharing", "auto") != "off":
        assert shared >= STEPS * 4, "the pairs' prompts were not shared"  # 4 pairs per step, every layer
    elif settings.get("prompts"):
        assert shared == 0
    assert len(got) == len(want) == STEPS
    losses = torch.tensor([[entry["loss"] for entry in run] for run in (want, got)])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-4, rtol=0)
    assert losses[0].max() - losses[0].min() > 1e-3, "the loss never moved: the comparison would prove little"
    for w, g in zip(want, got):
        assert g["num_tokens"] == w["num_tokens"] > 0
        for key in ("margin", "min_reward", "mean_reward", "max_reward"):
            assert g[key] == pytest.approx(w[key], abs=1e-4), key
    assert_accuracies([g["accuracy"] for g in got], [w["accuracy"] for w in want], shares["train"])
    for key in ("eval_loss", "eval_margin", "eval_mean_reward"):
        assert got_eval[key] == pytest.approx(want_eval[key], abs=1e-4), key
    assert_accuracies([got_eval["eval_accuracy"]], [want_eval["eval_accuracy"]], shares["eval"])
    assert got_pred.predictions.shape == want_pred.predictions.shape
    # after training: the weights carry the curve's float-order differences (≤ 1e-4)
    torch.testing.assert_close(torch.tensor(got_pred.predictions), torch.tensor(want_pred.predictions), atol=1e-4,
                               rtol=0)


def test_undo_gives_the_trainer_its_own_collator_and_loss_back():
    trainer, acceleration = reward_trainer(True)
    assert isinstance(trainer.data_collator, PreferenceCollator)
    acceleration.undo()
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"
    assert "compute_loss" not in vars(trainer) and "prediction_step" not in vars(trainer)
    trainer.train()  # padded again
    assert len(logged(trainer)) == STEPS


def test_over_long_preference_texts_are_refused_before_training():
    trainer, _ = reward_trainer(False)
    with pytest.raises(PadfreeError, match="chosen_ids"):
        accelerate(trainer, {"max_length": 4})


@pytest.mark.parametrize("prompts", [False, True], ids=["pairs", "prompts shared"])
def test_compute_metrics_gets_what_trls_padded_evaluation_gives_it(prompts):
    """TRL's empty label_names make Trainer hand ``compute_metrics`` ``label_ids=()`` (it is not called without
    labels), the chosen-then-rejected scores and, with ``include_for_metrics=["inputs"]``, the padded input ids
    (each text whole where its pair's prompt was shared)."""
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"mean_score": float(prediction.predictions.mean())}

    results = []
    for packed in (False, True):
        trainer, acceleration = reward_trainer(packed, include_for_metrics=["inputs"], prompts=prompts)
        if packed:
            assert trainer.data_collator.share_prefixes
        trainer.compute_metrics = compute_metrics
        results.append(trainer.evaluate())
    assert len(seen) == 2, "compute_metrics was not called"
    want, got = seen
    assert got.label_ids == want.label_ids == ()
    np.testing.assert_allclose(got.predictions, want.predictions, atol=1e-5)
    np.testing.assert_array_equal(got.inputs, want.inputs)
    assert results[1]["eval_mean_score"] == pytest.approx(results[0]["eval_mean_score"], abs=1e-5)


BUDGET = {"strategy": "tokens", "max_tokens_per_batch": 48}


@pytest.mark.parametrize("prompts", [False, True], ids=["pairs", "prompts shared"])
def test_token_budget_trains_as_trls_padded_run_on_the_same_micro_batches(prompts):
    """``batching.strategy: tokens``: micro-batches of whole pairs up to 48 tokens, a pair counted as its packed row
    holds it (what its texts share, once); every logged value within 1e-4 of TRL's padded run fed the very same
    micro-batches; no micro-batch over the budget, pairs of several counts per micro-batch."""
    from padfree_plugins.batching.sampler import trainer_train_dataloader
    from padfree_plugins.integrations import trl_reward

    trainer, _ = reward_trainer(False, prompts=prompts)
    accelerate(trainer, {"batching": BUDGET})
    share, pad = trainer.data_collator.share_prefixes, trainer.data_collator.pad_token_id
    batches = list(trainer.get_train_dataloader())
    assert max(int(batch["input_ids"].shape[-1]) for batch in batches) <= BUDGET["max_tokens_per_batch"]
    assert len({int(batch["cu_seq_lens_q"].numel()) for batch in batches}) > 1
    trainer.train()
    reference, _ = reward_trainer(False, prompts=prompts)
    lengths = trl_reward.pair_lengths(reference.train_dataset, share, pad)
    reference.get_train_dataloader = lambda: trainer_train_dataloader(reference, {"batching": BUDGET},
                                                                      reference.data_collator, lengths=lengths)
    with recording_pair_margins(reference.model) as margins:
        reference.train()
    got, want = logged(trainer), logged(reference)
    assert len(got) == len(want) == STEPS
    for key in ("loss", "margin", "mean_reward", "num_tokens"):
        scale = max(max(abs(entry[key]) for entry in want), 1e-3)
        worst = max(abs(a[key] - b[key]) for a, b in zip(got, want)) / scale
        assert worst < 1e-4, (key, worst)
    assert_accuracies([g["accuracy"] for g in got], [w["accuracy"] for w in want], flip_shares(margins, 1))


def test_a_token_budget_run_saves_checkpoints_whose_plan_counts_the_pairs(tmp_path):
    """Under a token budget the checkpoints' batching plan (``padfree_batching.json``) hashes every pair's tokens as
    the dataloader counts them: TRL's reward rows have no ``input_ids`` column, so reading the dataset's (as for
    other trainers) failed at the first save."""
    import hashlib
    import json

    from padfree_plugins.integrations import trl_reward
    from padfree_plugins.integrations.resume import FINGERPRINT_FILE

    trainer, _ = reward_trainer(False, output_dir=str(tmp_path), save_strategy="steps", save_steps=1, max_steps=1)
    accelerate(trainer, {"batching": BUDGET})
    trainer.train()
    collator = trainer.data_collator
    lengths = trl_reward.pair_lengths(trainer.train_dataset, collator.share_prefixes, collator.pad_token_id)
    plan = json.loads((tmp_path / "checkpoint-1" / FINGERPRINT_FILE).read_text())
    assert plan["strategy"] == "tokens" and plan["examples"] == len(trainer.train_dataset)
    assert plan["sizes_sha256"] == hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def test_a_pair_over_the_budget_is_refused_before_training():
    trainer, _ = reward_trainer(False)
    with pytest.raises(PadfreeError, match="a pair is never split"):
        accelerate(trainer, {"batching": {"strategy": "tokens", "max_tokens_per_batch": 12}})
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"  # nothing was changed


@pytest.mark.parametrize("architecture", ["bert", "modernbert"])
def test_encoder_reward_models_train_trls_padded_curve(architecture):
    """Encoders score the CLS token (or ModernBERT's mean). Their head has a bias, whose gradient under TRL's
    pairwise loss is exactly zero, so AdamW moves it by float noise (~1e-3 over a few steps, in both runs alike):
    rewards are compared up to that common offset; loss, accuracy and margin do not see it."""
    runs = []
    for packed in (False, True):
        trainer, _ = reward_trainer(packed, architecture, max_steps=4)
        with recording_pair_margins(trainer.model) if not packed else nullcontext() as margins:
            trainer.train()
        runs.append((logged(trainer), trainer.predict(trainer.eval_dataset).predictions))
        shares = flip_shares(margins, 1) if not packed else shares
    (want, want_pred), (got, got_pred) = runs
    assert_accuracies([g["accuracy"] for g in got], [w["accuracy"] for w in want], shares)
    for w, g in zip(want, got, strict=True):
        assert g["num_tokens"] == w["num_tokens"]
        for key in ("loss", "margin"):
            assert g[key] == pytest.approx(w[key], abs=1e-4), key
        assert g["max_reward"] - g["min_reward"] == pytest.approx(w["max_reward"] - w["min_reward"], abs=1e-4)
    np.testing.assert_allclose(got_pred - got_pred.mean(), want_pred - want_pred.mean(), atol=1e-4)


def test_a_task_other_than_seq_cls_is_refused():
    """A RewardTrainer trains a sequence classifier: the default task becomes seq_cls, another one is an error."""
    trainer, _ = reward_trainer(False)
    with pytest.raises(ConfigError, match="RewardTrainer trains a sequence classifier"):
        accelerate(trainer, {"task": "reranker"})
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"


def test_preference_collator_takes_any_iterable_of_rows():
    """Like the task collators (collator.as_examples): a generator of rows packs as the list does."""
    trainer, acceleration = reward_trainer(True)
    rows = [trainer.train_dataset[i] for i in range(3)]
    want = trainer.data_collator(rows)
    got = trainer.data_collator(row for row in rows)
    assert want.keys() == got.keys()
    for key in want:
        if key == SHARED_PREFIXES_KEY:
            assert got[key].parents == want[key].parents and torch.equal(got[key].key_index, want[key].key_index)
        else:
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key


# -- prefix sharing -----------------------------------------------------------------------------------------------


def test_a_pair_shares_what_both_texts_begin_with_up_to_their_scored_tokens():
    """Up to (not including) either text's scored token: its last that is not the pad id (0 here)."""
    pairs = {((5, 6, 7, 8), (5, 6, 9)): 2,  # the common tokens
             ((5, 6, 7), (5, 6, 7)): 2,  # one text twice: all but the scored token
             ((5, 6, 0, 0), (5, 6, 0)): 1,  # trailing pad ids: the scored token is 6
             ((0, 0), (0, 0)): 0,  # pad ids only: the first token is scored
             ((5,), (5, 6)): 0,  # a 1-token text
             ((5, 6), (7, 6)): 0}  # nothing in common
    for (chosen, rejected), length in pairs.items():
        lengths = [len(chosen), len(rejected)]
        batch = {"input_ids": torch.tensor([[*chosen, *rejected]]),
                 "cu_seq_lens_q": torch.tensor([0, lengths[0], sum(lengths)])}
        want = [(length, chosen[:length])] * 2 if length else [None, None]
        assert pair_prefixes(batch, pad_token_id=0) == want, (chosen, rejected)
    batch = {"input_ids": torch.tensor([[5, 6, 0, 5, 6, 0]]), "cu_seq_lens_q": torch.tensor([0, 3, 6])}
    assert pair_prefixes(batch, pad_token_id=None) == [(2, (5, 6))] * 2  # no pad id: the last token is scored


@pytest.mark.parametrize("fault", [completions_see_a_sibling, completion_positions_restart])
def test_the_reward_comparison_fails_on_a_faulty_shared_row(fault):
    """A chosen text that sees a token of its rejected sibling, or whose positions restart after the shared prompt:
    the scores, and so the first steps' rewards, are off."""
    want = reward_run(False, prompts=True, max_steps=2)[0]
    with fault():
        got, _, _, shared, _ = reward_run(True, prompts=True, max_steps=2)
    assert shared
    off = [key for w, g in zip(want, got) for key in ("loss", "margin", "mean_reward")
           if abs(g[key] - w[key]) > 1e-4]
    assert off, "a faulty shared row went unnoticed"


class NoSharing:
    @hookimpl
    def register_attention_backends(self):
        return [AttentionBackend("noshare", exact_varlen, features=frozenset(FEATURES))]


@pytest.mark.parametrize("case", ["backend", "encoder"])
def test_prefix_sharing_on_is_refused_where_it_cannot_apply_and_auto_turns_it_off(case):
    """An attention backend without shared prefixes, an encoder (which reads a prompt both ways): ``on`` is a
    ConfigError at accelerate() that leaves the trainer as it was; ``auto`` packs every text whole."""
    trainer, _ = reward_trainer(False, prompts=True, architecture="bert" if case == "encoder" else "llama")
    config = {"attention": "noshare"} if case == "backend" else {}
    message = "'noshare' attention backend" if case == "backend" else "bert is an encoder"
    host = PluginHost({"noshare": NoSharing()})
    with pytest.raises(ConfigError, match=message):
        accelerate(trainer, {"prefix_sharing": "on", **config}, host=host)
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"
    assert patch_of(trainer.model) is None
    accelerate(trainer, {"prefix_sharing": "auto", **config}, host=host)
    assert trainer.data_collator.share_prefixes is False
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert SHARED_PREFIXES_KEY not in batch
