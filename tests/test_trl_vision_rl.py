"""TRL's GRPO, RLOO and KTO trainers on image-text prompts, padding-free: every fused log-probability forward (the
policy's, the reference model's, KTO's KL completions) is split into its rows, each row's images with it, and packed
by the family's multimodal collator; TRL's generation (padded, with the images), rewards, advantages and losses are
untouched. Against TRL's padded run, built the same way, over 20 steps: every logged value within 1e-4 of its scale
(the comparison of tests/test_trl_rl.py and tests/test_trl_preference.py), every fused call packed.

* GRPO (``grpo`` loss, 4 generations, ``beta`` 0.1) and RLOO on Qwen2.5-VL and Gemma 3, prompts with 1 or 2
  images (TRL cannot mix prompts without images into a generation batch); GRPO on Qwen2.5-VL with gradient
  accumulation 2 and LoRA. The tiny models are saved to a directory (TRL builds the reference model from it) with
  their EOS logit scaled up, so that completions end after 1…10 tokens: prompts left-padded, completions
  right-padded, both of many lengths.
* GRPO and RLOO on Qwen2.5-VL whose completions hold generated ``<|video_pad|>`` tokens (one image a prompt,
  left-padded, 8 generations, completions of 1…8 tokens, some clipped, 6 steps): TRL types them text and its forward
  treats them as text; every forward is packed (none padded, no warning), the run equals TRL's.
* KTO with its KL term on Qwen2.5-VL.
* A leak of one token across packed boundaries fails the GRPO comparison.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import shutil
import tempfile
import warnings

import datasets
import pytest
import torch

from padfree_plugins import accelerate
from padfree_plugins.integrations import trl_fused
from padfree_plugins.testing.faults import leak_across_boundaries
from tests import vision_trl
from tests.conftest import counted_packings
from tests.test_trl_preference import assert_same_run as assert_same_offline_run
from tests.test_trl_preference import differences as offline_differences
from tests.test_trl_rl import STEPS, Run, assert_trains, beyond_tolerance, count_fused_calls, differences

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

LORA_TARGETS = r".*language_model.*\.(q_proj|v_proj)"


@pytest.fixture
def media_calls(monkeypatch):
    """What every :func:`trl_fused.pack_media_call` returned: packed (``True``) or left padded (``False``)."""
    return counted_packings(monkeypatch, trl_fused, "pack_media_call")


@functools.lru_cache(maxsize=None)
def model_dir(family: str) -> str:
    """The family's tiny model, its EOS logit scaled ×40 (completions of many lengths), saved."""
    model = vision_trl.model(family)
    eos = vision_trl.processor(family).tokenizer.eos_token_id
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= 40
    path = tempfile.mkdtemp(prefix=f"padfree-trl-vision-{family}-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


def prompts() -> datasets.Dataset:
    """16 prompts of 1…6 words with 1 or 2 images (TRL's GRPO / RLOO cannot mix prompts with and without images in
    one generation batch: its processor call is given ``None`` for the latter, padded or not)."""
    return datasets.Dataset.from_list([vision_trl.prompt(index, vision_trl.images(3 * index + 1 + index % 2))
                                       for index in range(16)])


@functools.lru_cache(maxsize=None)
def video_pad_model_dir() -> str:
    """Qwen2.5-VL's tiny model of :func:`model_dir` whose ``<|video_pad|>`` output row is 0.9 × its EOS row: its
    completions hold generated video placeholders (text to the model: the prompts have images only)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir("qwen2_5_vl"))
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[model.config.video_token_id] = 0.9 * weight[vision_trl.processor("qwen2_5_vl").tokenizer.eos_token_id]
    path = tempfile.mkdtemp(prefix="padfree-trl-vision-video-pad-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


def one_image_prompts() -> datasets.Dataset:
    """16 prompts of 1…6 words, each with one image of its own size (28…70 pixels a side): prompts of many lengths."""
    return datasets.Dataset.from_list([
        vision_trl.prompt(index, [vision_trl.synthetic_image(28 + 14 * (index % 4), 28 + 14 * (index * 3 % 4),
                                                             seed=index)]) for index in range(16)])


#: What :func:`build` trains on: ``mixed``, the tests' usual (prompts with 1 or 2 images, special tokens other than
#: EOS never generated); ``generated video placeholders`` (one image a prompt, :func:`video_pad_model_dir`'s model,
#: which generates ``<|video_pad|>`` tokens in its completions).
SCENARIOS = ("mixed", "generated video placeholders")


def build(kind: str, family: str, output_dir: str, *, lora: bool = False, seen: list | None = None,
          scenario: str = "mixed", **overrides):
    """A GRPO / RLOO trainer on the family's tiny model, seeded; its reward (longer completions are better) records
    the completion ids in ``seen``."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    generated_video = scenario == SCENARIOS[1]
    path = video_pad_model_dir() if generated_video else model_dir(family)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa")
    config_class, trainer_class = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (
        trl.RLOOConfig, trl.RLOOTrainer)

    def length_reward(completions, completion_ids, **kwargs):
        if seen is not None:
            seen.append([tuple(ids) for ids in completion_ids])
        return [len(completion[0]["content"]) / 10 for completion in completions]

    tokenizer = vision_trl.processor(family).tokenizer
    # no image tokens generated: TRL would take them for an image's in its padded forward (and fail)
    allowed = {tokenizer.eos_token_id, model.config.video_token_id} if generated_video else {tokenizer.eos_token_id}
    special = sorted(set(tokenizer.all_special_ids) - allowed)
    settings = dict(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=10, max_steps=STEPS, learning_rate=1e-4, logging_steps=1, report_to=[],
                    seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True,
                    generation_kwargs={"suppress_tokens": special})
    settings.update(overrides)
    extra = {}
    if lora:
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    processor = vision_trl.processor(family)
    # prompts padded left, as TRL pads its prompt ids: the processor's per-token modalities line up with them
    processor.tokenizer.padding_side = "left"
    return trainer_class(model=model, reward_funcs=length_reward, args=config_class(**settings),
                         train_dataset=one_image_prompts() if generated_video else prompts(),
                         processing_class=processor, **extra)


def train(kind: str, family: str, accelerated: bool, media_calls: list | None = None, *, leak: float = 0.0,
          sharing: str = "off", **options) -> Run:
    """``STEPS`` steps, padded or accelerated (``prefix_sharing``: ``sharing``), with a layer leaking ``leak`` across
    boundaries if given."""
    completions: list = []
    run = Run(history=[])
    counter = None
    before = len(media_calls) if media_calls is not None else 0
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build(kind, family, output_dir, seen=completions, **options)
        acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": sharing}) if accelerated else None
        if acceleration is not None:
            assert acceleration.trainer_patch.kind == kind
            assert acceleration.trainer_patch.shares_prefixes == (sharing == "on")
            run.plugin = acceleration.trainer_plugin
        else:
            counter = count_fused_calls(trainer)
        run.has_ref_model = trainer.ref_model is not None
        faulty = leak_across_boundaries(trainer.model, strength=leak) if leak else contextlib.nullcontext()
        with faulty:
            trainer.train()
        if acceleration is not None:
            acceleration.undo()
            run.calls = acceleration.trainer_patch.calls
    run.history = [entry for entry in trainer.state.log_history if "loss" in entry]
    run.completions = completions
    run.fused_calls = counter[0] if counter is not None else 0
    run.packed = list(media_calls[before:]) if media_calls is not None else []
    return run


@functools.lru_cache(maxsize=None)
def padded(kind: str, family: str, **options) -> Run:
    return train(kind, family, False, **options)


CASES = {
    "grpo-qwen2_5_vl": ("grpo", "qwen2_5_vl", dict(loss_type="grpo")),
    "grpo-gemma3": ("grpo", "gemma3", dict(loss_type="grpo")),
    "rloo-qwen2_5_vl": ("rloo", "qwen2_5_vl", {}),
    "rloo-gemma3": ("rloo", "gemma3", {}),
    "grpo-qwen2_5_vl-accumulation2-lora": ("grpo", "qwen2_5_vl", dict(loss_type="grpo", gradient_accumulation_steps=2,
                                                                      lora=True, learning_rate=2e-3)),
}


@pytest.mark.parametrize("kind,family,options", CASES.values(), ids=CASES.keys())
def test_rl_on_image_text_prompts_trains_the_padded_run(kind, family, options, media_calls):
    """20 steps: the same completions, every logged value within 1e-4 of its scale, every fused call packed (the
    calls hold prompts with 1 and 2 images)."""
    want = padded(kind, family, **options)
    got = train(kind, family, True, media_calls, **options)
    assert got.plugin == f"trl_{kind}"
    assert want.fused_calls > 0 and len(got.packed) == want.fused_calls and all(got.packed), \
        f"every fused forward ({want.fused_calls}) must be packed: {got.packed}"
    assert got.completions == want.completions, "completions diverged between the padded and the packed run"
    assert_trains(want)
    worst = differences(got.history, want.history)
    print("largest differences (difference, tolerance):", {key: f"{d:.1e}/{t:.1e}" for key, (d, t) in worst.items()})
    assert beyond_tolerance(got, want) == {}


#: The scenario of :data:`SCENARIOS` ``generated video placeholders``: 6 steps, 8 generations a prompt, completions
#: of 1…8 tokens (some clipped), two prompts a generation (left-padded) split into two calls of 8 rows.
GENERATED_VIDEO = dict(scenario=SCENARIOS[1], num_generations=8, max_completion_length=8, max_steps=6,
                       steps_per_generation=2)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_completions_with_generated_video_placeholders_are_packed(kind, media_calls):
    """Prompts with one image each, left-padded, 8 generations; the model generates ``<|video_pad|>`` in its
    completions. TRL types those tokens text (``mm_token_type_ids`` 0) and its forward, given no video, embeds and
    positions them as text: a well-formed call, which is packed the same way (each such token text). Every fused
    forward packed, none padded, no warning; every logged value of the 6 steps within 1e-4 of its scale."""
    options = dict(GENERATED_VIDEO, **({"loss_type": "grpo"} if kind == "grpo" else {}))
    want = padded(kind, "qwen2_5_vl", **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs padded")
        got = train(kind, "qwen2_5_vl", True, media_calls, **options)
    video_pad = vision_trl.processor("qwen2_5_vl").tokenizer.convert_tokens_to_ids("<|video_pad|>")
    generated = sum(video_pad in ids for batch in want.completions for ids in batch)
    assert generated >= 4, f"too few completions hold a generated <|video_pad|> ({generated}) to test them"
    lengths = {len(ids) for batch in want.completions for ids in batch}
    assert min(lengths) == 1 and max(lengths) == 8 and len(lengths) > 4, lengths
    assert want.fused_calls > 0 and len(got.packed) == want.fused_calls and all(got.packed), got.packed
    assert (got.calls.packed, got.calls.padded) == (want.fused_calls, {})
    assert got.history[-1]["padfree/packed_calls"] == want.fused_calls and got.history[-1]["padfree/padded_calls"] == 0
    assert got.completions == want.completions, "completions diverged between the padded and the packed run"
    worst = differences(got.history, want.history, count=6)
    print("largest differences (difference, tolerance):", {key: f"{d:.1e}/{t:.1e}" for key, (d, t) in worst.items()})
    assert beyond_tolerance(got, want, count=6) == {}


def test_a_leak_across_boundaries_fails_the_grpo_comparison(media_calls):
    """With a layer leaking 1e-3 of the hidden state across packed boundaries, the GRPO comparison fails."""
    want = padded("grpo", "qwen2_5_vl", loss_type="grpo")
    got = train("grpo", "qwen2_5_vl", True, media_calls, leak=1e-3, loss_type="grpo")
    assert got.packed and all(got.packed)
    assert beyond_tolerance(got, want) != {}


# -- KTO ---------------------------------------------------------------------------------------------------------------


def kto_trainer(family: str):
    policy = vision_trl.model(family)
    train_set = datasets.Dataset.from_list([vision_trl.unpaired(index, vision_trl.images(index))
                                            for index in range(16)])
    args = trl.KTOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=STEPS,
                         learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, beta=0.1, save_strategy="no",
                         use_cpu=True, bf16=False, disable_tqdm=True, dataloader_pin_memory=False)
    trainer = trl.KTOTrainer(model=policy, ref_model=copy.deepcopy(policy).eval(), args=args, train_dataset=train_set,
                             processing_class=vision_trl.processor(family))
    assert trainer._is_vision_dataset and trainer.calculate_KL
    return trainer


@functools.lru_cache(maxsize=None)
def padded_kto(family: str) -> list[dict]:
    trainer = kto_trainer(family)
    trainer.train()
    return trainer.state.log_history


def test_kto_on_image_text_examples_gives_trls_padded_run(media_calls):
    """20 steps of KTO with its KL term on Qwen2.5-VL: every logged value within 1e-4 of its scale, every fused
    forward (policy and reference, completions and KL completions) packed."""
    want = padded_kto("qwen2_5_vl")
    trainer = kto_trainer("qwen2_5_vl")
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    media_calls.clear()
    trainer.train()
    acceleration.undo()
    assert len(media_calls) >= 2 * STEPS and all(media_calls), "a fused forward ran padded"
    worst = offline_differences(trainer.state.log_history, want)
    print("largest relative differences:", {key: f"{value:.1e}" for key, value in worst.items()})
    assert_same_offline_run(trainer.state.log_history, want)


def test_a_token_budget_of_image_text_kto_rows_is_refused_with_the_reason():
    """TRL's vision KTO collator makes each KL completion from another row of the micro-batch: a budget cannot count
    a row before planning. A ConfigError at accelerate() that says so, the trainer untouched."""
    from padfree_plugins import ConfigError, patch_of

    trainer = kto_trainer("qwen2_5_vl")
    forward = vars(trainer.model)["forward"]
    with pytest.raises(ConfigError, match="KL completion from another row of the same micro-batch"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens", "max_tokens_per_batch": 400}})
    assert vars(trainer.model)["forward"] == forward and patch_of(trainer.model) is None
    assert "get_train_dataloader" not in vars(trainer)
