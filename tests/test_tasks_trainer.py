"""HF Trainer + ``padfree_plugins.accelerate(trainer, cfg)`` for the per-example tasks: sequence classification,
listwise reranking and embeddings train padding-free with the loss curve of padded training (same seed, same data
order, dropout 0); classification also evaluates to the same loss and predicts the same per-example logits."""

from __future__ import annotations

import tempfile

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from padfree_plugins import accelerate
from tests.tasks_common import model_for, padded, pair_examples

STEPS = 8
#: Hybrid classifiers (tests/tasks_common.HYBRID_CLASSIFIERS) trained here: one per kind of sequence mixer (gated
#: DeltaNet; Mamba1 beside MoE layers). Qwen3-Next, a gated DeltaNet too, is checked step by step in the seq_cls and
#: reranker task tests.
TRAINED_HYBRIDS = ("qwen3_5_text", "jamba")
#: Training runs in train mode: dropout off so that padded and padding-free compute the same function.
NO_DROPOUT = {"bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "qwen3": {},
              **dict.fromkeys(TRAINED_HYBRIDS, {})}




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


@pytest.mark.parametrize("name", ["bert", "qwen3", *TRAINED_HYBRIDS])
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


@pytest.mark.parametrize("split", ["train", "eval"])
def test_listwise_on_one_candidate_per_row_is_refused_before_training(split):
    """The trainer shuffles training rows and cuts evaluation rows into batches: candidates given one per row (with
    group ids) would be split across batches — in evaluation, a BatchError after the whole training run."""
    from padfree_plugins import BatchError

    flat = [{"input_ids": ids, "label": int(j == 0), "group": q}
            for q, row in enumerate(query_rows(4, 0)) for j, ids in enumerate(row["input_ids"])]
    model = model_for("bert", head="seq_cls", num_labels=1, **NO_DROPOUT["bert"])
    data = {"train": datasets.Dataset.from_list(query_rows(4, 0)), "eval": datasets.Dataset.from_list(flat)}
    data[split] = datasets.Dataset.from_list(flat)
    trainer = Trainer(model=model, args=settings(), train_dataset=data["train"], eval_dataset=data["eval"])
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


# -- evaluate / predict: compute_metrics sees what it sees with padded batches ---------------------------------


def captured_evaluation(packed: bool, rows: list[dict], collator, config, name="bert", num_labels=3, **arguments):
    """``evaluate`` and ``predict`` of an untrained model; the EvalPredictions compute_metrics received."""
    seen = []

    def compute_metrics(prediction, compute_result=True):
        seen.append(prediction)
        return {}

    model = model_for(name, head="seq_cls", num_labels=num_labels, **NO_DROPOUT[name])
    evaluation = datasets.Dataset.from_list(rows)
    trainer = Trainer(model=model, args=settings(**arguments), eval_dataset=evaluation,
                      compute_metrics=compute_metrics, data_collator=None if packed else collator)
    if packed:
        accelerate(trainer, config)
    metrics = trainer.evaluate()
    prediction = trainer.predict(evaluation)
    return metrics, prediction, seen


