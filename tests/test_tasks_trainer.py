"""HF Trainer + ``padfree_plugins.accelerate(trainer, cfg)`` for the per-example tasks: sequence classification,
listwise reranking and embeddings train padding-free with the loss curve of padded training (same seed, same data
order, dropout 0); classification also evaluates to the same loss and predicts the same per-example logits."""

from __future__ import annotations

import tempfile

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from padfree_plugins import accelerate
from tests.tasks_common import model_for, padded, pair_examples

STEPS = 8
#: Training runs in train mode: dropout off so that padded and padding-free compute the same function.
NO_DROPOUT = {"bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "qwen3": {}}




def settings(**overrides) -> TrainingArguments:
    values = dict(output_dir=tempfile.mkdtemp(prefix="padfree-tasks-"), max_steps=STEPS, per_device_train_batch_size=4,
                  per_device_eval_batch_size=5, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    return TrainingArguments(**{**values, **overrides})


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# -- sequence classification ------------------------------------------------------------------------------------


def classification_rows(n: int, seed: int) -> list[dict]:
    rows = pair_examples([int(x) for x in torch.randint(2, 40, (n,), generator=torch.Generator().manual_seed(seed))],
                         seed=seed)
    for i, row in enumerate(rows):
        row["label"] = (sum(row["input_ids"]) + i) % 3
    return rows


def padded_classification_collator(rows):
    batch = padded(rows, keys=("input_ids", "token_type_ids") if "token_type_ids" in rows[0] else ("input_ids",))
    batch["labels"] = torch.tensor([row["label"] for row in rows])
    return batch


def classification_trainer(packed: bool, name: str = "bert"):
    model = model_for(name, head="seq_cls", num_labels=3, **NO_DROPOUT[name])
    train, evaluation = (datasets.Dataset.from_list(classification_rows(n, seed)) for n, seed in ((48, 0), (13, 1)))
    trainer = Trainer(model=model, args=settings(), train_dataset=train, eval_dataset=evaluation,
                      data_collator=None if packed else padded_classification_collator)
    acceleration = accelerate(trainer, "configs/seq_cls.yaml") if packed else None
    return trainer, acceleration


@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_sequence_classification_curve_equals_padded(name):
    runs = {}
    for packed in (False, True):
        trainer, acceleration = classification_trainer(packed, name)
        trainer.train()
        prediction = trainer.predict(trainer.eval_dataset)
        runs[packed] = (losses(trainer), prediction.metrics["test_loss"], prediction.predictions)
        if acceleration is not None:
            acceleration.undo()
    (want, want_eval, want_logits), (got, got_eval, got_logits) = runs[False], runs[True]
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    assert max(want) - min(want) > 1e-3, "the loss never moved: the comparison would prove little"
    assert got_eval == pytest.approx(want_eval, abs=1e-5)
    assert got_logits.shape == want_logits.shape == (13, 3)
    torch.testing.assert_close(torch.tensor(got_logits), torch.tensor(want_logits), atol=1e-4, rtol=0)


# -- listwise reranking: one row per query (its candidates), so the Trainer's shuffling keeps groups whole ------


def query_rows(n: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(2, 5, (1,), generator=generator))  # 2 to 4 candidates: unequal groups
        candidates = pair_examples([int(x) for x in torch.randint(2, 30, (k,), generator=generator)],
                                   seed=int(torch.randint(0, 10**6, (1,), generator=generator)))
        positive = int(torch.randint(0, k, (1,), generator=generator))
        rows.append({"input_ids": [c["input_ids"] for c in candidates],
                     "token_type_ids": [c["token_type_ids"] for c in candidates],
                     "labels": [int(j == positive) for j in range(k)]})
    return rows


class PaddedListwiseTrainer(Trainer):
    """The padded reference: every candidate of the batch's queries in one padded batch, softmax CE per query."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        scores = model(**{k: v for k, v in inputs.items() if k not in ("sizes", "positives")}).logits[:, 0]
        per_query = [F.cross_entropy(group[None], positive[None])
                     for group, positive in zip(scores.split(inputs["sizes"].tolist()), inputs["positives"])]
        return torch.stack(per_query).mean()


def padded_listwise_collator(rows):
    candidates = [{"input_ids": ids, "token_type_ids": types} for row in rows
                  for ids, types in zip(row["input_ids"], row["token_type_ids"])]
    batch = padded(candidates, keys=("input_ids", "token_type_ids"))
    batch["sizes"] = torch.tensor([len(row["labels"]) for row in rows])
    batch["positives"] = torch.tensor([row["labels"].index(1) for row in rows])
    return batch


def test_listwise_reranker_curve_equals_padded():
    train = datasets.Dataset.from_list(query_rows(32, 0))
    curves = []
    for packed in (False, True):
        model = model_for("bert", head="seq_cls", num_labels=1, **NO_DROPOUT["bert"])
        cls = Trainer if packed else PaddedListwiseTrainer
        trainer = cls(model=model, args=settings(), train_dataset=train,
                      data_collator=None if packed else padded_listwise_collator)
        if packed:
            accelerate(trainer, "configs/reranker_listwise.yaml")
        trainer.train()
        curves.append(losses(trainer))
    assert len(curves[1]) == len(curves[0]) == STEPS
    assert max(curves[0]) - min(curves[0]) > 1e-3, "the loss never moved: the comparison would prove little"
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), atol=1e-4, rtol=0)


def test_listwise_training_on_one_candidate_per_row_is_refused_before_training():
    """The trainer shuffles rows: candidates given one per row (with group ids) would be split across batches."""
    from padfree_plugins import BatchError

    flat = [{"input_ids": ids, "label": int(j == 0), "group": q}
            for q, row in enumerate(query_rows(4, 0)) for j, ids in enumerate(row["input_ids"])]
    model = model_for("bert", head="seq_cls", num_labels=1, **NO_DROPOUT["bert"])
    trainer = Trainer(model=model, args=settings(), train_dataset=datasets.Dataset.from_list(flat))
    with pytest.raises(BatchError, match="give one row per query"):
        accelerate(trainer, "configs/reranker_listwise.yaml")


# -- embeddings: (anchor, positive) rows, MultipleNegativesRankingLoss; column names are the dataset's own -------


class PaddedEmbeddingTrainer(Trainer):
    """The padded reference: each column padded and embedded on its own (as sentence-transformers does)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

        embeddings = []
        for column in ("anchor", "positive"):
            hidden = model(input_ids=inputs[f"{column}_input_ids"],
                           attention_mask=inputs[f"{column}_attention_mask"]).last_hidden_state
            mask = inputs[f"{column}_attention_mask"].unsqueeze(-1).float()
            embeddings.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
        return MultipleNegativesRankingLoss(model=None).compute_loss_from_embeddings(embeddings, None)


def padded_columns_collator(rows):
    batch = {}
    for column in ("anchor", "positive"):
        texts = [{"input_ids": row[f"{column}_input_ids"]} for row in rows]
        inputs = padded(texts)
        batch[f"{column}_input_ids"], batch[f"{column}_attention_mask"] = inputs["input_ids"], inputs["attention_mask"]
    return batch


def test_embedding_curve_equals_padded():
    generator = torch.Generator().manual_seed(3)
    texts = pair_examples([int(x) for x in torch.randint(1, 30, (64,), generator=generator)], seed=3)
    train = datasets.Dataset.from_list([{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"]}
                                        for a, b in zip(texts[0::2], texts[1::2])])
    curves = []
    for packed in (False, True):
        model = model_for("bert", **NO_DROPOUT["bert"])
        cls = Trainer if packed else PaddedEmbeddingTrainer
        # the packed run keeps remove_unused_columns at its default: accelerate() keeps the columns it reads
        trainer = cls(model=model, args=settings(remove_unused_columns=packed, per_device_train_batch_size=8),
                      train_dataset=train.add_column("text", ["unused"] * len(train)),
                      data_collator=None if packed else padded_columns_collator)
        if packed:
            accelerate(trainer, "configs/embedding.yaml")
        trainer.train()
        curves.append(losses(trainer))
    assert len(curves[1]) == len(curves[0]) == STEPS
    assert max(curves[0]) - min(curves[0]) > 1e-3, "the loss never moved: the comparison would prove little"
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), atol=1e-4, rtol=0)
