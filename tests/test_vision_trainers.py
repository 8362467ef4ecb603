"""Image-text training through the trainers, padding-free (Qwen2.5-VL): ``accelerate(trainer)`` on HF ``Trainer``
(a dataset of processor outputs) and TRL ``SFTTrainer`` (conversational rows of messages and PIL images, processed at
collate time) trains the padded run's 30-step loss curve within 1e-4 — the vision tower trained or frozen, LoRA on
the language model, gradient checkpointing, TRL's assistant-only and completion-only masks.

Every accelerated run is checked packed (the language model's first decoder layer sees one row ``[1, T]`` with the
boundaries, the vision tower gets the images), its curve checked moving, and ``undo()`` checked to give the trainer
back. TRL refuses its own ``padding_free`` for vision datasets; the packed path here needs no flag.
"""

from __future__ import annotations

import copy
import functools
import tempfile

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments

from padfree_plugins import BatchError, PadfreeError, accelerate, patch_of
from padfree_plugins.integrations.base import TrainerCollator
from padfree_plugins.testing.vision import (
    image_text_example,
    image_text_processor,
    synthetic_image,
    tiny_vision_language_model,
)
from tests.ties import excess_over_flips, flip_shares, recording_token_margins
from tests.vision_trl import QWEN_MARK, chat_template

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

FAMILY = "qwen2_5_vl"
STEPS = 30
#: LoRA on the language model's attention only (the vision tower's are ``qkv`` / ``proj``, and would not match anyway).
LORA_TARGETS = r".*language_model.*\.(q_proj|v_proj)"
WORDS = "a tiny picture of the red square on a green field with some words about it and more".split()
#: A chat template for the tiny processor: ``role: content`` lines, an image entry as Qwen-VL writes one (the
#: processor expands its ``<|image_pad|>`` to the image's tokens), the assistant's turn (with its ``</s>``) marked for
#: TRL's assistant-only loss.
CHAT_TEMPLATE = chat_template(QWEN_MARK)


@functools.lru_cache(maxsize=1)
def _built_processor():
    processor = image_text_processor(FAMILY)
    processor.chat_template = CHAT_TEMPLATE
    return processor


def processor():
    """A fresh copy each call: a trainer may mutate its processor, and a shared one would leak into the next test."""
    return copy.deepcopy(_built_processor())


def model(freeze_vision: bool = False):
    model = tiny_vision_language_model(FAMILY, processor(), seed=0).train()
    if freeze_vision:
        model.model.visual.requires_grad_(False)
    return model


def images(index: int) -> list:
    """0, 1 or 2 images of 28..84 pixels a side, every example its own."""
    return [synthetic_image(28 + 14 * ((index + k) % 5), 28 + 14 * ((2 * index + k) % 5), seed=10 * index + k)
            for k in range(index % 3)]


def words(start: int, count: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(count))


# -- HF Trainer on processor outputs ---------------------------------------------------------------------------------


def processed_rows(n: int, labels: bool) -> list[dict]:
    """Processor outputs (``input_ids``, and ``pixel_values`` / ``image_grid_thw`` where there are images), with
    ``labels`` when asked: a prompt prefix and the image tokens -100."""
    image_token = processor().image_token_id
    rows = []
    for index in range(n):
        pictures = images(index)
        marks = " ".join(f"{words(index + k, 2)} <image>" for k in range(len(pictures)))
        text = f"{marks} {words(index, 3 + index % 7)}"
        # every row names the media keys (None without images): Dataset.from_list takes its columns from the first
        row = {"pixel_values": None, "image_grid_thw": None, **image_text_example(processor(), text, pictures),
               "source": "synthetic"}
        if labels:
            prompt = index % 4
            row["labels"] = [-100 if i < prompt or token == image_token else token
                             for i, token in enumerate(row["input_ids"])]
        rows.append(row)
    return rows


