"""TRL's ``DPOTrainer`` and ``KTOTrainer`` through their plugins (``trl_dpo``, ``trl_kto``): 20 steps give TRL's
padded run — the loss curve and every logged metric (rewards, margins, log-probs, entropy, token accuracy, grad norm,
KL) within 1e-4 relative — for two DPO loss types with a reference model, several loss types at once, precomputed
reference log-probs, gradient accumulation 2, LoRA (the reference: the adapter disabled) and gradient checkpointing;
KTO with its KL term. Every log-probability forward, the policy's and the reference model's, runs packed."""

from __future__ import annotations

import copy
import random
import tempfile

import datasets
import pytest
import torch

from padfree_plugins import PadfreeError, accelerate, patch_of
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.testing.faults import leak_across_boundaries
from tests.conftest import tiny_model
from tests.test_trainer import tokenizer

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

STEPS = 20
#: Logged values that measure the machine, not the training.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def words(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocabulary = "a tiny corpus for the tokenizer with words of its own".split()
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 14))) for _ in range(count)]


def pairs(count: int = 40) -> datasets.Dataset:
    """Prompts, chosen and rejected completions of 1–14 words each: batches ~50% padding."""
    prompts, chosen, rejected = words(count, 0), words(count, 1), words(count, 2)
    return datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r}
                                       for p, c, r in zip(prompts, chosen, rejected)])


def unpaired(count: int = 40) -> datasets.Dataset:
    """KTO's rows: a prompt, one completion, whether it is desirable."""
    return datasets.Dataset.from_list([{"prompt": p, "completion": c, "label": i % 3 != 0}
                                       for i, (p, c) in enumerate(zip(words(count, 3), words(count, 4)))])


def policy():
    torch.manual_seed(0)
    return tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tokenizer())).train()


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])


def run(kind: str, accelerated: bool, *, lora: bool = False, leak: bool = False, config: dict | None = None,
        dataset=None, **settings) -> list[dict]:
    """``STEPS`` steps of a DPO or KTO trainer (a separate reference model unless LoRA), padded or accelerated
    (``config``: more of padfree.yaml); its log history. ``dataset``: another DPO / KTO dataset."""
    model = policy()
    ref_model = None if lora or settings.get("precompute_ref_log_probs") else copy.deepcopy(model).eval()
    options = dict(per_device_train_batch_size=4, max_steps=STEPS, learning_rate=3e-3 if lora else 1e-3,
                   logging_steps=1, report_to=[], seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False,
                   disable_tqdm=True)
    options.update(settings)
    with tempfile.TemporaryDirectory() as out:
        if kind == "dpo":
            data = pairs() if dataset is None else dataset
            trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=trl.DPOConfig(output_dir=out, **options),
                                     train_dataset=data, processing_class=copy.deepcopy(tokenizer()),
                                     peft_config=peft.LoraConfig(**LORA) if lora else None)
        else:
            data = unpaired() if dataset is None else dataset
            trainer = trl.KTOTrainer(model=model, ref_model=ref_model, args=trl.KTOConfig(output_dir=out, **options),
                                     train_dataset=data, processing_class=copy.deepcopy(tokenizer()),
                                     peft_config=peft.LoraConfig(**LORA) if lora else None)
        acceleration = accelerate(trainer, {"task": "causal_lm", **(config or {})}) if accelerated else None
        if acceleration is not None:
            assert acceleration.trainer_plugin == f"trl_{kind}"
        if leak:
            with leak_across_boundaries(trainer.model, strength=1e-2):
                trainer.train()
        else:
            trainer.train()
        if acceleration is not None:
            acceleration.undo()
    return trainer.state.log_history


def differences(got: list[dict], want: list[dict]) -> dict[str, float]:
    """The largest difference of every logged value, relative to its scale over the run."""
    assert len(got) == len(want) == STEPS + 1
    worst: dict[str, float] = {}
    for mine, theirs in zip(got, want):  # the accelerated run logs its fused calls besides (padfree/…)
        assert {key for key in mine if not key.startswith("padfree/")} == \
            {key for key in theirs if not key.startswith("padfree/")}
        for key, value in theirs.items():
            if key in TIMINGS or key.startswith("padfree/") or not isinstance(value, (int, float)):
                continue
            scale = max(max(abs(entry[key]) for entry in want if key in entry), 1e-3)
            worst[key] = max(worst.get(key, 0.0), abs(mine[key] - value) / scale)
    return worst


def assert_same_run(got: list[dict], want: list[dict]) -> None:
    worst = differences(got, want)
    assert {"loss", "grad_norm"} <= worst.keys()
    off = {key: value for key, value in worst.items() if value > 1e-4}
    assert not off, f"logged values off (relative to their scale): {off}"
    curve = [entry["loss"] for entry in want[:-1]]
    assert max(curve) - min(curve) > 1e-2 * max(map(abs, curve)), "the run did not train: the comparison proves little"


