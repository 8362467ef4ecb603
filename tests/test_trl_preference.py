"""TRL's ``DPOTrainer`` and ``KTOTrainer`` through their plugins (``trl_dpo``, ``trl_kto``): 20 steps give TRL's
padded run — the loss curve and every logged metric (rewards, margins, log-probs, entropy, token accuracy, grad norm,
KL) within 1e-4 relative — for two DPO loss types with a reference model, several loss types at once, precomputed
reference log-probs, gradient accumulation 2, LoRA (the reference: the adapter disabled) and gradient checkpointing;
KTO with its KL term. Every log-probability forward, the policy's and the reference model's, runs packed."""

from __future__ import annotations

import copy
import random
import tempfile
import types
from contextlib import contextmanager
from unittest import mock

import datasets
import pytest
import torch

from padfree_plugins import PadfreeError, accelerate, patch_of
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.testing.faults import leak_across_boundaries
from padfree_plugins.testing.undo import assert_state_restored, model_state
from tests.conftest import tiny_model
from tests.test_trainer import tokenizer
from tests.ties import allowed_flips, excess_over_flips, recording_token_margins

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

STEPS = 20
#: Logged values that measure the machine, not the training.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
#: Logged values that a sign or an argmax decides (a pair's reward margin, a token's top logit): compared step by step,
#: exactly where every margin behind them is clear of rounding (:mod:`tests.ties`).
DISCONTINUOUS = ("rewards/accuracies", "mean_token_accuracy")


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


def policy(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    return tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tokenizer())).to(dtype).train()


class History(list):
    """A run's log history; ``flips``: per logged step, the share of each :data:`DISCONTINUOUS` value that rounding
    could flip (0 where every margin behind it is at least :data:`tests.ties.CLEAR`)."""

    flips: dict[str, list[float]] | None = None


@contextmanager
def recording_ties(trainer, calls: list[dict]):
    """Within the block, every call of the DPO trainer's ``compute_loss`` appends to ``calls`` the share of its
    pairs whose reward margin, and of its counted chosen tokens whose label margin (:func:`tests.ties.label_margins`:
    the first policy forward of the call, the one TRL's metrics read), is within :data:`tests.ties.CLEAR`."""
    accelerator, compute_loss = trainer.accelerator, trainer.compute_loss
    gather = accelerator.gather
    state: dict = {}

    def recording_gather(tensor):
        if "gathered" in state:
            state["gathered"].append(tensor.detach().clone())
        return gather(tensor)

    def recording_compute_loss(*args, **kwargs):
        state["gathered"] = []
        start = len(tokens)
        try:
            return compute_loss(*args, **kwargs)
        finally:
            gathered = state.pop("gathered")
            margins = [chosen - rejected for chosen, rejected, accurate in zip(gathered, gathered[1:], gathered[2:])
                       if chosen.ndim == 1 and chosen.shape == rejected.shape == accurate.shape
                       and torch.equal(accurate, (chosen > rejected).to(accurate.dtype))]
            assert margins, "TRL's reward accuracy not found among the gathered metrics"
            rows = tokens[start]  # the policy's forward: the chosen completions, then the rejected
            chosen = torch.cat(rows[:len(rows) // 2])
            # the first match: TRL gathers the chosen rewards, the rejected, then the accuracy (the margins after it
            # match too where every reward is 0)
            calls.append({"rewards/accuracies": allowed_flips(margins[0]) / margins[0].numel(),
                          "mean_token_accuracy": allowed_flips(chosen) / max(chosen.numel(), 1)})

    with recording_token_margins(trainer.model) as tokens:
        trainer.compute_loss, accelerator.gather = recording_compute_loss, recording_gather
        try:
            yield
        finally:
            del trainer.compute_loss, accelerator.gather


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])


def trained_reference(trainer) -> History:
    """Train a padded DPO ``trainer`` (the reference of a comparison) for ``STEPS`` steps, recording its near-ties:
    its log history, with its :attr:`History.flips`."""
    calls: list[dict] = []
    with recording_ties(trainer, calls):
        trainer.train()
    return with_flips(History(trainer.state.log_history), calls)


def with_flips(history: History, calls: list[dict]) -> History:
    """``history`` with ``flips``: per logged step, the mean of its calls' shares (:func:`recording_ties`)."""
    per_step = len(calls) // STEPS
    assert calls and len(calls) == per_step * STEPS, (len(calls), STEPS)
    history.flips = {key: [sum(call[key] for call in calls[step * per_step:(step + 1) * per_step]) / per_step
                           for step in range(STEPS)] for key in DISCONTINUOUS}
    return history


def run(kind: str, accelerated: bool, *, lora: bool = False, leak: bool = False, config: dict | None = None,
        dataset=None, dtype: torch.dtype = torch.float32, **settings) -> History:
    """``STEPS`` steps of a DPO or KTO trainer (a separate reference model unless LoRA), padded or accelerated
    (``config``: more of padfree.yaml); its log history, with its near-ties where padded DPO (the reference).
    ``dataset``: another DPO / KTO dataset; ``dtype``: the models'."""
    model = policy(dtype)
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
        calls: list[dict] = []
        if leak:
            with leak_across_boundaries(trainer.model, strength=1e-2):
                trainer.train()
        elif kind == "dpo" and not accelerated:
            with recording_ties(trainer, calls):
                trainer.train()
        else:
            trainer.train()
        if acceleration is not None:
            acceleration.undo()
    history = History(trainer.state.log_history)
    return with_flips(history, calls) if calls else history