def padded_collator(examples: list[dict]) -> dict:
    """The padded reference: input_ids / labels padded right, the attention mask, every example's pixels and grids
    concatenated in example order, and ``mm_token_type_ids`` (0 text, 1 image token, 2 video token) from which
    transformers computes the padded batch's mRoPE positions itself. Without a labels column the labels are the
    input_ids with the image tokens -100 (as the packing collator makes them)."""
    image, video = processor().image_token_id, processor().video_token_id
    pad, longest = processor().tokenizer.pad_token_id, max(len(ex["input_ids"]) for ex in examples)
    ids = torch.full((len(examples), longest), pad)
    labels = torch.full((len(examples), longest), -100)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, ex in enumerate(examples):
        tokens = torch.tensor(ex["input_ids"])
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
        labels[row, : len(tokens)] = (torch.tensor(ex["labels"]) if ex.get("labels") is not None else
                                      tokens.masked_fill(tokens == image, -100))
    types = (ids == image).long() + 2 * (ids == video).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": types * mask}
    media = [ex for ex in examples if ex.get("pixel_values") is not None]
    if media:
        batch["pixel_values"] = torch.cat([torch.tensor(ex["pixel_values"], dtype=torch.float32) for ex in media])
        batch["image_grid_thw"] = torch.cat([torch.tensor(ex["image_grid_thw"]) for ex in media])
    return batch


def hf_trainer(packed: bool, *, labels: bool = True, freeze_vision: bool = False, lora: bool = False, **overrides):
    net = model(freeze_vision)
    if lora:
        net = peft.get_peft_model(net, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=LORA_TARGETS))
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                    learning_rate=3e-3 if lora else 1e-3, logging_steps=1, save_strategy="no", report_to="none",
                    seed=0, disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True)
    settings.update(overrides)
    train = datasets.Dataset.from_list(processed_rows(16, labels))
    # the packed run keeps the trainer's default collator (replaced by accelerate); the padded one gets the reference
    trainer = Trainer(model=net, args=TrainingArguments(**settings), train_dataset=train,
                      data_collator=None if packed else padded_collator)
    return trainer


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def language_model_layer(trainer) -> torch.nn.Module:
    return next(module for name, module in trainer.model.named_modules() if name.endswith("language_model.layers.0"))


def vision_tower(trainer) -> torch.nn.Module:
    return next(module for name, module in trainer.model.named_modules() if name.endswith("model.visual"))


