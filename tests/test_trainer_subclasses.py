"""``Trainer`` subclasses that run forwards of their own on the packed batch see what they see padded.

The ``causal_lm`` task trims the LM head to the labelled positions (``labelled_logits_only``), but only in the
plugin's own loss call: a second forward in ``training_step`` (a z-loss) and a ``compute_loss`` that reads
``outputs.logits`` get every position's logits, and train the padded run's curve with the padded run's extra values.
Each comparison runs the same subclass twice on the same tiny Llama (same seed, data order, dropout 0): padded with
its usual collator, and padding-free after ``accelerate``.
"""

from __future__ import annotations

import pickle
import tempfile

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from padfree_plugins import accelerate
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.packing.labelled_logits import (
    HELD_KEY,
    hold_labelled_logits,
    take_labelled_logits,
    with_labelled_logits,
)
from tests.conftest import tiny_config
from tests.test_trainer import losses, padded_collator, rows

STEPS = 8
#: The weight of the extra term in the loss (large enough to move the curve).
WEIGHT = 1e-2


def z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean squared log-partition of the positions whose next token has a label (``logits[:, :-1]`` against
    ``labels[:, 1:]``, as a user writes it for a padded batch)."""
    mask = labels[:, 1:] != -100
    return torch.logsumexp(logits[:, :-1][mask].float(), dim=-1).pow(2).mean()


class ZLossTrainer(Trainer):
    """A second forward on the batch in ``training_step``, for a z-loss term."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extras: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            extra = z_loss(model(**inputs).logits, inputs["labels"])
        self.accelerator.backward(WEIGHT * extra / self.current_gradient_accumulation_steps)
        self.extras.append(extra.item())
        return loss + WEIGHT * extra.detach() / self.current_gradient_accumulation_steps


class OutputsInStepTrainer(Trainer):
    """``training_step`` of its own that reads the logits ``compute_loss(..., return_outputs=True)`` returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extras: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
            extra = z_loss(outputs.logits, inputs["labels"])
        total = loss + WEIGHT * extra
        self.accelerator.backward(total)
        self.extras.append(extra.item())
        return total.detach()


class OutputsInLossTrainer(Trainer):
    """``compute_loss`` of its own: ``super().compute_loss(..., return_outputs=True)``, then its ``outputs.logits``
    against the labels (trained through the generic plugin, ``any_trainer``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extras: list[float] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        extra = z_loss(outputs.logits, inputs["labels"])
        if model.training:
            self.extras.append(extra.item())
        loss = loss + WEIGHT * extra
        return (loss, outputs) if return_outputs else loss


SUBCLASSES = {"second forward in training_step": (ZLossTrainer, "hf"),
              "outputs of compute_loss in training_step": (OutputsInStepTrainer, "hf"),
              "outputs of super().compute_loss": (OutputsInLossTrainer, "any")}


def make(cls: type = Trainer, packed: bool = False, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2), attn_implementation="sdpa")
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                    per_device_eval_batch_size=5, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                    report_to="none", seed=0, disable_tqdm=True, dataloader_pin_memory=False,
                    include_num_input_tokens_seen="non_padding")
    settings.update(overrides)
    trainer = cls(model=model, args=TrainingArguments(**settings), train_dataset=datasets.Dataset.from_list(rows()),
                  eval_dataset=datasets.Dataset.from_list(rows(13, seed=1)), data_collator=padded_collator())
    acceleration = accelerate(trainer, {"task": "causal_lm"}) if packed else None
    return trainer, acceleration


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("cls,kind", SUBCLASSES.values(), ids=SUBCLASSES.keys())
def test_a_subclass_reading_every_logit_trains_the_padded_curve(cls, kind, accumulation):
    padded, _ = make(cls, gradient_accumulation_steps=accumulation)
    padded.train()
    packed, acceleration = make(cls, packed=True, gradient_accumulation_steps=accumulation)
    assert acceleration.trainer_patch.kind == kind
    packed.train()
    assert len(packed.extras) == len(padded.extras) == STEPS * accumulation
    torch.testing.assert_close(torch.tensor(packed.extras), torch.tensor(padded.extras), atol=1e-5, rtol=1e-6)
    assert len(losses(packed)) == STEPS
    torch.testing.assert_close(torch.tensor(losses(packed)), torch.tensor(losses(padded)), atol=1e-5, rtol=0)
    assert packed.state.num_input_tokens_seen == padded.state.num_input_tokens_seen > 0
    assert packed.evaluate()["eval_loss"] == pytest.approx(padded.evaluate()["eval_loss"], abs=1e-5)


