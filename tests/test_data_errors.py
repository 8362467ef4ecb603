"""Bad data is found before training and named by its dataset index: token ids outside the model's embeddings and
padded masks at ``accelerate()`` (one vectorised pass over the dataset); what only the collator can see named by
the dataset index of the example when batches come through a trainer, and as a position in the batch otherwise.
Also: ``mixers:`` on a model without sequence mixers says it does nothing."""

from __future__ import annotations

import tempfile

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from padfree_plugins import BatchError, accelerate, assemble, load_config
from padfree_plugins.packing.datacheck import check_dataset
from tests.conftest import make_examples, tiny_config
from tests.tasks_common import model_for

BAD_ROW = 57
#: Rows of the embedding table of the tiny Llama (tiny_config's vocab_size).
EMBEDDINGS = 128


def rows(n: int = 64) -> list[dict]:
    """Causal-LM examples of 3..40 tokens, ids 5..127."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 40, (1,), generator=generator))
        out.append({"input_ids": torch.randint(5, EMBEDDINGS, (length,), generator=generator).tolist()})
    return out


def llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2), attn_implementation="sdpa")


def trainer_of(train, model=None, eval_dataset=None, **settings):
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=8, per_device_train_batch_size=16,
                             report_to="none", save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
                             **settings)
    return Trainer(model=model or llama(), args=args, train_dataset=train, eval_dataset=eval_dataset)


class MapRows(torch.utils.data.Dataset):
    """A map-style dataset the up-front check cannot read (not a ``datasets.Dataset``, not a list): only the
    collator sees its examples."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def with_token(examples, row: int, token: int) -> list[dict]:
    examples[row]["input_ids"][1] = token
    return examples


# -- at accelerate(): the dataset check --------------------------------------------------------------------------


@pytest.mark.parametrize("token", [-1, EMBEDDINGS, EMBEDDINGS + 500], ids=["negative", "embedding-size", "beyond"])
@pytest.mark.parametrize("kind", ["arrow", "list"])
def test_token_ids_outside_the_embeddings_are_refused_at_accelerate(kind, token):
    examples = with_token(rows(), BAD_ROW, token)
    train = datasets.Dataset.from_list(examples) if kind == "arrow" else examples
    trainer = trainer_of(train)
    with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the train dataset has token id {token}, outside the "
                                         rf"model's vocabulary \(ids 0 to {EMBEDDINGS - 1}\)"):
        accelerate(trainer, {"task": "causal_lm"})
    assert trainer.state.global_step == 0


def test_an_eval_dataset_is_checked_too():
    trainer = trainer_of(datasets.Dataset.from_list(rows()),
                         eval_dataset=datasets.Dataset.from_list(with_token(rows(8), 3, -7)))
    with pytest.raises(BatchError, match=r"example 3 of the eval dataset has token id -7"):
        accelerate(trainer, {"task": "causal_lm"})


@pytest.mark.parametrize("kind", ["arrow", "list"])
def test_a_padded_mask_is_refused_at_accelerate(kind):
    examples = [{**row, "attention_mask": [1] * len(row["input_ids"])} for row in rows()]
    examples[1]["attention_mask"][-1] = 0
    train = datasets.Dataset.from_list(examples) if kind == "arrow" else examples
    with pytest.raises(BatchError, match=r"example 1 of the train dataset is padded \(its attention_mask has zeros\)"):
        accelerate(trainer_of(train), {"task": "causal_lm"})


def test_the_limit_is_the_input_embeddings_not_the_config():
    """An embedding table larger than ``config.vocab_size`` (a vocabulary padded to a multiple of 64, say) takes
    every id below its row count; the next one is refused."""
    model = llama()
    model.config.vocab_size = 100  # the table keeps its 128 rows
    train = datasets.Dataset.from_list(with_token(rows(), BAD_ROW, 120))
    acceleration = accelerate(trainer_of(train, model), {"task": "causal_lm"})
    try:
        assert acceleration.assembly.collator([{"input_ids": [5, 120, EMBEDDINGS - 1]}]).num_tokens == 3
        with pytest.raises(BatchError, match=rf"token id {EMBEDDINGS}, outside the model's vocabulary \(ids 0 to "
                                             rf"{EMBEDDINGS - 1}\)"):
            acceleration.assembly.collator([{"input_ids": [5, EMBEDDINGS]}])
    finally:
        acceleration.undo()