class Watch:
    """What the language model's first decoder layer and the vision tower are called with during ``train()``."""

    def __init__(self, trainer):
        self.rows, self.boundaries, self.images = [], [], 0
        self.hooks = [language_model_layer(trainer).register_forward_pre_hook(self.layer, with_kwargs=True),
                      vision_tower(trainer).register_forward_pre_hook(self.tower, with_kwargs=True)]

    def layer(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.rows.append(hidden.shape[0])
        self.boundaries.append("cu_seq_lens_q" in kwargs)

    def tower(self, module, args, kwargs):
        self.images += len(kwargs["grid_thw"] if "grid_thw" in kwargs else args[1])

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def assert_packed(self) -> None:
        assert len(self.rows) >= STEPS and set(self.rows) == {1} and all(self.boundaries), "not packed"
        assert self.images > 0, "the vision tower never ran: the images were lost on the way"


def train_watched(trainer) -> Watch:
    watch = Watch(trainer)
    try:
        trainer.train()
    finally:
        watch.remove()
    return watch


def assert_same_curve(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    assert want[-1] < want[0] - 0.05, "the reference did not train: the comparison would prove little"
    return max(abs(a - b) for a, b in zip(got, want))


def assert_undone(trainer, acceleration, collator, columns) -> None:
    model = acceleration.assembly.model
    acceleration.undo()
    assert trainer.data_collator is collator and trainer._signature_columns == columns
    assert not {"compute_loss", "prediction_step", "_track_num_input_tokens"} & set(vars(trainer))
    assert patch_of(model) is None and model.config.text_config._attn_implementation == "sdpa"


HF_CURVES = {"vision-trained": {}, "vision-frozen-labels-from-input-ids": dict(freeze_vision=True, labels=False),
             "lora": dict(lora=True), "checkpointing": dict(activation_checkpointing=True)}


@functools.lru_cache(maxsize=None)
def padded_hf_run(variant: str) -> tuple[list[float], int]:
    """The padded reference run of ``HF_CURVES[variant]``: its losses and the images its vision tower saw."""
    padded = hf_trainer(False, **HF_CURVES[variant])
    watch = train_watched(padded)
    assert set(watch.rows) == {4} and not any(watch.boundaries), "the reference must be padded"
    return losses(padded), watch.images


@pytest.mark.parametrize("variant", HF_CURVES)
def test_hf_trainer_trains_the_padded_image_text_curve(variant):
    """HF Trainer on processor outputs (some rows without images; pixel_values stored by datasets as nested lists),
    ``remove_unused_columns`` at its default (a string column removed, the media kept): 30 steps padded with the
    reference collator, then accelerated — the curves within 1e-4 (measured: within 1.5e-6)."""
    settings = HF_CURVES[variant]
    want, images_seen = padded_hf_run(variant)
    trainer = hf_trainer(True, **settings)
    collator, columns = trainer.data_collator, trainer._signature_columns
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert acceleration.trainer_patch.kind == "hf"
    assert acceleration.assembly.describe()["collator"] == "MultimodalCollator"
    assert {"pixel_values", "image_grid_thw"} <= set(trainer._signature_columns)
    if settings.get("freeze_vision"):
        assert not any(p.requires_grad for p in vision_tower(trainer).parameters())
    watch = train_watched(trainer)
    watch.assert_packed()
    assert watch.images == images_seen, "the packed run saw other images than the padded one"
    if settings.get("activation_checkpointing"):
        assert trainer.model.is_activation_checkpointing
    assert_same_curve(losses(trainer), want)
    assert_undone(trainer, acceleration, collator, columns)


@pytest.mark.parametrize("break_it", ["images-shifted", "text-positions-for-images"])
def test_a_misaligned_pack_fails_the_comparison(break_it):
    """The curve comparison above would catch a misaligned pack through the trainer: the packed pixels shifted by
    one merged cell (4 rows; 1.6e-2 off the padded curve), or the image tokens given the text positions on all three
    rotary axes instead of their grid's (5.6e-4 off)."""
    want, _ = padded_hf_run("vision-trained")
    trainer = hf_trainer(True)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    if break_it == "text-positions-for-images":
        acceleration.assembly.collator.positions = None
    else:
        collator = trainer.data_collator.collator

        def shifted(rows):
            batch = collator(rows)
            if "pixel_values" in batch:
                batch["pixel_values"] = batch["pixel_values"].roll(4, 0)
            return batch

        trainer.data_collator.collator = shifted
    trainer.train()
    with pytest.raises(AssertionError):
        assert_same_curve(losses(trainer), want)
    acceleration.undo()


# -- TRL SFTTrainer on conversational image-text rows ----------------------------------------------------------------


def conversations(n: int, prompt_completion: bool = False) -> datasets.Dataset:
    """``messages`` (a user turn, an assistant turn) or ``prompt`` / ``completion``, and ``images`` (0..2 PIL
    images, which TRL's collator puts before the first user text)."""
    rows = []
    for index in range(n):
        user, assistant = words(index, 2 + index % 5), words(index + 3, 2 + (index * 3) % 7)
        if prompt_completion:
            row = {"prompt": [{"role": "user", "content": user}],
                   "completion": [{"role": "assistant", "content": assistant}]}
        else:
            row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
        rows.append({**row, "images": images(index)})
    return datasets.Dataset.from_list(rows)


def sft_trainer(packed: bool, *, lora: bool = False, prompt_completion: bool = False, eval_rows: int = 0,
                **overrides):
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                    per_device_eval_batch_size=3, learning_rate=3e-3 if lora else 1e-3, logging_steps=1,
                    save_strategy="no", report_to="none", seed=0, disable_tqdm=True, dataloader_pin_memory=False,
                    use_cpu=True, bf16=False)  # TRL's default max_length (1024) kept: it truncates nothing here
    settings.update(overrides)
    peft_config = (peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)
                   if lora else None)
    trainer = trl.SFTTrainer(model=model(), args=trl.SFTConfig(**settings),
                             train_dataset=conversations(16, prompt_completion), processing_class=processor(),
                             eval_dataset=conversations(eval_rows, prompt_completion) if eval_rows else None,
                             peft_config=peft_config)
    assert type(trainer.data_collator).__name__ == "DataCollatorForVisionLanguageModeling"
    return trainer


