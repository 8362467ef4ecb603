"""TRL ``DPOTrainer`` on image-text preference pairs, padding-free, for Qwen2.5-VL: TRL's vision collator makes padded
rows (every pair's prompt with its images + chosen, then + rejected) with the rows' images concatenated in row order;
the plugin splits every fused log-probability call into its rows — each row's images with it, by its placeholder
runs and the grids — packs them with the family's multimodal collator (per-example mRoPE positions) and scatters the
per-token outputs back. 20 steps of DPO give TRL's padded run within 1e-4 relative per logged value; a call that
cannot be split runs padded; what is not packed yet is refused. Every family's single call, and the swap of two rows'
images: tests/test_trl_vision_families.py."""

from __future__ import annotations

import copy
import functools
import tempfile

import datasets
import pytest
import torch

from padfree_plugins import PadfreeError, accelerate, patch_of
from padfree_plugins.integrations import trl_fused
from padfree_plugins.testing.vision import synthetic_image
from tests.conftest import counted_packings
from tests.test_trl_preference import assert_same_run, differences
from tests.test_vision_trainers import images, model, processor, words
from tests.vision_trl import fused_call

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

STEPS = 20


def pair(index: int, pictures: list) -> dict:
    return {"images": pictures, "prompt": [{"role": "user", "content": words(index, 2 + index % 4)}],
            "chosen": [{"role": "assistant", "content": words(index + 3, 1 + index % 5)}],
            "rejected": [{"role": "assistant", "content": words(index + 5, 1 + (2 * index) % 6)}]}


def preferences(count: int = 16) -> datasets.Dataset:
    """Pairs whose prompts hold 0, 1 or 2 images of 28..84 pixels a side."""
    return datasets.Dataset.from_list([pair(index, images(index)) for index in range(count)])


def trainer_for(train: datasets.Dataset, **settings):
    policy = model()
    options = dict(per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[],
                   seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True,
                   dataloader_pin_memory=False)
    options.update(settings)
    trainer = trl.DPOTrainer(model=policy, ref_model=copy.deepcopy(policy).eval(), train_dataset=train,
                             args=trl.DPOConfig(output_dir=tempfile.mkdtemp(), **options),
                             processing_class=processor())
    assert type(trainer.data_collator).__name__ == "DataCollatorForVisionPreference" and trainer._is_vision_dataset
    return trainer


@pytest.fixture
def media_calls(monkeypatch):
    """What every :func:`trl_fused.pack_media_call` returned: packed (``True``) or left padded (``False``)."""
    return counted_packings(monkeypatch, trl_fused, "pack_media_call")


# -- one fused call ----------------------------------------------------------------------------------------------------
# (the packed call against TRL's padded one, and with two rows' images swapped: tests/test_trl_vision_families.py)

#: Rows with 0, 1, 2 and 1 images.
CALL_PAIRS = [[], [synthetic_image(56, 56, seed=1)], [synthetic_image(56, 56, seed=2), synthetic_image(28, 56, seed=3)],
              [synthetic_image(42, 28, seed=4)]]


def test_a_call_that_cannot_be_split_runs_padded(media_calls):
    """Grids that do not match the rows' placeholders (one grid dropped): no pack, TRL's padded forward (its error)."""
    trainer = trainer_for(datasets.Dataset.from_list([pair(i, p) for i, p in enumerate(CALL_PAIRS)]))
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])
    last = int(batch["image_grid_thw"][-1].prod())
    batch["image_grid_thw"], batch["pixel_values"] = batch["image_grid_thw"][:-1], batch["pixel_values"][:-last]
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    media_calls.clear()
    with pytest.raises(Exception):  # noqa: B017 — the model's own complaint, padded
        fused_call(trainer, batch)
    acceleration.undo()
    assert media_calls == [False]


# -- 20 steps of DPO ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def padded_run() -> list[dict]:
    trainer = trainer_for(preferences())
    trainer.train()
    return trainer.state.log_history


def test_dpo_on_image_text_pairs_gives_trls_padded_run(media_calls):
    """20 steps of sigmoid DPO with a reference model: every logged value within 1e-4 relative of TRL's padded run,
    every fused forward (the policy's and the reference model's) packed with its images."""
    want = padded_run()
    trainer = trainer_for(preferences())
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    media_calls.clear()
    trainer.train()
    acceleration.undo()
    assert len(media_calls) == 2 * STEPS and all(media_calls), "a fused forward ran padded"
    assert patch_of(trainer.model) is None and trainer_fused_forward_is_trls(trainer)
    worst = differences(trainer.state.log_history, want)
    print("largest relative differences:", {key: f"{value:.1e}" for key, value in worst.items()})
    assert_same_run(trainer.state.log_history, want)


def trainer_fused_forward_is_trls(trainer) -> bool:
    return all(trl_fused.fused_forward_of(model) is not None for model in (trainer.model, trainer.ref_model))


# -- refusals ----------------------------------------------------------------------------------------------------------


def test_other_fused_plugins_keep_refusing_images():
    """The DPO plugin alone packs image-text calls: a fused trainer patch that does not pack media refuses them."""
    trainer = trainer_for(preferences(4))
    forward = vars(trainer.model)["forward"]

    class TextOnly(trl_fused.FusedTrainerPatch):
        trainer_class = "DPOTrainer"

    from padfree_plugins import assemble

    assembly = assemble(trainer.model, {"task": "causal_lm"})
    try:
        with pytest.raises(PadfreeError, match="does not pack vision-language batches yet"):
            TextOnly.wrap(trainer, assembly)
    finally:
        assembly.undo()
    assert vars(trainer.model)["forward"] == forward


def test_prefix_sharing_on_is_refused_for_image_text_pairs_and_auto_packs_them_whole():
    """A prompt with images is not shared yet (each pair's images and prompt run in both rows): ``on`` is a
    ConfigError at accelerate() that leaves the models as they were; ``auto`` packs every row whole."""
    from padfree_plugins import ConfigError

    trainer = trainer_for(preferences(4))
    forwards = (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"])
    with pytest.raises(ConfigError, match="prefix_sharing: on with DPOTrainer: image-text calls"):
        accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
    assert (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"]) == forwards
    assert patch_of(trainer.model) is None and patch_of(trainer.ref_model) is None
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert acceleration.trainer_patch.shares_prefixes is False
    acceleration.undo()


def test_a_token_budget_for_image_text_pairs_is_refused_and_the_models_left_alone():
    """A budget of image-text pairs is not planned yet (an image's tokens and pixels are not counted): a
    ConfigError at accelerate(), the models as they were."""
    from padfree_plugins import ConfigError

    trainer = trainer_for(preferences(4))
    forwards = (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"])
    with pytest.raises(ConfigError, match="on images with batching.strategy: tokens"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens", "max_tokens_per_batch": 4096}})
    assert (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"]) == forwards
    assert patch_of(trainer.model) is None and "get_train_dataloader" not in vars(trainer)