def assert_same_arrays(got, want, atol=1e-5):
    if isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_arrays(g, w, atol)
        return
    if want is None:
        assert got is None
        return
    got, want = np.asarray(got.cpu() if isinstance(got, torch.Tensor) else got), np.asarray(
        want.cpu() if isinstance(want, torch.Tensor) else want)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("arguments", [
    dict(include_for_metrics=["inputs", "loss"], eval_accumulation_steps=2),
    dict(include_for_metrics=["loss"], batch_eval_metrics=True),
    dict(eval_do_concat_batches=False, per_device_eval_batch_size=3),
    dict(prediction_loss_only=True),
], ids=["inputs-loss-accumulation", "batch-metrics", "no-concat", "loss-only"])
def test_classification_evaluation_gives_metrics_what_padded_gives(arguments):
    """11 rows, batches of 5: the last batch holds one example. Predictions, labels, inputs (padded per example,
    not packed rows) and losses reach compute_metrics as with padded batches."""
    rows = classification_rows(11, 1)
    runs = [captured_evaluation(packed, rows, padded_classification_collator, "configs/seq_cls.yaml", **arguments)
            for packed in (False, True)]
    (want_metrics, want_prediction, want_seen), (metrics, prediction, seen) = runs
    assert metrics["eval_loss"] == pytest.approx(want_metrics["eval_loss"], abs=1e-5)
    assert prediction.metrics["test_loss"] == pytest.approx(want_prediction.metrics["test_loss"], abs=1e-5)
    assert_same_arrays(prediction.predictions, want_prediction.predictions)
    assert_same_arrays(prediction.label_ids, want_prediction.label_ids)
    assert len(seen) == len(want_seen) == (0 if arguments.get("prediction_loss_only") else
                                          6 if arguments.get("batch_eval_metrics") else 2)
    for got, want in zip(seen, want_seen):
        for field in ("predictions", "label_ids", "losses"):
            assert_same_arrays(getattr(got, field), getattr(want, field))
        if "inputs" in arguments.get("include_for_metrics", ()):
            assert_same_arrays(got.inputs, want.inputs, atol=0)


def test_reranker_predictions_are_the_padded_cross_encoders_logits():
    rows = [{**row, "label": float(row["label"] > 0)} for row in classification_rows(11, 1)]
    config = {"task": "reranker", "attention": "exact"}
    runs = [captured_evaluation(packed, rows, padded_classification_collator, config, num_labels=1)
            for packed in (False, True)]
    (_, want, _), (_, got, _) = runs
    assert want.predictions.shape == (11, 1)
    assert_same_arrays(got.predictions, want.predictions)
    assert_same_arrays(got.label_ids, want.label_ids)


def test_listwise_predictions_are_one_row_per_query_across_batches():
    """7 queries of 2 to 4 candidates in batches of 3 queries: every candidate's score, laid out [query, candidate]
    (-100 in empty slots) — none lost to the trainer's cut of the last batch to its number of rows."""
    queries = query_rows(7, 1)
    model = model_for("bert", head="seq_cls", num_labels=1)
    trainer = Trainer(model=model, args=settings(per_device_eval_batch_size=3), eval_dataset=datasets.Dataset.from_list(
        queries))
    accelerate(trainer, "configs/reranker_listwise.yaml")
    prediction = trainer.predict(trainer.eval_dataset)
    width = max(len(row["labels"]) for row in queries)
    assert prediction.predictions.shape == prediction.label_ids.shape == (7, width)
    for i, row in enumerate(queries):
        k = len(row["labels"])
        inputs = padded_listwise_collator([row])
        with torch.no_grad():
            want = model(input_ids=inputs["input_ids"], token_type_ids=inputs["token_type_ids"],
                         attention_mask=inputs["attention_mask"]).logits[:, 0]
        np.testing.assert_allclose(prediction.predictions[i, :k], want.numpy(), atol=1e-5, rtol=0)
        assert (prediction.predictions[i, k:] == -100).all() and (prediction.label_ids[i, k:] == -100).all()
        assert prediction.label_ids[i, :k].tolist() == row["labels"]


