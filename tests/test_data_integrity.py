"""Data the packed run would silently train differently from the padded one is caught, named by its dataset row:
rows truncation leaves without a label (dropped with a warning, as TRL drops them); ``position_ids`` /
``cache_position`` other than the collator's own (refused, never replaced); a ``length`` column that is wrong or not
numbers; labels the LM head or the classifier has no logit for; resuming a checkpoint of another batching plan."""

from __future__ import annotations

import json
import os
import tempfile

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from padfree_plugins import BatchError, ConfigError, accelerate, assemble, patch_of
from padfree_plugins.batching.sampler import TokenBudgetBatchSampler
from padfree_plugins.integrations.resume import FINGERPRINT_FILE
from padfree_plugins.packing.collator import PackingCollator
from tests.conftest import tiny_config
from tests.tasks_common import model_for
from tests.test_data_errors import MapRows
from tests.test_trainer import losses, tokenizer

BAD_ROW = 17
VOCAB = 128


def llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2), attn_implementation="sdpa")


def rows(n: int = 40, seed: int = 0, longest: int = 40) -> list[dict]:
    """Causal-LM rows of 4..longest tokens; a random prefix of at most half of each is a prompt (labels -100)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, longest, (1,), generator=generator))
        ids = torch.randint(5, VOCAB, (length,), generator=generator).tolist()
        prompt = int(torch.randint(0, length // 2 + 1, (1,), generator=generator))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def trainer_of(train, model=None, eval_dataset=None, **settings) -> Trainer:
    args = dict(output_dir=tempfile.mkdtemp(), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                dataloader_pin_memory=False)
    args.update(settings)
    return Trainer(model=model or llama(), args=TrainingArguments(**args), train_dataset=train,
                   eval_dataset=eval_dataset,
                   data_collator=DataCollatorForSeq2Seq(tokenizer(), padding=True, label_pad_token_id=-100))


def assert_untouched(trainer: Trainer) -> None:
    """A refusal at ``accelerate()`` left the trainer and its model as they were."""
    assert not {"compute_loss", "prediction_step", "train", "get_train_dataloader"} & set(vars(trainer))
    assert isinstance(trainer.data_collator, DataCollatorForSeq2Seq)
    assert patch_of(trainer.model) is None and trainer.model.config._attn_implementation == "sdpa"
    assert not hasattr(trainer, "_padfree_acceleration")


# -- on_overlong: truncate that erases every label ------------------------------------------------------------------

MAX_LENGTH = 24
#: Rows whose prompt fills max_length: truncation leaves them no label.
PROMPT_ONLY = (3, 11, 20)


def truncation_rows() -> list[dict]:
    examples = rows()
    for row in PROMPT_ONLY:
        ids = examples[row]["input_ids"] = list(range(5, 5 + 36))
        examples[row]["labels"] = [-100] * 30 + ids[30:]
    return examples


def test_rows_whose_labels_truncation_erases_are_dropped_with_a_warning_and_training_equals_padded_without_them():
    examples = truncation_rows()
    evaluation = truncation_rows()[:8]
    train = datasets.Dataset.from_list(examples)
    trainer = trainer_of(train, eval_dataset=evaluation)
    config = {"task": "causal_lm", "max_length": MAX_LENGTH, "on_overlong": "truncate"}
    with pytest.warns(UserWarning) as caught:
        acceleration = accelerate(trainer, config)
    messages = [str(warning.message) for warning in caught]
    assert any(f"examples 3, 11, 20 of the train dataset keep no label once truncated to max_length={MAX_LENGTH}"
               in message and "dropped from training" in message for message in messages), messages
    assert any("example 3 of the eval dataset keeps no label" in message for message in messages), messages
    assert len(trainer.train_dataset) == len(examples) - 3 and len(trainer.eval_dataset) == 7
    trainer.train()
    packed = losses(trainer)
    acceleration.undo()
    assert trainer.train_dataset is train and trainer.eval_dataset is evaluation

    kept = [{key: value[:MAX_LENGTH] for key, value in row.items()} for i, row in enumerate(examples)
            if i not in PROMPT_ONLY]
    reference = trainer_of(datasets.Dataset.from_list(kept))
    reference.train()
    assert len(packed) == len(losses(reference)) == 6
    torch.testing.assert_close(torch.tensor(packed), torch.tensor(losses(reference)), atol=1e-5, rtol=0)


def test_sft_trainer_truncated_by_padfree_equals_trls_own_truncation():
    """TRL's SFTTrainer truncating to max_length drops the rows left without a label; padfree's truncation of an
    untruncated SFTTrainer (TRL's max_length=None) drops the same rows, and trains TRL's padded curve."""
    pytest.importorskip("trl")
    from tests.test_trainer import make_trainer

    train = datasets.Dataset.from_list(truncation_rows())
    reference, _ = make_trainer("sft", packed=False, train=train, max_steps=6, max_length=MAX_LENGTH)
    assert len(reference.train_dataset) == len(train) - len(PROMPT_ONLY)  # TRL dropped them itself
    reference.train()
    trainer, _ = make_trainer("sft", packed=False, train=train, max_steps=6, max_length=None)
    with pytest.warns(UserWarning, match="examples 3, 11, 20 of the train dataset keep no label"):
        accelerate(trainer, {"task": "causal_lm", "max_length": MAX_LENGTH, "on_overlong": "truncate"})
    trainer.train()
    torch.testing.assert_close(torch.tensor(losses(trainer)), torch.tensor(losses(reference)), atol=1e-5, rtol=0)


def test_rows_keeping_a_label_and_untruncated_rows_are_kept():
    """A row that keeps one label past the collator's masked first token stays; without truncation nothing is
    dropped (a prompt-only row then trains as padded: on nothing, as there)."""
    examples = rows()
    examples[5]["input_ids"] = list(range(5, 5 + 36))
    examples[5]["labels"] = [-100] * (MAX_LENGTH - 1) + examples[5]["input_ids"][MAX_LENGTH - 1:]  # one label kept
    trainer = trainer_of(datasets.Dataset.from_list(examples))
    accelerate(trainer, {"task": "causal_lm", "max_length": MAX_LENGTH, "on_overlong": "truncate"}).undo()
    examples[5]["labels"] = [-100] * 36
    trainer = trainer_of(datasets.Dataset.from_list(examples))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert len(trainer.train_dataset) == len(examples)
    acceleration.undo()


def test_the_collator_warns_where_the_dataset_could_not_be_checked():
    """Rows the up-front check cannot read (a map-style dataset): the collator warns, naming the dataset row."""
    trainer = trainer_of(MapRows(truncation_rows()), max_steps=12)
    acceleration = accelerate(trainer, {"task": "causal_lm", "max_length": MAX_LENGTH, "on_overlong": "truncate"})
    try:
        with pytest.warns(UserWarning, match=r"example (3|11|20) of the dataset keeps no label once truncated to "
                                             rf"max_length={MAX_LENGTH}.*trained on nothing"):
            trainer.train()
    finally:
        acceleration.undo()
    collator = PackingCollator(token_keys=("labels",), masked_first_keys=("labels",), max_length=4,
                               on_overlong="truncate")
    with pytest.warns(UserWarning, match=r"example 1 \(by position in this batch\) keeps no label"):
        collator([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
                  {"input_ids": [5, 6, 7, 8, 9], "labels": [-100] * 4 + [9]}])


# -- position_ids / cache_position ------------------------------------------------------------------------------------


def with_positions(examples: list[dict], key: str = "position_ids", start: int = 0) -> list[dict]:
    return [{**row, key: list(range(start, start + len(row["input_ids"])))} for row in examples]


def test_position_ids_as_the_collator_builds_them_are_kept_and_equal_the_padded_forward():
    """Positions 0..L-1 per example (and cache_position 0..L-1) are what the collator builds: accepted, the same
    batch, and the packed logits equal each example's own forward given those positions."""
    model = llama().eval()
    examples = with_positions(with_positions(rows(4)), "cache_position")
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = assembly.collator(examples)
        plain = assembly.collator([{"input_ids": row["input_ids"]} for row in examples])
        assert torch.equal(batch["position_ids"], plain["position_ids"])
        with torch.no_grad():
            packed = model(**batch.model_inputs()).logits[0]
            cu = batch["cu_seq_lens_q"].tolist()
            for i, row in enumerate(examples):
                alone = model(input_ids=torch.tensor([row["input_ids"]]),
                              position_ids=torch.tensor([row["position_ids"]])).logits[0]
                torch.testing.assert_close(packed[cu[i]:cu[i + 1]], alone, atol=1e-5, rtol=0)
    finally:
        assembly.undo()
    trainer = trainer_of(datasets.Dataset.from_list(with_positions(rows())))
    accelerate(trainer, {"task": "causal_lm"}).undo()


@pytest.mark.parametrize("kind", ["arrow", "list"])
@pytest.mark.parametrize("case,message", [
    ("shifted", rf"example {BAD_ROW} of the train dataset carries 'position_ids' that differ from the positions the "
                r"collator builds \(token 0 has 3, not 0\).*Remove the 'position_ids' column"),
    ("longer", rf"example {BAD_ROW} of the train dataset: 'position_ids' has \d+ values but input_ids has \d+ tokens"),
    ("cache_position", rf"example {BAD_ROW} of the train dataset carries 'cache_position' that differ"),
])
def test_other_positions_are_refused_at_accelerate_and_the_trainer_left_alone(kind, case, message):
    key = "cache_position" if case == "cache_position" else "position_ids"
    examples = with_positions(rows(), key)
    length = len(examples[BAD_ROW]["input_ids"])
    examples[BAD_ROW][key] = list(range(3, 3 + length)) if case != "longer" else list(range(length + 5))
    trainer = trainer_of(datasets.Dataset.from_list(examples) if kind == "arrow" else examples)
    with pytest.raises(BatchError, match=message):
        accelerate(trainer, {"task": "causal_lm"})
    assert_untouched(trainer)


def test_other_positions_found_by_the_collator_name_the_dataset_row():
    examples = with_positions(rows())
    examples[BAD_ROW]["position_ids"] = [0] * len(examples[BAD_ROW]["input_ids"])
    trainer = trainer_of(MapRows(examples))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    try:
        with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the dataset carries 'position_ids' that differ "
                                             r"from the positions the collator builds \(token 1 has 0, not 1\)"):
            trainer.train()
    finally:
        acceleration.undo()
    roberta = PackingCollator(position_start=2)  # RoBERTa's positions start at 2: 0..L-1 are not its own
    with pytest.raises(BatchError, match=r"token 0 has 0, not 2\): a packed example's position_ids are always 2, 3"):
        roberta([{"input_ids": [5, 6], "position_ids": [0, 1]}])


