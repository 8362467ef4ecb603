"""sentence-transformers losses and model features through padfree_plugins.accelerate(): the padded loss curve
(4 steps), or a clear error before training. Losses that run the model several times (per layer, per dimension,
in cached mini-batches), carry a classifier, call the model on listwise pairs, or read the features themselves.
"""

from __future__ import annotations

import contextlib
import functools
import random
import types
from unittest import mock

import pytest
import torch

import padfree_plugins
from padfree_plugins import PadfreeError
from padfree_plugins.testing.faults import leak_across_boundaries
from tests import test_sentence_transformers as st_tests
from tests.test_sentence_transformers import CONFIG, WORDS, CrossEncoder, sentences, tiny_sentence_transformer, train
from tests.ties import assert_clear, sorted_gaps, top2_gaps

_offline, minilm, tiny_dirs = st_tests._offline, st_tests.minilm, st_tests.tiny_dirs  # its fixtures, here too


def st_curves(model_factory, loss_factory, dataset, **args) -> list[list[float]]:
    """The padded and the padding-free loss curve of a SentenceTransformerTrainer."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    arguments = functools.partial(SentenceTransformerTrainingArguments, **args)
    curves = []
    for padfree in (False, True):
        model = model_factory()
        curves.append(train(SentenceTransformerTrainer, arguments, model, dataset, loss_factory(model), padfree,
                            ["a text", "another text"]))
    assert len(curves[0]) == 4
    return curves


def pairs(n: int = 32):
    from datasets import Dataset

    return Dataset.from_dict({"anchor": sentences(n, seed=4), "positive": sentences(n, seed=5)})


def st_loss_cases():
    from datasets import Dataset
    from sentence_transformers.sentence_transformer import losses

    rng = random.Random(0)
    classes = Dataset.from_dict({"sentence1": sentences(32, seed=7), "sentence2": sentences(32, seed=8),
                                 "label": [i % 3 for i in range(32)]})
    distill = Dataset.from_dict({"query": sentences(32, seed=4), "positive": sentences(32, seed=5),
                                 "negative": sentences(32, seed=6),
                                 "label": [[rng.gauss(0, 1), rng.gauss(0, 1)] for _ in range(32)]})
    return {
        "AdaptiveLayerLoss": (lambda m: losses.AdaptiveLayerLoss(m, losses.MultipleNegativesRankingLoss(m)), pairs),
        "Matryoshka2dLoss": (lambda m: losses.Matryoshka2dLoss(m, losses.MultipleNegativesRankingLoss(m), [32, 16]),
                             pairs),
        "MatryoshkaLoss(Cached)": (lambda m: losses.MatryoshkaLoss(
            m, losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), [32, 16, 8]), pairs),
        "MegaBatchMarginLoss": (lambda m: losses.MegaBatchMarginLoss(m, mini_batch_size=3), pairs),
        "SoftmaxLoss": (lambda m: losses.SoftmaxLoss(m, m.get_sentence_embedding_dimension(), 3), lambda: classes),
        "DistillKLDivLoss": (lambda m: losses.DistillKLDivLoss(m), lambda: distill),
    }


@pytest.mark.parametrize("name", list(st_loss_cases()))
def test_sentence_transformer_losses_same_loss_curve(tiny_dirs, name):
    from sentence_transformers import util

    loss_factory, data = st_loss_cases()[name]
    scores = []  # every cosine similarity matrix MegaBatchMarginLoss builds (anchors of a chunk x the positives)
    cos_sim = util.pytorch_cos_sim

    def recording(a, b):
        scores.append(cos_sim(a, b))
        return scores[-1]

    with mock.patch.object(util, "pytorch_cos_sim", recording):
        curves = st_curves(lambda: tiny_sentence_transformer(tiny_dirs["encoder"]), loss_factory, data())
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    if name == "MegaBatchMarginLoss":
        assert_hardest_negatives_clear(scores[:len(scores) // 2])  # the padded run's


def assert_hardest_negatives_clear(scores: list[torch.Tensor], positive_margin: float = 0.8,
                                   negative_margin: float = 0.3) -> None:
    """MegaBatchMarginLoss picks each anchor's hardest negative (an argmax) and hinges its positive and that
    negative at the margins: each choice, and each hinge, is 1e-5 or more from a tie in every chunk of the run
    (cosine similarities agree to ~1e-7 packed and padded), so no rounding of another CPU changes the gradient."""
    gaps, offset = [], 0
    for chunk in scores:
        rows = torch.arange(len(chunk))
        negatives = chunk.detach().double().clone()
        positives = negatives[rows, rows + offset].clone()
        negatives[rows, rows + offset] = float("-inf")
        gaps += [top2_gaps(negatives), positives - positive_margin, negatives.max(1).values - negative_margin]
        offset = (offset + len(chunk)) % chunk.shape[1]
    assert_clear(torch.cat(gaps), "the hardest negatives and the hinges", clear=1e-5)


@pytest.mark.parametrize("mode", ["mean", "cls", "weightedmean"])
def test_trainer_prompts_excluded_from_pooling_same_loss_curve(tiny_dirs, mode):
    """The trainer's ``prompts`` with ``include_prompt=False``: the prompt tokens are left out of every packed
    text's pooling, as padded (a prompt per column, of different lengths)."""
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    def model():
        built = tiny_sentence_transformer(tiny_dirs["encoder"], mode=mode)
        built[1].include_prompt = False
        return built

    prompts = {"anchor": "query: ", "positive": "passage: a longer document prompt: "}
    curves = st_curves(model, lambda m: CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), pairs(),
                       prompts=prompts)
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    with_prompt = st_curves(lambda: tiny_sentence_transformer(tiny_dirs["encoder"], mode=mode),
                            lambda m: CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), pairs(),
                            prompts=prompts)[1]
    assert abs(with_prompt[0] - curves[1][0]) > 1e-4  # the prompt really is left out


