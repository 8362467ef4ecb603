"""Token budgets of image-text examples in HF ``Trainer`` and TRL ``SFTTrainer`` (Qwen2.5-VL): a budget counts
image placeholders as tokens, and ``batching.max_pixels_per_batch`` bounds the pixels the vision tower embeds per
micro-batch — both kept. TRL's raw vision rows (``messages`` + ``images``, processed at collate time) are counted
once at ``accelerate()`` by TRL's own collator on each row alone; a dataset of processor outputs is counted from its
rows. Every example once an epoch, no packed micro-batch over either budget, the curve of TRL's padded run on the
same micro-batches; a count of half of each example's pixels is caught; an example over either budget is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from padfree_plugins import BatchError, accelerate, patch_of
from padfree_plugins.batching.sampler import trainer_train_dataloader
from padfree_plugins.packing.multimodal import MultimodalCollator
from tests.test_vision_trainers import STEPS, assert_same_curve, hf_trainer, losses, sft_trainer

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

#: Micro-batches of 2 to 8 examples (23..50 tokens, 0..7,840 pixels each); the pixel budget binds where images meet.
BUDGET = {"strategy": "tokens", "max_tokens_per_batch": 160, "max_pixels_per_batch": 15680}
PATCH_AREA = 14 * 14


def budget_config(**batching) -> dict:
    return {"task": "causal_lm", "batching": {**BUDGET, **batching}}


def micro_batches(trainer) -> tuple[list[list[int]], list[dict]]:
    loader = trainer.get_train_dataloader()
    sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
    return sampler.plan(0), list(loader)


def within_budgets(batches: list[dict], tokens: int, pixels: int) -> bool:
    """Every packed micro-batch's tokens (placeholders counted) and pixels (grid cells × patch) within budget."""
    return all(batch["input_ids"].numel() <= tokens and
               int(batch.get("image_grid_thw", torch.zeros(0, 3)).prod(-1).sum()) * PATCH_AREA <= pixels
               for batch in batches)


@pytest.mark.parametrize("kind", ["sft", "hf"])
def test_every_example_once_and_no_micro_batch_over_either_budget(kind):
    trainer = sft_trainer(True) if kind == "sft" else hf_trainer(True)
    acceleration = accelerate(trainer, budget_config())
    assert acceleration.trainer_patch.budgets_pixels and acceleration.trainer_patch.loads is not None
    plan, batches = micro_batches(trainer)
    acceleration.undo()
    assert sorted(item for batch in plan for item in batch) == list(range(16))
    assert kind == "hf" or len({len(batch) for batch in plan}) > 1
    assert within_budgets(batches, BUDGET["max_tokens_per_batch"], BUDGET["max_pixels_per_batch"])


def test_a_count_of_half_the_pixels_is_caught(monkeypatch):
    """The check can fail: pixels counted half plan micro-batches over the pixel budget."""
    counted = MultimodalCollator.media_pixels
    monkeypatch.setattr(MultimodalCollator, "media_pixels", lambda self, example: counted(self, example) // 2)
    trainer = sft_trainer(True)
    acceleration = accelerate(trainer, budget_config())
    _, batches = micro_batches(trainer)
    acceleration.undo()
    assert not within_budgets(batches, BUDGET["max_tokens_per_batch"], BUDGET["max_pixels_per_batch"])


def test_sft_under_both_budgets_trains_trls_padded_curve_on_the_same_micro_batches():
    """``STEPS`` steps of planned micro-batches: TRL's padded run (its vision collator) fed the same micro-batches
    gives the same loss curve (1e-4)."""
    trainer = sft_trainer(True)
    acceleration = accelerate(trainer, budget_config())
    loads = acceleration.trainer_patch.loads
    trainer.train()
    acceleration.undo()
    reference = sft_trainer(False)
    reference.get_train_dataloader = lambda: trainer_train_dataloader(reference, budget_config(),
                                                                      reference.data_collator, lengths=loads)
    reference.train()
    print("largest difference:", assert_same_curve(losses(trainer), losses(reference)))
    assert len(losses(trainer)) == STEPS


def test_raw_rows_are_counted_by_trls_own_processing_without_a_pixel_budget():
    """Without ``max_pixels_per_batch`` the raw rows are still counted (they hold no token ids): tokens only."""
    trainer = sft_trainer(True)
    acceleration = accelerate(trainer, budget_config(max_pixels_per_batch=None))
    loads = np.asarray(acceleration.trainer_patch.loads)
    assert not acceleration.trainer_patch.budgets_pixels
    _, batches = micro_batches(trainer)
    acceleration.undo()
    assert loads.min() > 0 and all(batch["input_ids"].numel() <= BUDGET["max_tokens_per_batch"] for batch in batches)


@pytest.mark.parametrize("batching,message", [
    (dict(max_pixels_per_batch=5000), r"row 2 of SFTTrainer's dataset holds 6272 pixels .*max_pixels_per_batch=5000"),
    (dict(max_tokens_per_batch=40), r"row 2 of SFTTrainer's dataset holds 50 tokens .*max_tokens_per_batch=40"),
], ids=["pixels below one example", "tokens below one example"])
def test_an_example_over_either_budget_is_refused_and_the_trainer_left_alone(batching, message):
    trainer = sft_trainer(True)
    collator = trainer.data_collator
    with pytest.raises(BatchError, match=message):
        accelerate(trainer, budget_config(**batching))
    assert trainer.data_collator is collator and patch_of(trainer.model) is None
    assert "get_train_dataloader" not in vars(trainer)