class RelabellingTrainer(Trainer):
    """``training_step`` of its own that hands ``Trainer.training_step`` the batch with other labels (even tokens
    get no loss): the positions held for the collated labels must not reach that loss."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        labels = inputs["labels"].masked_fill(inputs["input_ids"] % 2 == 0, -100)
        return super().training_step(model, {**inputs, "labels": labels}, num_items_in_batch)


def test_a_batch_with_other_labels_gets_no_held_positions():
    padded, _ = make(RelabellingTrainer)
    padded.train()
    packed, _ = make(RelabellingTrainer, packed=True)
    packed.train()
    torch.testing.assert_close(torch.tensor(losses(packed)), torch.tensor(losses(padded)), atol=1e-5, rtol=0)


def test_held_labelled_logits_are_taken_out_and_put_back():
    labels = torch.tensor([[-100, -100, 5, 6, -100, -100, 7]])
    batch = hold_labelled_logits(PackedBatch(input_ids=torch.zeros(1, 7, dtype=torch.long), labels=labels))
    batch.model_keys = ("labels",)
    assert set(batch) == {"input_ids", "labels", HELD_KEY}
    assert batch[HELD_KEY]["logits_to_keep"].tolist() == [1, 2, 5]
    assert batch[HELD_KEY]["shift_labels"].tolist() == [[5, 6, 7]]
    kept, held = take_labelled_logits(batch)
    assert type(kept) is PackedBatch and kept.model_keys == ("labels",) and set(kept) == {"input_ids", "labels"}
    assert held is batch[HELD_KEY] and HELD_KEY in batch  # the collated batch itself is left as it was
    assert take_labelled_logits(kept) == (kept, None)
    assert set(with_labelled_logits(kept, held)) == {"input_ids", "labels", "logits_to_keep", "shift_labels"}
    assert HELD_KEY not in hold_labelled_logits({"input_ids": torch.zeros(1, 3)})  # no labels: nothing held


def lm_head_rows(trainer) -> tuple[list[int], object]:
    seen: list[int] = []
    hook = trainer.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[-2]))
    return seen, hook


@pytest.mark.parametrize("cls", [Trainer, ZLossTrainer], ids=["Trainer", "second forward in training_step"])
def test_the_plugins_own_loss_still_projects_only_labelled_positions(cls):
    """The optimisation is not lost: the LM head of the plugin's loss call sees the labelled positions alone; the
    subclass's own forward sees every token of the row."""
    trainer, _ = make(cls, packed=True, max_steps=3, train_sampling_strategy="sequential")
    assert trainer.data_collator.labelled_logits
    seen, hook = lm_head_rows(trainer)
    try:
        trainer.train()
    finally:
        hook.remove()
    batches = [trainer.data_collator(trainer.train_dataset.select(range(4 * i, 4 * i + 4)).to_list()) for i in range(3)]
    labelled = [int(batch[HELD_KEY]["logits_to_keep"].numel()) for batch in batches]
    tokens = [int(batch["input_ids"].shape[-1]) for batch in batches]
    assert all(k < 0.9 * t for k, t in zip(labelled, tokens))
    want = labelled if cls is Trainer else [n for k, t in zip(labelled, tokens) for n in (k, t)]
    assert seen == want


def test_a_packed_batch_hands_user_code_no_labelled_logit_keys():
    """What ``training_step`` gets carries neither ``logits_to_keep`` nor ``shift_labels`` nor the held key, and the
    collator's batch (held key included) survives pickling for DataLoader workers."""
    given = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            given.append(set(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    trainer, acceleration = make(Recording, packed=True, max_steps=1)
    trainer.train()
    assert given and not given[0] & {"logits_to_keep", "shift_labels", HELD_KEY}
    assert "labels" in given[0]
    collator = pickle.loads(pickle.dumps(trainer.data_collator))
    batch = pickle.loads(pickle.dumps(collator(rows(3))))
    assert set(batch[HELD_KEY]) == {"logits_to_keep", "shift_labels"}
    acceleration.undo()
    assert "training_step" not in vars(trainer)