# -- the length column ------------------------------------------------------------------------------------------------

BUDGET = 64


def test_a_wrong_length_column_is_refused_at_accelerate_naming_the_first_wrong_row():
    examples = [{**row, "length": len(row["input_ids"])} for row in rows()]
    for row in (BAD_ROW, 30):
        examples[row]["length"] = 3
    trainer = trainer_of(datasets.Dataset.from_list(examples))
    with pytest.raises(BatchError, match=rf"'length' column \(batching.length_column\) says example {BAD_ROW} has 3 "
                                         rf"tokens, but its input_ids hold {len(examples[BAD_ROW]['input_ids'])} "
                                         r"\(2 such example\(s\)\)"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens",
                                                                "max_tokens_per_batch": BUDGET}})
    assert_untouched(trainer)


def test_a_length_column_taken_on_trust_would_break_the_budget():
    """Why the column is checked: lengths of 1 plan micro-batches far over the budget in real tokens."""
    real = np.asarray([len(row["input_ids"]) for row in rows()])
    plan = TokenBudgetBatchSampler(np.ones_like(real), BUDGET).plan()
    assert max(int(real[batch].sum()) for batch in plan) > 2 * BUDGET


def test_a_length_column_of_strings_is_named():
    examples = [{**row, "length": str(len(row["input_ids"]))} for row in rows()]
    trainer = trainer_of(datasets.Dataset.from_list(examples))
    with pytest.raises(BatchError, match=r"the dataset's 'length' column \(batching.length_column\) holds string "
                                         r"values, not token counts: cast it"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens",
                                                                "max_tokens_per_batch": BUDGET}})
    assert_untouched(trainer)