SFT_CURVES = {"full": dict(eval_rows=5), "lora": dict(lora=True), "assistant-only": dict(assistant_only_loss=True),
              "prompt-completion": dict(prompt_completion=True)}


@pytest.mark.parametrize("settings", SFT_CURVES.values(), ids=SFT_CURVES.keys())
def test_sft_trainer_trains_trls_padded_image_text_curve(settings):
    """TRL SFTTrainer on conversational rows with PIL images, TRL's own vision collator, its default gradient
    checkpointing: 30 steps padded (TRL's run), then accelerated — each example processed alone by TRL's collator
    and packed — the curves (and the eval loss) within 1e-4. With LoRA on the language model's q / v projections,
    TRL's assistant-only loss (``{% generation %}`` in the template) and a prompt-completion dataset (completion-only
    loss). Measured: within 1.5e-6."""
    padded = sft_trainer(False, **settings)
    with recording_token_margins(padded.model) as margins:
        reference = train_watched(padded)
    assert set(reference.rows) == {4} and not any(reference.boundaries), "TRL's run must be padded"
    trainer = sft_trainer(True, **settings)
    collator, columns = trainer.data_collator, trainer._signature_columns
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert acceleration.trainer_patch.kind == "sft"
    assert trainer.args.padding_free is False
    watch = train_watched(trainer)
    watch.assert_packed()
    assert watch.images == reference.images, "the packed run saw other images than TRL's"
    assert trainer.model.is_activation_checkpointing  # TRL's default
    assert_same_curve(losses(trainer), losses(padded))
    logged = [[entry for entry in run.state.log_history if "loss" in entry] for run in (padded, trainer)]
    for want, got in zip(*logged):  # TRL's metrics, as TRL records them padded
        assert got["num_tokens"] == want["num_tokens"] > 0
        assert got["entropy"] == pytest.approx(want["entropy"], abs=1e-4)
    # the token accuracy: equal but for the tokens whose label margin (padded) lies within rounding
    shares = flip_shares([torch.cat(rows) for rows in margins], len(margins) // len(logged[0]))
    accuracies = [[entry["mean_token_accuracy"] for entry in run] for run in reversed(logged)]
    assert excess_over_flips(*accuracies, shares, "mean_token_accuracy") <= 1e-6
    if settings.get("eval_rows"):
        assert trainer.evaluate()["eval_loss"] == pytest.approx(padded.evaluate()["eval_loss"], abs=1e-5)
    assert_undone(trainer, acceleration, collator, columns)


def test_sft_collator_packs_each_example_as_trl_processes_it_alone():
    """The accelerated collator gives exactly TRL's batch-of-one output per example (tokens, labels with the
    assistant mask, pixels, grids), the padding of TRL's padded batch gone."""
    trainer = sft_trainer(True, assistant_only_loss=True)
    trl_collator = trainer.data_collator
    rows = [trainer.train_dataset[i] for i in range(4)]
    padded = trl_collator([dict(row) for row in rows])
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert isinstance(trainer.data_collator, TrainerCollator)
    batch = trainer.data_collator(rows)
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[-1] == int(padded["attention_mask"].sum()) == batch["input_ids"].shape[1]
    for index, row in enumerate(rows):
        alone = trl_collator([dict(row)])
        tokens = slice(cu[index], cu[index + 1])
        assert batch["input_ids"][0, tokens].tolist() == alone["input_ids"][0].tolist()
        assert batch["labels"][0, tokens].tolist()[1:] == alone["labels"][0].tolist()[1:]  # the first: -100
    assert torch.equal(batch["pixel_values"], padded["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], padded["image_grid_thw"])
    assert (padded["labels"] == -100).sum() > (padded["attention_mask"] == 0).sum(), "no assistant mask"
    acceleration.undo()
    assert trainer.data_collator is trl_collator


# -- bad input ---------------------------------------------------------------------------------------------------------


def text_only_model():
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(processor().tokenizer)),
                                            attn_implementation="sdpa")


def test_images_for_a_text_only_model_are_refused_at_accelerate():
    """Processor outputs for a Llama (no vision plugin): the trainer's column removal would drop the pixels (Llama's
    forward takes none) and train on the image tokens alone; the dataset check refuses them up front."""
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True)
    train = datasets.Dataset.from_list(processed_rows(6, labels=True))
    trainer = Trainer(model=text_only_model(), args=TrainingArguments(**settings), train_dataset=train)
    assert "pixel_values" not in trainer._remove_unused_columns(train).column_names  # what padded training does
    collator = trainer.data_collator
    with pytest.raises(BatchError, match=r"the train dataset holds 'pixel_values', 'image_grid_thw' \(images or "
                                         r"video\), but this model's plugin packs text only"):
        accelerate(trainer, {"task": "causal_lm"})
    assert trainer.data_collator is collator and patch_of(trainer.model) is None


