"""Task embedding: every column of every row packed into one row; pooled embeddings equal sentence-transformers'
own Pooling on the padded outputs (every mode, prompts excluded or not), and sentence-transformers' losses give
the same values and gradients as on padded embeddings — for encoders, decoder embedders and the hybrid families."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.modules import Pooling

from padfree_plugins import BatchError, ConfigError, assemble, load_config
from padfree_plugins.testing import assert_packed_matches_alone
from tests.conftest import make_examples
from tests.hybrids_common import HYBRIDS, LENGTHS
from tests.tasks_common import (
    EMBEDDERS,
    ENCODERS,
    GRAD_ATOL,
    assert_grads_close,
    grads,
    lengths_for,
    model_for,
    padded,
)
from tests.ties import assert_clear

CONFIG = "configs/embedding.yaml"
ST_MODES = {"first": "cls", "last": "lasttoken", "mean": "mean", "max": "max", "weighted_mean": "weightedmean",
            "mean_sqrt_len": "mean_sqrt_len_tokens"}


def st_pool(model, texts, mode, prompt_length=None):
    """sentence-transformers' Pooling on the model's padded outputs (right padding)."""
    inputs = padded(texts)
    hidden = model(**inputs).last_hidden_state
    features = {"token_embeddings": hidden, "attention_mask": inputs["attention_mask"]}
    if prompt_length is not None:
        features["prompt_length"] = prompt_length
    pooling = Pooling(hidden.shape[-1], ST_MODES[mode], include_prompt=prompt_length is None)
    return pooling(features)["sentence_embedding"]


def rows_of(columns: dict[str, list[dict]], **extra):
    """Dataset rows with ``<column>_input_ids`` from per-column example lists."""
    n = len(next(iter(columns.values())))
    rows = [{f"{c}_input_ids": texts[i]["input_ids"] for c, texts in columns.items()} for i in range(n)]
    for key, values in extra.items():
        for row, value in zip(rows, values):
            row[key] = value
    return rows


def embed(model, rows, config):
    assembly = assemble(model, config)
    try:
        return assembly.forward(model, assembly.collator(rows))
    finally:
        assembly.undo()


@pytest.mark.parametrize(("name", "mode"), [("bert", m) for m in ("first", "mean", "max", "weighted_mean",
                                                                   "mean_sqrt_len", "last")]
                         + [("qwen3", m) for m in ("last", "mean", "weighted_mean")] + [("roberta", "mean"),
                                                                                         ("modernbert", "first")])
def test_pooling_equals_sentence_transformers(name, mode):
    model = model_for(name)
    texts = make_examples([1, 9, 4, 17, 4])
    with torch.no_grad():
        want = st_pool(model, texts, mode)
        out = embed(model, rows_of({"text": texts}), {"task": "embedding", "attention": "exact", "pooling": mode})
    torch.testing.assert_close(out.embeddings, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["first", "mean", "max", "weighted_mean"])
def test_prompt_excluded_like_sentence_transformers(mode):
    model = model_for("bert")
    texts = make_examples([5, 9, 3, 12])  # every text starts with a 3-token prompt (one is all prompt)
    config = {"task": "embedding", "attention": "exact", "pooling": mode, "task_options": {"include_prompt": False}}
    with torch.no_grad():
        want = st_pool(model, texts, mode, prompt_length=3)
        out = embed(model, rows_of({"query": texts}, query_prompt_length=[3, 3, 3, 3]), config)
        with_prompt = embed(model, rows_of({"query": texts}, query_prompt_length=[3, 3, 3, 3]),
                            {**config, "task_options": {"include_prompt": True}})
    torch.testing.assert_close(out.embeddings, want, atol=1e-5, rtol=1e-5)
    assert (out.embeddings - with_prompt.embeddings).abs().max() > 1e-4


def test_per_example_prompt_lengths():
    """Different prompts per column (a query prompt, no document prompt): each text leaves its own out."""
    model = model_for("bert")
    queries, documents = make_examples([6, 9], seed=1), make_examples([7, 2], seed=2)
    rows = rows_of({"query": queries, "document": documents}, query_prompt_length=[2, 4])
    config = {"task": "embedding", "attention": "exact", "pooling": "mean", "task_options": {"include_prompt": False}}
    with torch.no_grad():
        out = embed(model, rows, config)
        want_queries = torch.cat([st_pool(model, [q], "mean", prompt_length=p) for q, p in zip(queries, [2, 4])])
        want_documents = st_pool(model, documents, "mean")
    torch.testing.assert_close(out.column_embeddings[0], want_queries, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.column_embeddings[1], want_documents, atol=1e-5, rtol=1e-5)


LOSSES = {
    "MultipleNegativesRankingLoss": (("anchor", "positive", "negative"), None),
    "CoSENTLoss": (("sentence1", "sentence2"), [0.1, 0.9, 0.5, 0.3]),
    "ContrastiveLoss": (("sentence1", "sentence2"), [1, 0, 1, 0]),
}


CASES = [(name, "MultipleNegativesRankingLoss") for name in EMBEDDERS] + [
    (name, loss) for name in ("bert", "qwen3") for loss in ("CoSENTLoss", "ContrastiveLoss")]


@pytest.mark.parametrize(("name", "loss_name"), CASES)
def test_losses_and_gradients_equal_padded(name, loss_name):
    from sentence_transformers.sentence_transformer import losses

    model = model_for(name)
    columns, labels = LOSSES[loss_name]
    texts = {c: make_examples(lengths_for(name, [1, 7, 12, 3]), seed=s) for s, c in enumerate(columns)}  # 1-token too
    mode = "mean" if name in ENCODERS else "last"
    loss_fn = getattr(losses, loss_name)(model=None)
    embeddings = [F.normalize(st_pool(model, texts[c], mode), dim=-1) for c in columns]
    want_loss = loss_fn.compute_loss_from_embeddings(embeddings, None if labels is None else torch.tensor(labels))
    if loss_name == "ContrastiveLoss":  # a hinge on the negative pairs' distances: its gradient jumps at the margin
        distances = 1 - F.cosine_similarity(embeddings[0], embeddings[1]).detach()
        assert_clear((loss_fn.margin - distances)[torch.tensor(labels) == 0], "negative pairs' distances to the margin")
    want_loss.backward()
    want = grads(model)
    config = {"task": "embedding", "attention": "exact", "pooling": mode,
              "task_options": {"loss": loss_name, "normalize": True}}
    extra = {} if labels is None else {"label": labels}
    out = embed(model, rows_of(texts, **extra), config)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want_loss.detach(), atol=1e-5, rtol=1e-5)
    for got_column, want_column in zip(out.column_embeddings, embeddings):
        torch.testing.assert_close(got_column.detach(), want_column.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want, atol=GRAD_ATOL.get(name, 1e-4))


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_hidden_states_equal_every_example_alone(name):
    """The hybrid families' base models under task hidden_states (the states the pooler reads): every packed token's
    last hidden state, and every parameter's gradient, equal each example run alone — no padding, the reference a
    recurrent mixer needs — at each length a boundary can hurt (tests/hybrids_common.LENGTHS). States within 1e-5
    absolute; gradients within 1e-4 + 1e-4 x each parameter's gradient scale."""
    assert_packed_matches_alone(model_for(name), {"task": "hidden_states", "attention": "exact"},
                                make_examples(LENGTHS), rtol=0)