# -- labels the model has no logit for -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["arrow", "list"])
@pytest.mark.parametrize("label", [500, VOCAB, -5])
def test_lm_labels_outside_the_vocabulary_are_refused_at_accelerate(kind, label):
    examples = rows()
    examples[BAD_ROW]["labels"][-1] = label
    trainer = trainer_of(datasets.Dataset.from_list(examples) if kind == "arrow" else examples)
    with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the train dataset has label {label} \('labels'\), "
                                         rf"outside the model's vocabulary \(ids 0 to {VOCAB - 1}; -100 marks"):
        accelerate(trainer, {"task": "causal_lm"})
    assert_untouched(trainer)


def test_lm_labels_outside_the_vocabulary_found_by_the_collator_name_the_dataset_row():
    examples = rows()
    examples[BAD_ROW]["labels"][-1] = -5
    trainer = trainer_of(MapRows(examples))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    try:
        with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the dataset has label -5 \('labels'\)"):
            trainer.train()
    finally:
        acceleration.undo()


def classification_rows(labels) -> list[dict]:
    return [{"input_ids": row["input_ids"][:12], "labels": label} for row, label in zip(rows(len(labels)), labels)]


@pytest.mark.parametrize("kind", ["arrow", "list"])
@pytest.mark.parametrize("case", ["class", "negative", "width"])
def test_class_labels_and_multilabel_widths_the_classifier_lacks_are_refused_at_accelerate(kind, case):
    labels = [[0.0, 1.0, 0.0] for _ in range(24)] if case == "width" else [i % 3 for i in range(24)]
    labels[BAD_ROW] = {"class": 5, "negative": -5, "width": [0.0, 1.0, 0.0, 1.0]}[case]
    examples = classification_rows(labels)
    train = datasets.Dataset.from_list(examples) if kind == "arrow" else examples
    model = model_for("bert", head="seq_cls", num_labels=3)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none"),
                      train_dataset=train)
    message = (rf"example {BAD_ROW} of the train dataset has 4 multi-label targets in 'labels', but the model has "
               "num_labels=3" if case == "width" else
               rf"example {BAD_ROW} of the train dataset has label {labels[BAD_ROW]} \('labels'\), but the model has "
               r"num_labels=3 \(classes 0 to 2; -100 is ignored")
    with pytest.raises(BatchError, match=message):
        accelerate(trainer, {"task": "seq_cls"})
    assert patch_of(model) is None and "compute_loss" not in vars(trainer)


