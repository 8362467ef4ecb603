"""TRL's online RL trainers (plugins ``trl_grpo`` and ``trl_rloo``): GRPO and RLOO trained through the native
plugins give TRL's padded run — the same trainer, built the same way, not accelerated — over 20 optimizer steps:
the loss curve, the gradient norms and every metric TRL logs (kl, entropy, clip ratios, rewards, completion
lengths …); every fused log-probability forward (the policy's, the old policy's, the reference model's) is packed;
a leak across packed boundaries is caught; ``use_vllm`` without CUDA is refused and the trainer left alone.

The setup, and why the comparisons can fail:

* A tiny Llama saved to a directory (GRPO and RLOO build their reference model from ``config._name_or_path``),
  its EOS row of the LM head scaled ×40 so that completions end at EOS after 1…10 tokens: the batches are
  left-padded prompts *and* right-padded completions of many lengths. 16 prompts of 16 different token lengths,
  so no batch is without padding (a batch without any pad runs TRL's own forward, which costs nothing extra, and
  would not be packed).
* Generation samples (temperature 1, TRL's defaults), with the same seeds in both runs. The reward function
  records the completion ids it scores, and the test asserts that both runs saw exactly the same completions at
  every step: packed and padded log-probabilities agree to ~1e-6, which never moved a sampled token here. (Were it
  to, the test says so — "completions diverged" — rather than reporting a metric difference.)
* Every logged float is compared step by step within 1e-4 of that quantity's scale (its largest value over the
  reference run): ``kl`` and ``entropy`` (order 1e-2…5), ``grad_norm``, the clip ratios, the rewards, the
  completion lengths, token counts. The loss is small (GRPO's 1e-7…0.3 — with one iteration its policy term is
  -mean(advantage) whatever the log-probabilities, so its value tells little; RLOO's ~1e-7, zero but for
  rounding), and is compared at each step within 1e-6 + 1e-4 × its value. The sensitive quantities are the
  gradient norm and the KL. Each run must really train: the KL to the reference model grows above 0.05, the
  rewards change (and with ``num_iterations=2`` the clipping is active).
* Measured here: packed and padded agree to ≤ 1.2e-6 in kl, ≤ 1.5e-6 in entropy, ≤ 6.4e-5 in grad_norm (of up
  to 52) and ≤ 1.4e-7 in the loss: at most 3% of any tolerance (13% for RLOO's noise-level loss). Beware that
  the k3 KL estimator amplifies rounding by ``exp(ref - logp)`` on rare tokens: a LoRA run at lr 3e-3 reached 40%
  of the kl tolerance at one step (4e-6 in the loss: hence its relative term), as much as two *padded* runs that
  differ only in ``pad_to_multiple_of`` do there.
* The same comparison, with a deliberately leaking layer
  (:func:`padfree_plugins.testing.faults.leak_across_boundaries`) in the packed run, fails.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from padfree_plugins import ConfigError, accelerate, patch_of
from padfree_plugins.integrations.trl_fused import fused_forward_of
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.testing.faults import leak_across_boundaries
from tests.conftest import tiny_model
from tests.test_trainer import tokenizer
from tests.ties import CLEAR

trl = pytest.importorskip("trl")

STEPS = 20
#: Every logged float within RTOL × its scale (its largest magnitude over the reference run) …
RTOL = 1e-4
#: … but the loss, step by step, within LOSS_ATOL + RTOL × its value: RLOO's is zero but for rounding (~1e-7),
#: GRPO's 1e-7…0.3 (with one iteration its policy term is -mean(advantage) whatever the log-probabilities).
LOSS_ATOL = 1e-6
#: Not compared: wall-clock times, and what the schedule alone sets.
NOT_COMPARED = {"step_time", "epoch", "step", "learning_rate"}


def left_padding_tokenizer():
    tok = copy.deepcopy(tokenizer())
    tok.padding_side = "left"
    return tok


@functools.lru_cache(maxsize=1)
def model_dir() -> str:
    """A tiny Llama whose EOS logit is large often enough that completions have many lengths."""
    tok = left_padding_tokenizer()
    model = tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tok))
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 40
    path = tempfile.mkdtemp(prefix="padfree-trl-rl-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=1)
def prompts() -> datasets.Dataset:
    """16 prompts, each of a different number of tokens: every batch of two or more is left-padded."""
    tok, rng, words = left_padding_tokenizer(), random.Random(0), "a tiny corpus for the tokenizer".split()
    by_length: dict[int, str] = {}
    while len(by_length) < 16:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        if len(tok(text)["input_ids"]) <= 24:
            by_length.setdefault(len(tok(text)["input_ids"]), text)
    return datasets.Dataset.from_list([{"prompt": text} for text in by_length.values()])


@dataclass
class Run:
    history: list[dict]  # the log entries of the optimizer steps
    completions: list[list[tuple[int, ...]]] = field(default_factory=list)  # the ids scored, per reward call
    fused_calls: int = 0  # fused forwards counted (padded runs)
    packed: list[bool] = field(default_factory=list)  # pack_padded_call results (accelerated runs)
    plugin: str = ""
    has_ref_model: bool = False  # False under LoRA: the reference is the policy with its adapter disabled
    shared_prompts: list[int] = field(default_factory=list)  # per packed attention call: the prompts its row shares
    shared_depths: list[int] = field(default_factory=list)  # per packed attention call: its prefix tree's depth
    calls: Any = None  # the trainer patch's FusedCalls (accelerated runs): packed, padded by reason
    flips: dict[str, list[float]] = field(default_factory=dict)  # per clip metric and step: see recording_clip_ties


#: GRPO's clip ratios: shares of tokens whose importance ratio passed a clip bound, a discontinuous count.
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max")


@contextlib.contextmanager
def recording_clip_ties(trainer, calls: list[dict]):
    """Within the block, every call of GRPO's loss appends to ``calls``, per :data:`CLIP_METRICS` key, how far
    rounding could move it: its tokens whose importance ratio lies within :data:`tests.ties.CLEAR` of the bound that
    applies to it (``1 - epsilon_low`` under a negative advantage, ``1 + epsilon_high`` under a positive one), a share
    of all its tokens (the means) or, at most, of one completion's (the per-completion min and max)."""
    compute_loss, logps_of = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
    seen: dict = {}

    def recording_logps(*args, **kwargs):
        out = logps_of(*args, **kwargs)
        if seen.get("inside") and "logps" not in seen:
            seen["logps"] = out[0].detach()
        return out

    def recording_compute_loss(model, inputs):
        seen.clear()
        seen["inside"] = True
        try:
            return compute_loss(model, inputs)
        finally:
            mask = inputs["completion_mask"].bool()
            old = inputs.get("old_per_token_logps")
            ratio = torch.ones(mask.shape, dtype=torch.float64) if old is None else (seen["logps"] - old).double().exp()
            advantages = inputs["advantages"].reshape(len(mask), -1)
            low = (advantages < 0) & ((ratio - (1 - trainer.epsilon_low)).abs() < CLEAR) & mask
            high = (advantages > 0) & ((ratio - (1 + trainer.epsilon_high)).abs() < CLEAR) & mask
            tokens, lengths = mask.sum().clamp(min=1), mask.sum(-1).clamp(min=1)
            calls.append({"clip_ratio/low_mean": float(low.sum() / tokens),
                          "clip_ratio/high_mean": float(high.sum() / tokens),
                          "clip_ratio/region_mean": float((low | high).sum() / tokens),
                          "clip_ratio/low_min": float((low.sum(-1) / lengths).max()),
                          "clip_ratio/high_max": float((high.sum(-1) / lengths).max())})
            seen.clear()

    trainer._compute_loss, trainer._get_per_token_logps_and_entropies = recording_compute_loss, recording_logps
    try:
        yield
    finally:
        del trainer._compute_loss, trainer._get_per_token_logps_and_entropies