def test_embedding_evaluation_reports_the_loss_and_each_columns_embeddings():
    """A bare encoder has no label names: the loss the embedding forward computes is still eval_loss; predictions are
    one [rows, H] array per column (11 rows in batches of 5)."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    generator = torch.Generator().manual_seed(3)
    texts = pair_examples([int(x) for x in torch.randint(1, 30, (22,), generator=generator)], seed=3)
    rows = [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"]}
            for a, b in zip(texts[0::2], texts[1::2])]
    model = model_for("bert", **NO_DROPOUT["bert"])
    trainer = Trainer(model=model, args=settings(), eval_dataset=datasets.Dataset.from_list(rows))
    accelerate(trainer, "configs/embedding.yaml")
    metrics = trainer.evaluate()
    prediction = trainer.predict(trainer.eval_dataset)
    with torch.no_grad():
        want = []
        for column in ("anchor", "positive"):
            batch = padded_columns_collator(rows)
            hidden = model(input_ids=batch[f"{column}_input_ids"],
                           attention_mask=batch[f"{column}_attention_mask"]).last_hidden_state
            mask = batch[f"{column}_attention_mask"].unsqueeze(-1).float()
            want.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
        loss = MultipleNegativesRankingLoss(model=None, scale=20.0)
        # the trainer weighs every batch's loss by its number of rows (5, 5, 1)
        want_loss = np.average([loss.compute_loss_from_embeddings([e[s:s + 5] for e in want], None).item()
                                for s in (0, 5, 10)], weights=[5, 5, 1])
    assert metrics["eval_loss"] == pytest.approx(want_loss, abs=1e-5)
    assert prediction.metrics["test_loss"] == pytest.approx(want_loss, abs=1e-5)
    assert isinstance(prediction.predictions, tuple) and len(prediction.predictions) == 2
    for got, expected in zip(prediction.predictions, want):
        assert got.shape == (11, 64)
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)


def test_embedding_evaluation_hands_compute_metrics_the_row_labels():
    """A bare encoder has no label names, yet a similarity loss's row labels are what STS metrics compare the
    embeddings with: compute_metrics gets them (without them the trainer never called compute_metrics)."""
    rows = similarity_rows(11)
    seen = []
    trainer = Trainer(model=model_for("bert", **NO_DROPOUT["bert"]), args=settings(),
                      eval_dataset=datasets.Dataset.from_list(rows), compute_metrics=lambda p: seen.append(p) or {})
    accelerate(trainer, {"task": "embedding", "attention": "exact", "pooling": "mean",
                         "task_options": {"loss": "CosineSimilarityLoss"}})
    trainer.evaluate()
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0].label_ids, [row["label"] for row in rows])
    assert [column.shape for column in seen[0].predictions] == [(11, 64), (11, 64)]


def test_a_loss_that_needs_labels_on_rows_without_them():
    """CosineSimilarityLoss on rows without a label column: training stops at the first step with what is missing
    (was the loss's own AttributeError); predict still gives the embeddings."""
    from padfree_plugins import PadfreeError

    rows = [{k: v for k, v in row.items() if k != "label"} for row in similarity_rows(11)]
    trainer = Trainer(model=model_for("bert", **NO_DROPOUT["bert"]), args=settings(max_steps=2),
                      train_dataset=datasets.Dataset.from_list(rows))
    accelerate(trainer, {"task": "embedding", "attention": "exact", "pooling": "mean",
                         "task_options": {"loss": "CosineSimilarityLoss"}})
    with pytest.raises(PadfreeError, match="returned no loss for task 'embedding': does the batch carry labels"):
        trainer.train()
    prediction = trainer.predict(datasets.Dataset.from_list(rows))
    assert [column.shape for column in prediction.predictions] == [(11, 64), (11, 64)]


# -- gradient accumulation ---------------------------------------------------------------------------------------


def test_classification_gradient_accumulation_equals_padded():
    """The model's own loss under accumulation, exactly as the padded trainer runs it (transformers treats it as
    normalised by num_items_in_batch, which a classifier's mean loss is not — kept, so both curves agree)."""
    curves = []
    for packed in (False, True):
        trainer, _ = classification_trainer(packed)
        trainer.args.gradient_accumulation_steps = 2
        trainer.args.per_device_train_batch_size = 2
        trainer.train()
        curves.append(losses(trainer))
    assert len(curves[1]) == len(curves[0]) == STEPS
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), atol=1e-4, rtol=0)


def binary_rows(n: int) -> list[dict]:
    return [{**row, "label": float(row["label"] > 0)} for row in classification_rows(n, 0)]


def similarity_rows(n: int) -> list[dict]:
    texts = pair_examples([int(x) for x in torch.randint(1, 30, (2 * n,), generator=torch.Generator().manual_seed(5))])
    return [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"], "label": (i % 5) / 4}
            for i, (a, b) in enumerate(zip(texts[0::2], texts[1::2]))]