def test_every_text_column_is_checked():
    """The embedding task's ``<column>_input_ids``: a bad id in the positives is found with its row and column."""
    assembly = assemble(model_for("bert"), {**load_config("configs/embedding.yaml").to_dict(), "max_length": 64})
    try:
        anchors, positives = make_examples([3] * 60), make_examples([4] * 60)
        table = [{"anchor_input_ids": a["input_ids"], "positive_input_ids": p["input_ids"]}
                 for a, p in zip(anchors, positives)]
        table[BAD_ROW]["positive_input_ids"][2] = -3
        with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the train dataset \(positive_input_ids\) has "
                                             "token id -3"):
            check_dataset(datasets.Dataset.from_list(table), assembly.collator)
    finally:
        assembly.undo()


# -- in the collator: named by dataset index through a trainer, as a position otherwise ------------------------


@pytest.mark.parametrize("strategy", ["examples", "tokens"])
def test_collator_errors_name_the_dataset_index_through_the_trainer(strategy):
    """Batches of a dataset the up-front check cannot read: the collator's error names the example's index in the
    dataset, not its position in the (shuffled) batch — with the trainer's sampler and with token budgets."""
    batching = {"strategy": "tokens", "max_tokens_per_batch": 512} if strategy == "tokens" else {}
    trainer = trainer_of(MapRows(with_token(rows(), BAD_ROW, 300)))
    acceleration = accelerate(trainer, {"task": "causal_lm", "batching": batching})
    try:
        with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the dataset has token id 300"):
            trainer.train()
    finally:
        acceleration.undo()


def test_an_empty_example_found_in_training_names_the_dataset_index():
    examples = rows()
    examples[BAD_ROW]["input_ids"] = []
    trainer = trainer_of(MapRows(examples))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    try:
        with pytest.raises(BatchError, match=rf"example {BAD_ROW} of the dataset has no tokens"):
            trainer.train()
    finally:
        acceleration.undo()


def test_the_evaluation_batches_name_the_dataset_index():
    trainer = trainer_of(MapRows(rows()), eval_dataset=MapRows(with_token(rows(8), 6, -2)))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    try:
        with pytest.raises(BatchError, match=r"example 6 of the dataset has token id -2"):
            trainer.evaluate()
    finally:
        acceleration.undo()


def test_a_collator_called_directly_says_the_number_is_a_position_in_the_batch():
    assembly = assemble(llama(), {"task": "causal_lm"})
    try:
        with pytest.raises(BatchError, match=r"example 1 has no tokens.*\(example 1: its position in this batch\)"):
            assembly.collator([{"input_ids": [5, 6]}, {"input_ids": []}])
    finally:
        assembly.undo()


def test_the_index_key_is_not_packed():
    """The rows a trainer's dataloader fetches carry their index; the packed batch holds nothing of it."""
    trainer = trainer_of(datasets.Dataset.from_list(rows()))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    try:
        batch = next(iter(trainer.get_train_dataloader()))
        assert not any("index" in key for key in batch)
        assert batch["input_ids"].shape == batch["labels"].shape == (1, batch["cu_seq_lens_q"][-1])
    finally:
        acceleration.undo()
    assert "_get_dataloader" not in trainer.__dict__


# -- mixers: on a model without sequence mixers ------------------------------------------------------------------


def test_mixer_kernels_on_a_model_without_mixers_warn():
    with pytest.warns(UserWarning, match="mixers: kernels has no effect on llama"):
        assembly = assemble(llama(), {"task": "causal_lm", "mixers": "kernels"})
    assembly.undo()


def packed_rows(lengths_per_row: list[list[int]]) -> list[dict]:
    """Rows that hold several examples, as TRL's ``packing=True`` writes them (a ``seq_lengths`` column)."""
    return [{"input_ids": [5] * sum(lengths), "labels": [5] * sum(lengths), "seq_lengths": lengths}
            for lengths in lengths_per_row]


@pytest.mark.parametrize("kind", ["arrow", "list"])
def test_rows_of_several_examples_count_each_example_by_its_own_length(kind):
    """The model's 256 positions bound every example of a packed row, not the row: rows of 300 tokens pass; an
    example of 257 tokens is refused, named by its place in its row."""
    collator = assemble(llama(), {"task": "causal_lm"}).collator
    dataset = packed_rows([[100, 200], [256, 44], [150, 150]])
    as_kind = datasets.Dataset.from_list if kind == "arrow" else list
    assert check_dataset(as_kind(dataset), collator) == 3
    dataset[2]["seq_lengths"] = [43, 257]
    with pytest.raises(BatchError, match=r"^example 1 of row 2 of the train dataset \(its rows hold several "
                                         r"examples: seq_lengths\) has 257 tokens but the model takes at most 256"):
        check_dataset(as_kind(dataset), collator)