CASES = {
    "dpo sigmoid, reference model": ("dpo", {}),
    "dpo ipo, reference model": ("dpo", {"loss_type": ["ipo"]}),
    "dpo sigmoid + sft + hinge, weighted": ("dpo", {"loss_type": ["sigmoid", "sft", "hinge"],
                                                    "loss_weights": [1.0, 0.5, 0.2]}),
    "dpo robust, precomputed reference": ("dpo", {"loss_type": ["robust"], "label_smoothing": 0.1,
                                                  "precompute_ref_log_probs": True}),
    "dpo accumulation 2": ("dpo", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}),
    "dpo lora": ("dpo", {"lora": True}),
    "dpo gradient checkpointing, WPO weighting, ld_alpha": ("dpo", {"gradient_checkpointing": True,
                                                                    "use_weighting": True, "ld_alpha": 0.5}),
    "dpo sigmoid, prompts not shared": ("dpo", {"config": {"prefix_sharing": "off"}}),
    "kto with KL": ("kto", {}),
    "kto accumulation 2, lora": ("kto", {"gradient_accumulation_steps": 2, "lora": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_gives_trls_padded_run(case, packed_calls):
    kind, settings = CASES[case]
    want = run(kind, False, **settings)
    packed_calls.clear()
    with record_attention_calls() as calls:
        got = run(kind, True, **settings)
    assert packed_calls and all(packed_calls), "a log-probability forward ran padded"
    # DPO's pairs share their prompts (prefix_sharing: auto, the default): each forward holds every pair's prompt once
    shares = kind == "dpo" and settings.get("config", {}).get("prefix_sharing") != "off"
    pairs_per_call = settings.get("per_device_train_batch_size", 4)
    assert [call.shared_prompts for call in calls] == [pairs_per_call * shares] * len(calls)
    assert_same_run(got, want)


def test_a_leaking_layer_is_caught():
    """The comparison fails when a layer leaks 1e-2 of each example's previous token across the boundary."""
    want = run("dpo", False)
    with pytest.raises(AssertionError, match="logged values off"):
        assert_same_run(run("dpo", True, leak=True), want)


def test_reference_log_probs_precomputed_after_accelerate_run_packed(packed_calls):
    """``precompute_ref_log_probs``: the pass of an ``evaluate()`` on a new dataset runs packed, and gives TRL's
    padded values."""
    model = policy()
    with tempfile.TemporaryDirectory() as out:
        args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             report_to=[], use_cpu=True, bf16=False, precompute_ref_log_probs=True, disable_tqdm=True)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=pairs(8),
                                 processing_class=copy.deepcopy(tokenizer()))
        held_out = trainer._prepare_dataset(pairs(12), trainer.processing_class, args, "eval")
        want = trainer._precompute_ref_logps(held_out, "padded", 4)
        acceleration = accelerate(trainer, {"task": "causal_lm"})
        packed_calls.clear()
        got = trainer._precompute_ref_logps(held_out.map(lambda row: row, new_fingerprint="again"), "packed", 4)
        acceleration.undo()
    assert packed_calls and all(packed_calls)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(got[column]), torch.tensor(want[column]), atol=1e-5, rtol=1e-5)


def test_a_vision_dataset_is_refused_and_the_trainer_left_alone():
    model = policy()
    with tempfile.TemporaryDirectory() as out:
        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), train_dataset=pairs(8),
                                 args=trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False),
                                 processing_class=copy.deepcopy(tokenizer()))
    trainer._is_vision_dataset = True
    forward = model.forward
    with pytest.raises(PadfreeError, match="plugin packs text only") as error:
        accelerate(trainer, {"task": "causal_lm"})
    assert "gemma3_vl" in str(error.value) and "qwen2_5_vl" in str(error.value) and "wrap_collator" in str(error.value)
    assert model.forward == forward and patch_of(model) is None and patch_of(trainer.ref_model) is None


def test_undo_restores_the_policy_and_the_reference_model():
    model = policy()
    with tempfile.TemporaryDirectory() as out:
        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), train_dataset=pairs(8),
                                 args=trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False),
                                 processing_class=copy.deepcopy(tokenizer()))
    forwards = (vars(model)["forward"], vars(trainer.ref_model)["forward"])
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert patch_of(trainer.ref_model) is not None
    acceleration.undo()
    assert (vars(model)["forward"], vars(trainer.ref_model)["forward"]) == forwards
    assert patch_of(model) is None and patch_of(trainer.ref_model) is None
