"""TRL ``DPOTrainer`` on image-text pairs, padding-free, for every vision-language family: the Qwen families (grids;
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE, whose language model is a hybrid),
Gemma 3 (a fixed number of soft tokens per image, bidirectional among themselves, ``token_type_ids``), Idefics3 and
SmolVLM (tiles batched per row with their pixel masks, padded with all-zero tiles), LLaVA-OneVision (any-resolution
patches per image, ``image_sizes``, ``batch_num_images`` for rows with images only).

TRL's vision collator makes padded rows (each pair's prompt with its images + chosen, then + rejected), every row's
media given together as the processor makes them for a batch. Each fused call is split into its rows by the family's
own ``split_call`` and packed by its multimodal collator. One call with rows of 0, 1, 2 and 1 images gives TRL's
padded log-probabilities and entropy (1e-5) and gradients (1e-4), and fails that comparison with two rows' images
swapped (:func:`~padfree_plugins.testing.faults.rows_swap_media`); 20 steps of sigmoid DPO with a reference model give
TRL's padded run within 1e-4 of each logged value's scale, every fused call packed — also with gradient accumulation
2 and LoRA.
"""

from __future__ import annotations

import copy
import functools
import tempfile

import datasets
import pytest
import torch

from padfree_plugins import accelerate
from padfree_plugins.integrations import trl_fused
from padfree_plugins.testing.faults import rows_swap_media
from padfree_plugins.testing.vision import synthetic_image
from tests import vision_trl
from tests.conftest import counted_packings
from tests.vision_trl import fused_call
from tests.test_trl_preference import assert_same_run, differences, trained_reference

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

STEPS = 20
#: Every vision-language family (Qwen3.5's language model a gated-DeltaNet hybrid; Qwen3-VL-MoE and Qwen3.5-MoE with
#: routed experts).
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "idefics3",
            "smolvlm", "llava_onevision")
#: Rows with 0, 1, 2 and 1 images: the images of pairs 1 and 3 have one size and other pixels (swappable).
CALL_PAIRS = [[], [synthetic_image(56, 56, seed=1)], [synthetic_image(56, 56, seed=2), synthetic_image(28, 56, seed=3)],
              [synthetic_image(56, 56, seed=4)]]


@pytest.fixture
def media_calls(monkeypatch):
    """What every :func:`trl_fused.pack_media_call` returned: packed (``True``) or left padded (``False``)."""
    return counted_packings(monkeypatch, trl_fused, "pack_media_call")


def trainer_for(family: str, train: datasets.Dataset, lora: bool = False, **settings):
    policy = vision_trl.model(family)
    options = dict(per_device_train_batch_size=4, max_steps=STEPS, learning_rate=3e-3 if lora else 1e-3,
                   logging_steps=1, report_to=[], seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False,
                   disable_tqdm=True, dataloader_pin_memory=False)
    options.update(settings)
    extra = {}
    if lora:
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                               target_modules=r".*language_model.*\.(q_proj|v_proj)")
    trainer = trl.DPOTrainer(model=policy, ref_model=None if lora else copy.deepcopy(policy).eval(),
                             train_dataset=train, args=trl.DPOConfig(output_dir=tempfile.mkdtemp(), **options),
                             processing_class=vision_trl.processor(family), **extra)
    assert type(trainer.data_collator).__name__ == "DataCollatorForVisionPreference" and trainer._is_vision_dataset
    return trainer


def preferences(count: int = 16) -> datasets.Dataset:
    """Pairs whose prompts hold 0, 1 or 2 images of 28..84 pixels a side."""
    return datasets.Dataset.from_list([vision_trl.pair(index, vision_trl.images(index)) for index in range(count)])


@pytest.mark.parametrize("swap", [False, True], ids=["exact", "images-swapped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_packed_fused_call_gives_trls_padded_one(family, swap, media_calls):
    """A padded DPO batch (4 pairs: 8 rows with 0, 1, 2 and 1 images): the packed fused call gives TRL's padded
    log-probabilities and entropy (1e-5) and gradients, the vision tower's too (1e-4); with two rows' images swapped
    in the split, the call still packs and the comparison fails."""
    trainer = trainer_for(family, datasets.Dataset.from_list([vision_trl.pair(i, p) for i, p in enumerate(CALL_PAIRS)]))
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])
    assert (batch["attention_mask"] == 0).any()
    want, want_grads = fused_call(trainer, batch)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert acceleration.trainer_plugin == "trl_dpo"
    head = acceleration.trainer_patch.heads[0]
    media_calls.clear()
    seen = []
    layer = next(module for name, module in trainer.model.named_modules()
                 if name.endswith(("language_model.layers.0", "text_model.layers.0")))
    hook = layer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[0] == 1 and
                                                 "cu_seq_lens_q" in kwargs), with_kwargs=True)
    try:
        if swap:
            with rows_swap_media(head.collator) as swapped:
                got, grads = fused_call(trainer, batch)
            assert swapped == [1]
        else:
            got, grads = fused_call(trainer, batch)
    finally:
        hook.remove()
        acceleration.undo()
    assert media_calls == [True] and seen and all(seen), "the fused call ran padded"
    if swap:
        assert float((got["log_probs"] - want["log_probs"]).abs().max()) > 1e-3
        return
    print("largest differences:", {key: float((got[key] - want[key]).abs().max()) for key in want},
          "gradients:", max(float((grads[name] - want_grads[name]).abs().max()) for name in want_grads))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    tower = ("visual", "vision_tower", "vision_model")
    assert grads.keys() == want_grads.keys() and any(part in name for name in grads for part in tower)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], atol=1e-4, rtol=0, msg=name)