@pytest.mark.parametrize("task", ["reranker", "embedding"])
def test_per_batch_losses_average_over_accumulation_steps(task):
    """Pointwise BCE and CosineSimilarityLoss are means over the batch: 2 micro-batches of 2 accumulate to the
    step of one batch of 4 (was: the micro-batch losses summed, a loss and gradients twice as large)."""
    if task == "reranker":
        model_of, rows = lambda: model_for("bert", head="seq_cls", num_labels=1, **NO_DROPOUT["bert"]), binary_rows(48)
        config = {"task": "reranker", "attention": "exact"}
    else:
        model_of, rows = lambda: model_for("bert", **NO_DROPOUT["bert"]), similarity_rows(48)
        config = {"task": "embedding", "attention": "exact", "pooling": "mean",
                  "task_options": {"loss": "CosineSimilarityLoss"}}
    curves = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        trainer = Trainer(model=model_of(), train_dataset=datasets.Dataset.from_list(rows), args=settings(
            per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation))
        accelerate(trainer, config)
        trainer.train()
        curves.append(losses(trainer))
    assert len(curves[1]) == len(curves[0]) == STEPS
    assert max(curves[0]) - min(curves[0]) > 1e-3, "the loss never moved: the comparison would prove little"
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), atol=1e-4, rtol=0)


# -- what users add to a classifier's training -----------------------------------------------------------------


def weighted_cross_entropy(outputs, labels, num_items_in_batch=None):
    """Class weights through ``compute_loss_func``."""
    return F.cross_entropy(outputs["logits"], labels, weight=torch.tensor([1.0, 2.0, 0.5]))


@pytest.mark.parametrize("name, options", [
    ("bert", dict(label_smoothing_factor=0.1)),
    ("bert", dict(compute_loss_func=weighted_cross_entropy)),
    ("bert", dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})),
    ("qwen3", dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})),
    ("qwen3", dict(lora=True, activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})),
    ("bert", dict(neftune_noise_alpha=1.0)),
    ("qwen3", dict(neftune_noise_alpha=1.0)),
], ids=["label-smoothing", "class-weights", "checkpointing-reentrant", "decoder-checkpointing", "lora-checkpointing",
        "neftune", "decoder-neftune"])
def test_classifier_training_options_give_the_padded_curve(name, options):
    """LoRA (task SEQ_CLS: the head in modules_to_save), activation checkpointing either way, label smoothing, a
    compute_loss_func and NEFTune (the padded batch's noise) train the padded curve; after undo the (peft) model
    still runs padded batches."""
    peft = pytest.importorskip("peft") if options.get("lora") else None
    options = dict(options)
    lora, loss_func = options.pop("lora", False), options.pop("compute_loss_func", None)
    train = datasets.Dataset.from_list(classification_rows(48, 0))
    curves = []
    for packed in (False, True):
        model = model_for(name, head="seq_cls", num_labels=3, **NO_DROPOUT[name])
        if lora:
            model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                               target_modules=["q_proj", "v_proj"]))
        trainer = Trainer(model=model, args=settings(**options), train_dataset=train, compute_loss_func=loss_func,
                          data_collator=None if packed else padded_classification_collator)
        acceleration = accelerate(trainer, "configs/seq_cls.yaml") if packed else None
        trainer.train()
        curves.append(losses(trainer))
        assert trainer.model.is_activation_checkpointing == bool(options.get("activation_checkpointing"))
        if acceleration is not None:
            acceleration.undo()
            out = model(**padded_classification_collator([train[i] for i in range(3)]))
            assert out.logits.shape == (3, 3) and torch.isfinite(out.loss)
    assert len(curves[1]) == len(curves[0]) == STEPS
    assert max(curves[0]) - min(curves[0]) > 1e-3, "the loss never moved: the comparison would prove little"
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), atol=1e-4, rtol=0)