def count_fused_calls(trainer) -> list[int]:
    """Wrap every TRL fused forward of the trainer's models (the policy's base model under LoRA, the reference
    model's) with a counter of its ``fused_lm_head=True`` calls. Padded runs only (the plugin finds TRL's forward
    by its code)."""
    counter = [0]
    models = [trainer.model, getattr(trainer, "ref_model", None)]
    for module in {id(m): m for model in models if model is not None for m in model.modules()}.values():
        forward = fused_forward_of(module)
        if forward is not None:
            @functools.wraps(forward)  # the model's signature, which generate() checks its model kwargs against
            def counting(*args, _forward=forward, **kwargs):
                counter[0] += bool(kwargs.get("fused_lm_head"))
                return _forward(*args, **kwargs)
            module.forward = counting
    return counter


def build(kind: str, output_dir: str, *, lora: bool = False, seen: list | None = None, tools: list | None = None,
          **overrides):
    """A GRPO / RLOO trainer on the tiny model, seeded; its reward (longer completions are better) records the
    completion ids in ``seen``; ``tools``: TRL's tool calling."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir())
    config_class, trainer_class = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (
        trl.RLOOConfig, trl.RLOOTrainer)

    def length_reward(completions, completion_ids, **kwargs):
        if seen is not None:
            seen.append([tuple(ids) for ids in completion_ids])
        return [len(text) / 10 for text in completions]

    settings = dict(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=10, max_steps=STEPS, learning_rate=1e-4, logging_steps=1, report_to=[],
                    seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True)
    settings.update(overrides)
    extra = {"tools": tools} if tools else {}
    if lora:
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    return trainer_class(model=model, reward_funcs=length_reward, args=config_class(**settings),
                         train_dataset=prompts(), processing_class=left_padding_tokenizer(), **extra)


def train(kind: str, accelerated: bool, packed_calls: list | None = None, *, leak: float = 0.0,
          config: dict | None = None, fault: Any = None, **options) -> Run:
    """``STEPS`` steps, padded or accelerated (``config``: more of padfree.yaml), with a layer leaking ``leak`` across
    boundaries or within ``fault`` (a context manager) if given."""
    completions: list = []
    run = Run(history=[])
    counter = None
    acceleration = None
    before = len(packed_calls) if packed_calls is not None else 0
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build(kind, output_dir, seen=completions, **options)
        if accelerated:
            acceleration = accelerate(trainer, {"task": "causal_lm", **(config or {})})
            assert acceleration.trainer_patch.kind == kind
            run.plugin = acceleration.trainer_plugin
        else:
            counter = count_fused_calls(trainer)
        run.has_ref_model = trainer.ref_model is not None
        faulty = leak_across_boundaries(trainer.model, strength=leak) if leak else contextlib.nullcontext()
        clip_calls: list[dict] = []
        ties = recording_clip_ties(trainer, clip_calls) if kind == "grpo" and not accelerated else None
        with faulty, fault or contextlib.nullcontext(), ties or contextlib.nullcontext():
            with record_attention_calls() as calls:
                trainer.train()
        if ties is not None:  # per step: the mean over its calls, as TRL logs them
            per_step = len(clip_calls) // STEPS
            assert clip_calls and len(clip_calls) == per_step * STEPS
            run.flips = {key: [sum(call[key] for call in clip_calls[step * per_step:(step + 1) * per_step]) / per_step
                               for step in range(STEPS)] for key in CLIP_METRICS}
        run.shared_prompts = [call.shared_prompts for call in calls]
        run.shared_depths = [call.shared_depth for call in calls]
        if acceleration is not None:
            run.calls = acceleration.trainer_patch.calls
            acceleration.undo()
    run.history = [entry for entry in trainer.state.log_history if "loss" in entry]
    run.completions = completions
    run.fused_calls = counter[0] if counter is not None else 0
    run.packed = list(packed_calls[before:]) if packed_calls is not None else []
    return run


@functools.lru_cache(maxsize=None)
def padded(kind: str, **options) -> Run:
    return train(kind, False, **options)


def differences(got: list[dict], want: list[dict], steps=None, count: int = STEPS, flips: dict | None = None
                ) -> dict[str, tuple[float, float]]:
    """Per logged quantity: the largest difference over the steps (all ``count``, or those given), and its tolerance
    there; ``flips``: per discontinuous quantity and step, how far rounding could move it (added to its tolerance)."""
    assert len(got) == len(want) == count
    steps = range(count) if steps is None else steps
    flips = flips or {}
    out = {}
    for key in sorted({key for entry in want for key in entry} - NOT_COMPARED):
        assert [key in entry for entry in got] == [key in entry for entry in want], key
        scale = max(abs(entry[key]) for entry in want if key in entry)
        if key in flips:
            assert sum(flips[key]) <= count / 4, f"{key}: too many near-ties ({flips[key]}); use larger margins"
        worst = (0.0, 0.0, 0.0)  # difference / tolerance, difference, tolerance
        for step in steps:
            if key not in want[step]:
                continue
            wanted, gotten = want[step][key], got[step][key]
            tolerance = LOSS_ATOL + RTOL * abs(wanted) if key == "loss" else RTOL * max(scale, 1e-2)
            tolerance += flips.get(key, [0.0] * count)[step]
            difference = abs(gotten - wanted)
            worst = max(worst, (difference / tolerance, difference, tolerance))
        out[key] = worst[1:]
    return out


def beyond_tolerance(got: Run, want: Run, steps=None, count: int = STEPS) -> dict[str, tuple[float, float]]:
    return {key: value for key, value in differences(got.history, want.history, steps, count, want.flips).items()
            if value[0] > value[1]}


def assert_trains(run: Run) -> None:
    """The reference really trains: the policy leaves the reference model and the rewards change."""
    kl = [entry["kl"] for entry in run.history]
    rewards = [entry["reward"] for entry in run.history if "reward" in entry]
    assert kl[0] == 0 and max(kl) > 0.05, f"the policy did not move away from the reference model: kl {kl}"
    assert max(rewards) - min(rewards) > 0.1, f"the rewards did not change: {rewards}"
    lengths = {len(ids) for batch in run.completions for ids in batch}
    assert len(lengths) > 3, f"completions of too few lengths to pad them: {lengths}"


def assert_same_run(got: Run, want: Run, plugin: str) -> None:
    assert got.plugin == plugin
    assert want.fused_calls > 0
    assert len(got.packed) == want.fused_calls and all(got.packed), \
        f"every fused forward ({want.fused_calls}) must be packed: {got.packed}"
    assert got.completions == want.completions, "completions diverged between the padded and the packed run"
    # every packed forward shares its rows' prompts (prefix_sharing: auto, the default): TRL repeats each prompt
    # num_generations times, so a call of 8 rows holds 2 prompts once — or, where a generation batch of 16 is split
    # into two micro-batches after TRL's shuffle, the prompts that repeat in each
    assert got.shared_prompts and all(prompts >= 1 for prompts in got.shared_prompts), got.shared_prompts[:8]
    assert_trains(want)
    assert beyond_tolerance(got, want) == {}


GRPO_CASES = {
    "grpo-beta": dict(loss_type="grpo"),
    "dr_grpo-beta": dict(loss_type="dr_grpo"),
    "dapo-iterations2": dict(num_iterations=2, learning_rate=3e-4),  # a larger step: the ratio clips
    "dapo-accumulation2": dict(gradient_accumulation_steps=2),
    "dapo-lora": dict(lora=True, learning_rate=2e-3),
}


@pytest.mark.parametrize("options", GRPO_CASES.values(), ids=GRPO_CASES.keys())
def test_grpo_trains_the_padded_run(options, packed_calls):
    """GRPO with a reference model (beta 0.1), num_generations 4; loss types grpo and dr_grpo; TRL's default dapo
    with two iterations per generation (old-policy log-probabilities: the importance ratio and its clipping
    active), with gradient accumulation 2 (TRL then generates once per optimizer step for both micro-batches:
    steps_per_generation = 2, generation batch of 16 = 4 prompts × 4 completions) and with LoRA (the reference is
    the policy with its adapter disabled)."""
    want = padded("grpo", **options)
    got = train("grpo", True, packed_calls, **options)
    assert_same_run(got, want, "trl_grpo")
    assert want.has_ref_model == got.has_ref_model == (not options.get("lora"))
    if options.get("num_iterations", 1) > 1:
        assert max(entry["clip_ratio/region_mean"] for entry in want.history) > 0.05, "no clipping happened"


RLOO_CASES = {
    "beta": dict(),
    "accumulation2": dict(gradient_accumulation_steps=2),
    "lora": dict(lora=True, learning_rate=2e-3),
}


@pytest.mark.parametrize("options", RLOO_CASES.values(), ids=RLOO_CASES.keys())
def test_rloo_trains_the_padded_run(options, packed_calls):
    """RLOO with a reference model (beta 0.1: the KL in the reward), num_generations 4; with accumulation 2 (one
    generation of 4 prompts per optimizer step); with LoRA (the reference: the adapter disabled)."""
    want = padded("rloo", **options)
    got = train("rloo", True, packed_calls, **options)
    assert_same_run(got, want, "trl_rloo")
    assert want.has_ref_model == got.has_ref_model == (not options.get("lora"))


LEAK_CASES = {"grpo": ("grpo", dict(loss_type="grpo")), "rloo": ("rloo", dict())}


@pytest.mark.parametrize("kind,options", LEAK_CASES.values(), ids=LEAK_CASES.keys())
def test_a_leak_across_boundaries_is_caught(kind, options, packed_calls):
    """The comparison can fail: with a layer leaking 1e-3 of the hidden state across packed boundaries (generation
    runs padded, where nothing leaks), the gradient norms leave the tolerance even on the steps whose completions
    are still the padded run's, and the whole comparison fails."""
    want = padded(kind, **options)
    got = train(kind, True, packed_calls, leak=1e-3, **options)
    assert got.packed and all(got.packed)
    assert len(got.completions) == len(want.completions) == STEPS
    same = [step for step in range(STEPS) if got.completions[step] == want.completions[step]]
    assert len(same) > STEPS // 2
    assert "grad_norm" in beyond_tolerance(got, want, same), differences(got.history, want.history, same)
    assert "grad_norm" in beyond_tolerance(got, want)


