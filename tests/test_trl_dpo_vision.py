"""TRL ``DPOTrainer`` on image-text preference pairs, padding-free, for Qwen2.5-VL: TRL's vision collator makes padded
rows (every pair's prompt with its images + chosen, then + rejected) with the rows' images concatenated in row order;
the plugin splits every fused log-probability call into its rows — each row's images with it, by its placeholder
runs and the grids — packs them with the family's multimodal collator (per-example mRoPE positions) and scatters the
per-token outputs back. 20 steps of DPO give TRL's padded run within 1e-4 relative per logged value; a call that
cannot be split runs padded; what is not packed yet is refused; pairs share their prompts, images and all. Every
family's single call, and the swap of two rows' images: tests/test_trl_vision_families.py."""

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
from tests.test_trl_preference import assert_same_run, differences, trained_reference
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
    """Grids that do not match the rows' placeholders (one grid dropped): no pack, said in a warning, and TRL's
    padded forward (its error)."""
    trainer = trainer_for(datasets.Dataset.from_list([pair(i, p) for i, p in enumerate(CALL_PAIRS)]))
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])
    last = int(batch["image_grid_thw"][-1].prod())
    batch["image_grid_thw"], batch["pixel_values"] = batch["image_grid_thw"][:-1], batch["pixel_values"][:-last]
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    media_calls.clear()
    said = pytest.warns(UserWarning, match="runs padded .* cannot be split by row")
    with pytest.raises(Exception), said:  # noqa: B017 — the model's own complaint, padded
        fused_call(trainer, batch)
    acceleration.undo()
    assert media_calls == [False]


# -- 20 steps of DPO ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def padded_run() -> list[dict]:
    return trained_reference(trainer_for(preferences()))


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


def test_image_text_pairs_share_their_prompts_unless_prefix_sharing_is_off():
    """A pair's prompt with its images is held once in the packed row under ``prefix_sharing: on`` and ``auto`` (the
    default), and every row is packed whole under ``off`` (tests/test_vision_prefixes.py compares the values)."""
    trainer = trainer_for(preferences(4))
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(4)])
    for mode, shares in (("on", True), ("auto", True), ("off", False)):
        acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": mode})
        try:
            assert acceleration.trainer_patch.shares_prefixes is shares
            fused_call(trainer, batch)
        finally:
            acceleration.undo()
        calls = acceleration.trainer_patch.calls
        assert (calls.packed, calls.shared) == (1, int(shares)), (mode, calls.describe())


# -- token budgets of image-text pairs --------------------------------------------------------------------------------

#: Budgets under which micro-batches hold 1 to 4 pairs (pairs of 41..90 tokens, 0..15,680 pixels), both binding.
BUDGET = {"strategy": "tokens", "max_tokens_per_batch": 200, "max_pixels_per_batch": 25088}


def budget_config(**batching) -> dict:
    return {"task": "causal_lm", "batching": {**BUDGET, **batching}}


def planned_batches(trainer) -> tuple[list[list[int]], list[dict]]:
    """The accelerated trainer's plan for epoch 0 (pair ids per micro-batch) and its collated micro-batches."""
    loader = trainer.get_train_dataloader()
    sampler = loader.batch_sampler
    sampler = getattr(sampler, "batch_sampler", sampler)
    return sampler.plan(0), list(loader)


def assert_within_budgets(batches: list[dict], collator, tokens: int, pixels: int) -> None:
    """Every collated micro-batch: its real tokens (placeholders counted) and its rows' pixels within the budgets."""
    for batch in batches:
        mask = batch["attention_mask"].bool()
        rows = [ids[keep] for ids, keep in zip(batch["input_ids"], mask)]
        seen = sum(collator.media_pixels({"input_ids": row.tolist(), **own})
                   for row, own in zip(rows, collator.split_call(batch, rows)) if own)
        assert int(mask.sum()) <= tokens and seen <= pixels, (int(mask.sum()), seen)