def test_config_file_and_batch_layout():
    """configs/embedding.yaml: MNRL on (anchor, positive); texts packed column-major with explicit group ids."""
    model = model_for("bert")
    rows = rows_of({"anchor": make_examples([3, 1, 6]), "positive": make_examples([2, 5, 4], seed=3)})
    assembly = assemble(model, CONFIG)
    try:
        batch = assembly.collator(rows)
        assert batch["cu_seq_lens_q"].diff().tolist() == [3, 1, 6, 2, 5, 4]
        assert batch["group_ids"].tolist() == [0, 1, 2, 0, 1, 2]
        assert batch["column_ids"].tolist() == [0, 0, 0, 1, 1, 1]
        assert (batch["num_rows"], batch["num_columns"]) == (3, 2)
        out = assembly.forward(model, batch)
        assert out.loss is not None and out.embeddings.shape == (6, 64)
        assert torch.allclose(out.embeddings.norm(dim=-1), torch.ones(6))
        collator, forward = pickle.loads(pickle.dumps((assembly.collator, assembly.forward)))  # DataLoader workers
        torch.testing.assert_close(forward(model, collator(rows)).loss, out.loss)
    finally:
        assembly.undo()


def test_single_column_rows_and_batch_of_one():
    model = model_for("bert")
    with torch.no_grad():
        out = embed(model, [{"input_ids": [5, 6, 7]}], {"task": "embedding", "attention": "exact", "pooling": "mean"})
        want = st_pool(model, [{"input_ids": [5, 6, 7]}], "mean")
    assert out.loss is None
    torch.testing.assert_close(out.embeddings, want, atol=1e-5, rtol=1e-5)