def differences(got: list[dict], want: list[dict]) -> dict[str, float]:
    """The largest difference of every logged value, relative to its scale over the run."""
    assert len(got) == len(want) == STEPS + 1
    worst: dict[str, float] = {}
    for mine, theirs in zip(got, want):  # the accelerated run logs its fused calls besides (padfree/…)
        assert {key for key in mine if not key.startswith("padfree/")} == \
            {key for key in theirs if not key.startswith("padfree/")}
        for key, value in theirs.items():
            if key in TIMINGS or key.startswith("padfree/") or key in DISCONTINUOUS or \
                    not isinstance(value, (int, float)):
                continue
            scale = max(max(abs(entry[key]) for entry in want if key in entry), 1e-3)
            worst[key] = max(worst.get(key, 0.0), abs(mine[key] - value) / scale)
    return worst


def discontinuous_off(got: list[dict], want: list[dict]) -> dict[str, float]:
    """The :data:`DISCONTINUOUS` values ``got`` logs beyond the flips rounding could cause (``want.flips``, the
    reference's near-ties): the largest excess of each. A value whose margins are all clear must be equal."""
    off: dict[str, float] = {}
    for key in DISCONTINUOUS:
        if key not in want[0]:
            continue
        flips = getattr(want, "flips", None)
        assert flips is not None, f"{key} logged, but the reference run did not record its near-ties"
        excess = excess_over_flips([entry[key] for entry in got[:STEPS]], [entry[key] for entry in want[:STEPS]],
                                   flips[key], key)
        if excess > 1e-6:
            off[key] = excess
    return off


def assert_same_run(got: list[dict], want: list[dict]) -> None:
    """``got`` logs ``want``'s values: continuous ones within 1e-4 of their scale, the :data:`DISCONTINUOUS` ones
    equal where their margins are clear of rounding."""
    worst = differences(got, want)
    assert {"loss", "grad_norm"} <= worst.keys()
    off = {key: value for key, value in worst.items() if value > 1e-4} | discontinuous_off(got, want)
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
    # (and the words that several prompts begin with once more: a prefix tree); off, nothing is shared
    off = settings.get("config", {}).get("prefix_sharing") == "off"
    pairs_per_call = settings.get("per_device_train_batch_size", 4)
    shared = [call.shared_prompts for call in calls]
    if off:
        assert shared == [0] * len(calls)
    elif kind == "dpo":
        assert all(prompts >= pairs_per_call for prompts in shared), shared
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
    states = (model_state(model), model_state(trainer.ref_model))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert patch_of(trainer.ref_model) is not None
    acceleration.undo()
    assert (vars(model)["forward"], vars(trainer.ref_model)["forward"]) == forwards
    assert patch_of(model) is None and patch_of(trainer.ref_model) is None
    assert_state_restored(states[0], model)
    assert_state_restored(states[1], trainer.ref_model)



def float64_head(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                 logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
    """TRL's fused LM head (``ChunkedLogProbFunction.apply``: log-probabilities of the targets, and the entropy,
    ``log sum p^2``, the mean logit, whether the target is the argmax) in plain torch, in the model's dtype: TRL's
    own computes the logits in fp32 whatever the model's dtype."""
    logits = torch.nn.functional.linear(hidden, weight, bias) * logit_scale
    if final_logit_softcapping is not None:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    logp = (logits / temperature).log_softmax(-1)
    extra = {"entropy": -(logp.exp() * logp).sum(-1), "log_sum_sq_probs": torch.logsumexp(2 * logp, -1).detach(),
             "mean_logits": logits.mean(-1).detach(), "is_top1": logits.argmax(-1) == targets}
    return logp.gather(-1, targets[:, None])[:, 0], *(extra[name] if name in outputs else None for name in extra)


def float64_rms_norm(self, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm in the input's dtype (transformers' own rounds every norm's input to fp32)."""
    return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_dpo_in_float64_logs_the_padded_values_to_1e10(packed_calls):
    """In float64 the padding-free DPO run (robust loss, precomputed reference) logs TRL's padded values within
    1e-10 of their scale (seen: 4e-15), the discontinuous ones equal where their margins are clear: what differs
    between the two in fp32, and between CPU kinds, is rounding, not packing. The two fp32 islands of the stack,
    TRL's fused LM head and Llama's RMSNorm, run in float64 too (both runs alike); left in fp32 they turn 1e-16
    differences into whole fp32 steps (~1e-7)."""
    from transformers.models.llama import modeling_llama
    from trl.trainer import utils

    kind, settings = CASES["dpo robust, precomputed reference"]
    with mock.patch.object(utils, "_ChunkedLogProbFunction", types.SimpleNamespace(apply=float64_head)), \
            mock.patch.object(modeling_llama.LlamaRMSNorm, "forward", float64_rms_norm):
        want = run(kind, False, dtype=torch.float64, **settings)
        packed_calls.clear()
        got = run(kind, True, dtype=torch.float64, **settings)
    assert packed_calls and all(packed_calls)
    worst = differences(got, want)
    assert max(worst.values()) < 1e-10, worst
    assert not discontinuous_off(got, want)