def forward_hooks(model) -> int:
    return sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules())


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM is refused only without CUDA")
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_use_vllm_without_cuda_is_refused_and_the_trainer_left_alone(kind, tmp_path):
    """``use_vllm=True`` (set on the trainer's args after construction: without vllm installed TRL's trainer
    cannot be built with it) is refused at accelerate() with a ConfigError; the policy and the reference model
    keep TRL's fused forwards, no patch, no hooks, their attention implementation."""
    trainer = build(kind, str(tmp_path))
    trainer.args.use_vllm = True
    models = [trainer.model, trainer.ref_model]
    forwards = [vars(model)["forward"] for model in models]
    hooks = [forward_hooks(model) for model in models]
    attention = [model.config._attn_implementation for model in models]
    with pytest.raises(ConfigError, match=f"use_vllm=True with {type(trainer).__name__} on a machine without CUDA"):
        accelerate(trainer, {"task": "causal_lm"})
    assert [vars(model)["forward"] for model in models] == forwards
    assert all(fused_forward_of(model) is not None for model in models)
    assert [forward_hooks(model) for model in models] == hooks
    assert [model.config._attn_implementation for model in models] == attention
    assert all(patch_of(model) is None for model in models)


def test_a_trl_without_the_fused_lm_head_is_refused_and_the_trainer_left_alone(tmp_path, monkeypatch):
    """A TRL older than the fused LM head (``trl.trainer.utils.add_fused_lm_head``, TRL 1.15; axolotl 0.21 pins
    TRL 1.14) is refused at accelerate() with the version to install, the models untouched."""
    import trl.trainer.utils as trl_utils

    trainer = build("grpo", str(tmp_path))
    models = [trainer.model, trainer.ref_model]
    forwards = [vars(model)["forward"] for model in models]
    monkeypatch.delattr(trl_utils, "add_fused_lm_head")
    with pytest.raises(ConfigError, match=r"GRPOTrainer on TRL .*fused LM head.*trl>=1\.16"):
        accelerate(trainer, {"task": "causal_lm"})
    assert [vars(model)["forward"] for model in models] == forwards
    assert all(patch_of(model) is None for model in models)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_a_token_budget_is_refused_with_the_reason_and_the_trainer_left_alone(kind, tmp_path):
    """GRPO / RLOO under ``batching.strategy: tokens``: TRL's rollout buffer has fixed sizes that its schedule and
    advantages assume, so the budget is refused at accelerate(), saying so; the models keep TRL's fused forwards."""
    trainer = build(kind, str(tmp_path))
    with pytest.raises(ConfigError, match="rollout buffer .* steps_per_generation equal micro-batches"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens", "max_tokens_per_batch": 256}})
    assert all(patch_of(model) is None for model in (trainer.model, trainer.ref_model))
    assert "get_train_dataloader" not in vars(trainer)