# -- bad input ---------------------------------------------------------------------------------------------------


def test_first_token_pooling_of_a_decoder_is_refused():
    model = model_for("llama")
    with pytest.raises(ConfigError, match="pooling 'first' cannot work with llama: in a causal decoder the first"):
        assemble(model, {"task": "embedding", "pooling": "first"})


def test_unknown_pooling_mode():
    model = model_for("bert")
    with pytest.raises(ConfigError, match="no plugin provides pooling mode 'meen'|unknown pooling mode 'meen'"):
        assemble(model, {"task": "embedding", "pooling": "meen"})


def test_unknown_loss_suggests():
    model = model_for("bert")
    with pytest.raises(ConfigError, match="loss 'MultipleNegativeRankingLoss' is not .* Did you mean "
                                          "'MultipleNegativesRankingLoss'"):
        assemble(model, {"task": "embedding", "task_options": {"loss": "MultipleNegativeRankingLoss"}})


def test_rows_missing_a_column_and_tampered_layout():
    model = model_for("bert")
    assembly = assemble(model, CONFIG)
    try:
        rows = rows_of({"anchor": make_examples([3, 4]), "positive": make_examples([2, 5])})
        del rows[1]["positive_input_ids"]
        with pytest.raises(BatchError, match="row 1 has no 'positive_input_ids'"):
            assembly.collator(rows)
        batch = assembly.collator(rows_of({"anchor": make_examples([3, 4]), "positive": make_examples([2, 5])}))
        batch["num_rows"] = 3
        with pytest.raises(BatchError, match="3 rows x 2 columns but packs 4 texts"):
            assembly.forward(model, batch)
    finally:
        assembly.undo()


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows[1].update(positive_input_ids=[]), "row 1: 'positive_input_ids' has no tokens"),
    (lambda rows: rows[0].update(anchor_input_ids=[7] * 300), r"example 0 \(anchor_input_ids\) has 300 tokens"),
    (lambda rows: rows[1].update(anchor_prompt_length="2"), "row 1: 'anchor_prompt_length' is '2'; a prompt length"),
    (lambda rows: rows[0].update(anchor_prompt_length=-3), "row 0: 'anchor_prompt_length' is -3"),
])
def test_a_bad_text_names_its_row_and_column(change, message):
    """Empty or over-long texts and impossible prompt lengths: the row and the column, not a packed position."""
    model = model_for("bert")
    assembly = assemble(model, {**load_config(CONFIG).to_dict(), "max_length": 64})
    try:
        rows = rows_of({"anchor": make_examples([3, 4]), "positive": make_examples([2, 5])},
                       anchor_prompt_length=[1, 2])
        assembly.collator(rows)
        change(rows)
        with pytest.raises(BatchError, match=message):
            assembly.collator(rows)
    finally:
        assembly.undo()


def test_the_dataset_check_reads_every_text_column():
    from padfree_plugins.packing.datacheck import check_dataset

    model = model_for("bert")
    assembly = assemble(model, {**load_config(CONFIG).to_dict(), "max_length": 64})
    try:
        rows = rows_of({"anchor": make_examples([3, 4, 5]), "positive": make_examples([2, 5, 6])})
        assert check_dataset(rows, assembly.collator) == 3
        rows[2]["positive_input_ids"] = []
        with pytest.raises(BatchError, match=r"example 2 of the train dataset \(positive_input_ids\) has no tokens"):
            check_dataset(rows, assembly.collator)
    finally:
        assembly.undo()