def test_every_pair_once_an_epoch_and_no_micro_batch_over_either_budget():
    """Every pair in exactly one micro-batch of the epoch; every collated micro-batch within the token budget (image
    placeholders counted) and the pixel budget (each row's images, as often as the rows compute them); micro-batches
    of different numbers of pairs."""
    trainer = trainer_for(preferences())
    acceleration = accelerate(trainer, budget_config())
    plan, batches = planned_batches(trainer)
    collator = acceleration.trainer_patch.heads[0].collator
    acceleration.undo()
    assert sorted(pair for batch in plan for pair in batch) == list(range(16))
    assert len({len(batch) for batch in plan}) > 1 and len(batches) == len(plan)
    assert_within_budgets(batches, collator, BUDGET["max_tokens_per_batch"], BUDGET["max_pixels_per_batch"])


def test_a_budget_that_counts_half_a_pair_is_caught(monkeypatch):
    """The check can fail: sizes that count one row of each pair (half its tokens and pixels) plan micro-batches
    over the budgets, which the collated batches show."""
    from padfree_plugins.integrations.trl_fused import FusedTrainerPatch

    counted = FusedTrainerPatch.image_text_sizes
    monkeypatch.setattr(FusedTrainerPatch, "image_text_sizes",
                        lambda self: tuple(sizes // 2 for sizes in counted(self)))
    trainer = trainer_for(preferences())
    acceleration = accelerate(trainer, budget_config())
    _, batches = planned_batches(trainer)
    collator = acceleration.trainer_patch.heads[0].collator
    acceleration.undo()
    with pytest.raises(AssertionError):
        assert_within_budgets(batches, collator, BUDGET["max_tokens_per_batch"], BUDGET["max_pixels_per_batch"])


def test_token_budget_dpo_on_image_text_pairs_trains_as_trls_padded_run(media_calls):
    """20 steps of micro-batches planned under both budgets: every logged value within 1e-4 of its scale of TRL's
    padded run fed the very same micro-batches, every fused call packed, images and all."""
    from padfree_plugins.batching.sampler import trainer_train_dataloader

    trainer = trainer_for(preferences())
    acceleration = accelerate(trainer, budget_config())
    loads = acceleration.trainer_patch.loads
    media_calls.clear()
    trainer.train()
    acceleration.undo()
    assert len(media_calls) == 2 * STEPS and all(media_calls)
    reference = trainer_for(preferences())
    reference.get_train_dataloader = lambda: trainer_train_dataloader(reference, budget_config(),
                                                                      reference.data_collator, lengths=loads)
    want = trained_reference(reference)
    worst = differences(trainer.state.log_history, want)
    print("largest relative differences:", {key: f"{value:.1e}" for key, value in worst.items()})
    assert_same_run(trainer.state.log_history, want)


BAD_BUDGETS = {
    "pair over the token budget": (dict(max_tokens_per_batch=80), "BatchError",
                                   r"row 2 of DPOTrainer's dataset holds 85 tokens .* never split"),
    "pixels below one pair": (dict(max_pixels_per_batch=12000), "BatchError",
                              r"row 2 of DPOTrainer's dataset holds 12544 pixels .*max_pixels_per_batch=12000"),
    "split": (dict(on_overlong_example="split"), "ConfigError", "cannot cut DPOTrainer's image-text rows"),
}


@pytest.mark.parametrize("batching,error,message", BAD_BUDGETS.values(), ids=BAD_BUDGETS.keys())
def test_bad_budgets_of_image_text_pairs_are_refused_and_the_models_left_alone(batching, error, message):
    import padfree_plugins

    trainer = trainer_for(preferences())
    forwards = (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"])
    with pytest.raises(getattr(padfree_plugins, error), match=message):
        accelerate(trainer, budget_config(**batching))
    assert (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"]) == forwards
    assert patch_of(trainer.model) is None and "get_train_dataloader" not in vars(trainer)


def test_a_pixel_budget_without_images_is_refused():
    """``max_pixels_per_batch`` where no image-text rows are planned (here a text-only trainer): a ConfigError at
    accelerate(), the model as it was."""
    from padfree_plugins import ConfigError
    from tests.test_trl_preference import pairs, policy, tokenizer

    model = policy()
    text = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), train_dataset=pairs(8),
                          processing_class=copy.deepcopy(tokenizer()),
                          args=trl.DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False))
    forward = vars(model)["forward"]
    with pytest.raises(ConfigError, match="plans token budgets without pixels"):
        accelerate(text, budget_config())
    assert vars(model)["forward"] == forward and patch_of(model) is None and "get_train_dataloader" not in vars(text)