def test_images_for_a_text_only_model_are_refused_at_the_first_batch():
    """Where the dataset cannot be read up front (an on-the-fly transform), the packing collator's own refusal of
    media keys for a text-only plugin fires through the trainer, at the first batch, before any forward."""
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
                    remove_unused_columns=False)
    rows = [{key: value for key, value in row.items() if key != "source"} for row in processed_rows(6, labels=True)]
    train = datasets.Dataset.from_list(rows).with_transform(lambda batch: batch)
    trainer = Trainer(model=text_only_model(), args=TrainingArguments(**settings), train_dataset=train)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    with pytest.raises(BatchError, match=r"carries 'pixel_values', 'image_grid_thw' \(images or video\), but this "
                                         "model's plugin packs text only"):
        trainer.train()
    acceleration.undo()


def test_sft_images_for_a_text_only_model_are_refused():
    """TRL takes a Llama with a processor (it looks only at the processing class); accelerate refuses, naming the
    plugin, before anything changes."""
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
                    bf16=False, max_length=None)
    trainer = trl.SFTTrainer(model=text_only_model(), args=trl.SFTConfig(**settings), train_dataset=conversations(4),
                             processing_class=processor())
    collator = trainer.data_collator
    with pytest.raises(PadfreeError, match="holds images .* but the llama plugin packs text only"):
        accelerate(trainer, {"task": "causal_lm"})
    assert trainer.data_collator is collator and patch_of(trainer.model) is None


def test_a_custom_vision_collator_is_refused():
    """A subclass of TRL's vision collator may build other features: refused like any custom collator."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    class Mine(DataCollatorForVisionLanguageModeling):
        pass

    trainer = sft_trainer(True, max_steps=1)
    trainer.data_collator = Mine(processor())
    with pytest.raises(PadfreeError, match="data_collator is .*Mine"):
        accelerate(trainer, {"task": "causal_lm"})