def test_a_multilabel_width_the_classifier_lacks_is_refused_by_the_collator():
    assembly = assemble(model_for("bert", head="seq_cls", num_labels=3), {"task": "seq_cls"})
    try:
        with pytest.raises(BatchError, match="4 multi-label targets, but the model has num_labels=3"):
            assembly.collator(classification_rows([[0.0, 1.0, 0.0, 1.0]] * 2))
        assert assembly.collator(classification_rows([[0.0, 1.0, 0.0]] * 2))["labels"].shape == (2, 3)
    finally:
        assembly.undo()


# -- resuming with another batching plan ------------------------------------------------------------------------------

PLAN = {"strategy": "tokens", "max_tokens_per_batch": 160}


def resumable(output_dir: str, batching: dict, **settings) -> Trainer:
    trainer = trainer_of(datasets.Dataset.from_list(rows(20)), output_dir=output_dir, **settings)
    accelerate(trainer, {"task": "causal_lm", "batching": batching})
    return trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A checkpoint saved at step 2 of a run with :data:`PLAN`."""
    folder = tmp_path_factory.mktemp("planned")
    resumable(str(folder), PLAN, max_steps=3, save_strategy="steps", save_steps=2).train()
    return str(folder / "checkpoint-2")


def test_every_checkpoint_keeps_the_batching_plan(checkpoint):
    with open(os.path.join(checkpoint, FINGERPRINT_FILE)) as file:
        saved = json.load(file)
    assert {key: saved[key] for key in PLAN} == PLAN and saved["processes"] == 1 and saved["examples"] == 20


@pytest.mark.parametrize("batching,difference", [
    ({**PLAN, "max_tokens_per_batch": 96}, "batching.max_tokens_per_batch: 160 -> 96"),
    ({**PLAN, "seed": 7}, r"the data seed .*: 0 -> 7"),
    ({"strategy": "examples"}, "batching.strategy: tokens -> examples"),
], ids=["budget", "seed", "strategy"])
def test_resuming_with_another_plan_is_refused_before_anything_is_loaded(tmp_path, checkpoint, batching, difference):
    trainer = resumable(str(tmp_path), batching, max_steps=4)
    weights = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    with pytest.raises(ConfigError, match=rf"checkpoint-2 was trained with another batching plan \({difference}.*"
                                          r"some examples would be trained twice this epoch and others never. Restore "
                                          r"the checkpoint's settings.*ignore_data_skip=True"):
        trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 0
    assert all(torch.equal(value, weights[name]) for name, value in trainer.model.state_dict().items())


def test_resuming_without_skipping_data_or_with_the_same_plan_trains(tmp_path, checkpoint):
    """``ignore_data_skip=True`` skips nothing, so another plan is no harm; the same plan resumes (its curve equals
    the uninterrupted run's: tests/test_trainer.py::test_resume_from_checkpoint_continues_the_same_curve)."""
    trainer = resumable(str(tmp_path / "a"), {**PLAN, "max_tokens_per_batch": 96}, max_steps=3,
                        ignore_data_skip=True)
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 3
    trainer = resumable(str(tmp_path / "b"), PLAN, max_steps=3)
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 3


def test_a_checkpoint_without_a_plan_is_resumed_with_a_warning(tmp_path, checkpoint):
    bare = tmp_path / "checkpoint-2"
    import shutil

    shutil.copytree(checkpoint, bare)
    os.remove(bare / FINGERPRINT_FILE)
    trainer = resumable(str(tmp_path / "run"), PLAN, max_steps=3)
    with pytest.warns(UserWarning, match="records no batching plan"):
        trainer.train(resume_from_checkpoint=str(bare))
    assert trainer.state.global_step == 3


def test_undo_takes_the_plan_check_off():
    trainer = trainer_of(datasets.Dataset.from_list(rows(20)))
    callbacks = len(trainer.callback_handler.callbacks)
    acceleration = accelerate(trainer, {"task": "causal_lm", "batching": PLAN})
    assert "train" in vars(trainer) and len(trainer.callback_handler.callbacks) == callbacks + 1
    acceleration.undo()
    assert "train" not in vars(trainer) and len(trainer.callback_handler.callbacks) == callbacks


@pytest.mark.parametrize("change,difference", [
    ("processes", "the number of processes: 2 -> 1"),
    ("dataset", "the training set's rows: 20 -> 21"),
])
def test_a_checkpoint_of_other_processes_or_another_dataset_is_refused(tmp_path, checkpoint, change, difference):
    """A checkpoint saved by 2 processes (its plan edited to say so) or over another dataset: another plan."""
    import shutil

    copied = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, copied)
    if change == "processes":
        saved = json.loads((copied / FINGERPRINT_FILE).read_text())
        (copied / FINGERPRINT_FILE).write_text(json.dumps({**saved, "processes": 2}))
    trainer = trainer_of(datasets.Dataset.from_list(rows(21 if change == "dataset" else 20)),
                         output_dir=str(tmp_path / "run"), max_steps=3)
    accelerate(trainer, {"task": "causal_lm", "batching": PLAN})
    with pytest.raises(ConfigError, match=rf"another batching plan \(.*{difference}"):
        trainer.train(resume_from_checkpoint=str(copied))
    assert trainer.state.global_step == 0


def test_a_dpo_checkpoint_keeps_its_plan_and_refuses_another(tmp_path):
    """TRL's DPOTrainer (the fused-head plugins) keeps and checks the plan of its pairs' token budget too."""
    pytest.importorskip("trl")
    from tests.test_token_budget_preference import budget_config, dpo_trainer

    first = dpo_trainer(str(tmp_path / "a"), max_steps=2, save_strategy="steps", save_steps=1)
    accelerate(first, budget_config())
    first.train()
    saved = json.loads((tmp_path / "a" / "checkpoint-1" / FINGERPRINT_FILE).read_text())
    assert saved["strategy"] == "tokens" and saved["max_tokens_per_batch"] == budget_config()["batching"][
        "max_tokens_per_batch"]
    second = dpo_trainer(str(tmp_path / "b"), max_steps=2)
    config = budget_config()
    config["batching"]["max_tokens_per_batch"] += 40
    accelerate(second, config)
    with pytest.raises(ConfigError, match="another batching plan .*batching.max_tokens_per_batch"):
        second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert second.state.global_step == 0