def test_contrastive_tension_labels_from_packed_texts(tiny_dirs):
    """ContrastiveTensionLoss without a label column labels a pair by whether its texts are the same tokens; on
    packed features that is read per text (it compared whole padded rows: an error mid-training)."""
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import ContrastiveTensionLoss

    first = sentences(32, seed=4)
    rng = random.Random(0)
    second = [text if rng.random() < 0.4 else rng.choice(first) for text in first]
    assert 4 < sum(a == b for a, b in zip(first, second)) < 28
    dataset = Dataset.from_dict({"text1": first, "text2": second})
    losses = []
    curves = st_curves(lambda: tiny_sentence_transformer(tiny_dirs["encoder"]),
                       lambda m: losses.append(ContrastiveTensionLoss(m)) or losses[-1], dataset)
    assert curves[1] == pytest.approx(curves[0], rel=1e-6)  # a summed loss (~100): fp32 relative precision
    assert "forward" not in losses[1].__dict__  # undone


def test_denoising_auto_encoder_loss_refused_before_training(tiny_dirs, tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import DenoisingAutoEncoderLoss, MatryoshkaLoss

    model = tiny_sentence_transformer(tiny_dirs["encoder"])
    dataset = Dataset.from_dict({"damaged": sentences(8, seed=1), "original": sentences(8, seed=2)})
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    loss = DenoisingAutoEncoderLoss(model, tie_encoder_decoder=True)
    for wrapped in (loss, MatryoshkaLoss(model, loss, [32, 16])):  # alone or inside another loss
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=wrapped)
        with pytest.raises(PadfreeError, match="DenoisingAutoEncoderLoss feeds its decoder the padded token ids"):
            padfree_plugins.accelerate(trainer, CONFIG)
        assert not model[0].can_flatten_inputs  # nothing left patched
        assert model[0].auto_model.config._attn_implementation == "sdpa"