@functools.lru_cache(maxsize=None)
def padded_run(family: str, **settings) -> list[dict]:
    return trained_reference(trainer_for(family, preferences(), **settings))


RUNS = {"gemma3": ("gemma3", {}), "smolvlm": ("smolvlm", {}), "llava_onevision": ("llava_onevision", {}),
        "gemma3-accumulation2-lora": ("gemma3", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2,
                                                 "lora": True})}


@pytest.mark.parametrize("family,settings", RUNS.values(), ids=RUNS.keys())
def test_dpo_on_image_text_pairs_gives_trls_padded_run(family, settings, media_calls):
    """20 steps of sigmoid DPO with a reference model (LoRA: the adapter disabled): every logged value within 1e-4
    of its scale of TRL's padded run, every fused forward (the policy's and the reference's) packed, images and all."""
    want = padded_run(family, **settings)
    trainer = trainer_for(family, preferences(), **settings)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    media_calls.clear()
    trainer.train()
    acceleration.undo()
    calls = 2 * STEPS * settings.get("gradient_accumulation_steps", 1)
    assert len(media_calls) == calls and all(media_calls), "a fused forward ran padded"
    worst = differences(trainer.state.log_history, want)
    print("largest relative differences:", {key: f"{value:.1e}" for key, value in worst.items()})
    assert_same_run(trainer.state.log_history, want)


# -- videos (Qwen) -------------------------------------------------------------------------------------------------


def padded_call(model, examples: list[dict]) -> tuple[dict, torch.Tensor]:
    """A right-padded fused call of ``examples`` (the processor's outputs) as a custom collator would give it: every
    row's media concatenated in row order, the per-token modalities, the second half of every row labelled."""
    from tests.test_vision_language import token_types

    width = max(len(example["input_ids"]) for example in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, example in enumerate(examples):
        ids[row, :len(example["input_ids"])] = torch.tensor(example["input_ids"])
        mask[row, :len(example["input_ids"])] = 1
    call = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": token_types(model, ids) * mask}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        values = [torch.as_tensor(example[key]) for example in examples if key in example]
        if values:
            call[key] = torch.cat(values)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : width // 2] = -100
    labels[call["mm_token_type_ids"] != 0] = -100
    return call, labels


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_fused_call_with_videos_packs_as_trls_padded_one(family, media_calls):
    """Rows with a video (Qwen2.5-VL: one run of placeholders and its seconds per temporal patch; Qwen3-VL: frame by
    frame after timestamps), an image, text only and another video: the packed call gives TRL's padded
    log-probabilities (1e-5); two rows' videos swapped fail it."""
    from trl.trainer import utils as trl_utils

    from padfree_plugins import assemble
    from padfree_plugins.integrations.trl_fused import PackedFusedHead, media_collator
    from padfree_plugins.testing.vision import (
        image_text_example,
        image_text_processor,
        synthetic_video_example,
        tiny_vision_language_model,
    )

    processor = image_text_processor(family)
    model = tiny_vision_language_model(family, processor).train()
    config = model.config
    examples = [synthetic_video_example(processor, config, "a clip <image> and its words", frames=4, height=2,
                                        width=4, seed=1),
                image_text_example(processor, "a picture <image> of words", [synthetic_image(56, 84, 2)]),
                image_text_example(processor, "no image here, only words and more words"),
                synthetic_video_example(processor, config, "another <image> clip", frames=4, height=2, width=4,
                                        seed=3)]
    call, labels = padded_call(model, examples)
    trl_utils.add_fused_lm_head(model)
    want = model(**call, labels=labels, fused_lm_head=True, use_cache=False).log_probs
    assembly = assemble(model, {"task": "causal_lm"})
    head = PackedFusedHead.install(model, media_collator(assembly))
    try:
        media_calls.clear()
        got = model(**call, labels=labels, fused_lm_head=True, use_cache=False).log_probs
        with rows_swap_media(head.collator) as swapped:
            wrong = model(**call, labels=labels, fused_lm_head=True, use_cache=False).log_probs
    finally:
        head.remove()
        assembly.undo()
    assert media_calls == [True, True] and swapped == [1]
    print("largest difference:", float((got - want).abs().max()))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float((wrong - want).abs().max()) > 1e-3