@pytest.mark.parametrize("mode", ["cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"])
def test_every_pooling_mode_and_module_stack_encodes_as_padded(tiny_dirs, mode):
    """encode() of Transformer + Pooling (each mode, the prompt left out of pooling) + Dense + LayerNorm +
    Normalize, truncated to max_seq_length, equals padded encode()."""
    import padfree_sentence_transformers as pst
    from sentence_transformers.sentence_transformer.modules import Dense, LayerNorm, Normalize

    model = tiny_sentence_transformer(tiny_dirs["encoder"], mode=mode)
    model[1].include_prompt = False
    for module in (Dense(32, 16), LayerNorm(16), Normalize()):
        model.append(module)
    model.max_seq_length = 24
    texts = sentences(12, seed=3)
    want = model.encode(texts, prompt="query: a prompt ", batch_size=5, convert_to_tensor=True)
    with pst.enable(model, CONFIG):
        got = model.encode(texts, prompt="query: a prompt ", batch_size=5, convert_to_tensor=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert want.std(dim=0).max() > 1e-3

# -- CrossEncoder ---------------------------------------------------------------------------------------------------


def documents(n: int, seed: int) -> list[str]:
    """``n`` documents of different lengths: a query's documents score well apart (equal documents score alike up
    to rounding, and a rank-based loss would order them by that rounding; :func:`assert_ranks_clear` checks it)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for words in rng.sample([1, 2, 3, 8, 15, 40], n)]


class Scores(torch.nn.Module):
    """An identity ``activation_fn`` that keeps the scores a listwise loss ranks, and the sizes of their groups;
    ``noise``: it multiplies them by ``1 + noise * N(0, 1)`` (seeded), rounding of another CPU simulated."""

    def __init__(self):
        super().__init__()
        self.scores, self.groups, self.noise = [], [], 0.0
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        if self.noise:
            scores = scores * (1 + self.noise * torch.randn(scores.shape, generator=self.generator))
        self.scores.append(scores.detach().clone())
        return scores

    def record_groups(self, loss: torch.nn.Module, args: tuple) -> None:
        self.groups.append([len(docs) for docs in args[0][1]])


def ce_cases():
    from datasets import Dataset
    from sentence_transformers.cross_encoder import losses

    rng = random.Random(0)
    queries = sentences(32, seed=6)
    docs = [documents(rng.choice([2, 3, 5]), seed=100 + i) for i in range(32)]
    listwise = Dataset.from_dict({"query": queries, "docs": docs,
                                  "labels": [[rng.random() for _ in group] for group in docs]})
    triples = Dataset.from_dict({"query": queries, "positive": sentences(32, seed=7),
                                 "negative": sentences(32, seed=8)})
    classes = Dataset.from_dict({"query": queries, "document": sentences(32, seed=7),
                                 "label": [i % 3 for i in range(32)]})
    return {
        "LambdaLoss": (1, lambda m: ranked(losses.LambdaLoss(m, mini_batch_size=4, activation_fn=Scores())), listwise),
        "ListNetLoss": (1, lambda m: losses.ListNetLoss(m), listwise),
        "PListMLELoss": (1, lambda m: losses.PListMLELoss(m), listwise),
        "MultipleNegativesRankingLoss": (1, lambda m: losses.MultipleNegativesRankingLoss(m), triples),
        "CrossEntropyLoss": (3, lambda m: losses.CrossEntropyLoss(m), classes),
    }


def ranked(loss: torch.nn.Module) -> torch.nn.Module:
    """A listwise loss whose ``activation_fn`` is :class:`Scores`, told the sizes of its groups at every call."""
    loss.register_forward_pre_hook(loss.activation_fn.record_groups)
    return loss


def ce_curves(tiny_dirs, tmp_path, name: str, dtype: torch.dtype = torch.float32, leak: float = 0.0,
              noise: float = 0.0):
    """The padded and the padding-free loss curve of a CrossEncoderTrainer (the model in ``dtype``; ``leak``: a
    deliberate leak across boundaries in the padding-free run; ``noise``: the padding-free run's ranked scores
    perturbed by that much relative noise, as another CPU's rounding would), and the two losses."""
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from transformers import BertForSequenceClassification

    num_labels, loss_factory, dataset = ce_cases()[name]
    path = tiny_dirs["cross"]
    if num_labels != 1:
        torch.manual_seed(0)
        BertForSequenceClassification.from_pretrained(path, num_labels=num_labels,
                                                      ignore_mismatched_sizes=True).save_pretrained(tmp_path)
        CrossEncoder(path).tokenizer.save_pretrained(tmp_path)
        path = str(tmp_path)
    curves, used = [], []
    for padfree in (False, True):
        torch.manual_seed(0)
        model = CrossEncoder(path, device="cpu").to(dtype)
        used.append(loss_factory(model))
        if padfree and noise:
            used[-1].activation_fn.noise = noise
        with leak_across_boundaries(model, strength=leak) if padfree and leak else contextlib.nullcontext():
            curves.append(train(CrossEncoderTrainer, CrossEncoderTrainingArguments, model, dataset, used[-1],
                                padfree, [("a query", "a document")]))
    assert len(curves[0]) == 4
    return curves, used


def assert_ranks_clear(loss: torch.nn.Module) -> None:
    """A rank-based loss saw no near-tie over the run: the scores of each query's documents lie at least
    :data:`tests.ties.CLEAR` apart at every step, so no rounding (of another CPU) can reorder them."""
    recorded = loss.activation_fn
    assert len(recorded.scores) == len(recorded.groups) == 4
    gaps = torch.cat([sorted_gaps(scores, groups) for scores, groups in zip(recorded.scores, recorded.groups)])
    assert_clear(gaps, "scores of one query's documents")


@pytest.mark.parametrize("name", list(ce_cases()))
def test_cross_encoder_losses_same_loss_curve(tiny_dirs, tmp_path, name):
    """Losses that build their own (query, document) pairs and call the model on them (listwise, in-batch
    negatives), and a 3-label head: the pairs they tokenize are packed too, and score as padded."""
    curves, used = ce_curves(tiny_dirs, tmp_path, name)
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    if isinstance(used[0].activation_fn if hasattr(used[0], "activation_fn") else None, Scores):
        assert_ranks_clear(used[0])  # LambdaLoss sorts the scores: the curve is continuous only clear of ties


def test_cross_encoder_rank_loss_in_float64_equals_padded_to_1e10(tiny_dirs, tmp_path):
    """In float64 LambdaLoss's padded and padding-free curves agree to 1e-10: what differs between them in fp32
    (and between CPU kinds) is rounding, not packing. A leak of 1e-3 across boundaries moves the curve far more."""
    curves, _ = ce_curves(tiny_dirs, tmp_path, "LambdaLoss", torch.float64)
    assert curves[1] == pytest.approx(curves[0], abs=1e-10)
    leaking, _ = ce_curves(tiny_dirs, tmp_path, "LambdaLoss", torch.float64, leak=1e-3)
    assert max(abs(a - b) for a, b in zip(leaking[1], curves[0])) > 1e-5


def test_cross_encoder_rank_loss_insensitive_to_rounding_level_noise(tiny_dirs, tmp_path):
    """Another CPU's rounding, simulated: the padding-free run's scores perturbed by 1e-6 relative noise still give
    the padded curve (with two equal documents of a query, as the data had, such noise moves it by ~1e-2)."""
    curves, used = ce_curves(tiny_dirs, tmp_path, "LambdaLoss", noise=1e-6)
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    assert_ranks_clear(used[1])


def test_a_near_tie_of_ranked_scores_is_refused(tiny_dirs, tmp_path):
    """The guard of the rank-based case fails on two equal documents of one query (the data it used to have)."""
    loss = Scores()
    loss.scores, loss.groups = [torch.tensor([0.3, 0.3 + 3e-7, -0.1])] * 4, [[2, 1]] * 4
    with pytest.raises(AssertionError, match="rounding can flip them"):
        assert_ranks_clear(types.SimpleNamespace(activation_fn=loss))


# -- SparseEncoder (SPLADE) -----------------------------------------------------------------------------------------


def test_sparse_encoder_encode_and_splade_training_equal_padded(tiny_dirs, tmp_path):
    """A SparseEncoder (MLM logits, SpladePooling per packed text): encode() as padded, and SparseEncoderTrainer
    with SpladeLoss (ranking + FLOPS regularizers) through the same accelerate() call, the padded loss curve."""
    import padfree_sentence_transformers as pst
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments, losses
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    tokenizer = CrossEncoder(tiny_dirs["cross"]).tokenizer
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    def model(mode: str = "max") -> SparseEncoder:
        torch.manual_seed(0)
        return SparseEncoder(modules=[MLMTransformer(str(tmp_path)), SpladePooling(mode)], device="cpu")

    texts = sentences(10, seed=3)
    for mode in ("max", "sum"):
        sparse = model(mode)
        want = sparse.encode(texts, batch_size=4, convert_to_tensor=True).to_dense()
        with pst.enable(sparse, CONFIG):
            assert "cu_seq_lens_q" in sparse.preprocess(texts[:2])
            got = sparse.encode(texts, batch_size=4, convert_to_tensor=True).to_dense()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
        assert want.abs().max() > 0.1

    curves = []
    for padfree in (False, True):
        sparse = model()
        loss = losses.SpladeLoss(sparse, losses.SparseMultipleNegativesRankingLoss(sparse),
                                 document_regularizer_weight=3e-3, query_regularizer_weight=5e-3)
        curves.append(train(SparseEncoderTrainer, SparseEncoderTrainingArguments, sparse, pairs(), loss, padfree,
                            ["a text", "another text"]))
    assert len(curves[0]) == 4
    # losses ~100 with gradients ~600 (summed over the vocabulary): fp32 rounding grows to ~2e-5 relative by step 4
    assert curves[1] == pytest.approx(curves[0], rel=1e-4)
