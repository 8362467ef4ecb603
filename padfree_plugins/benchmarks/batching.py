"""Batching benchmark: example-count batches vs token-budget batches across simulated data-parallel ranks.

Two parts, in one run:

* **balance** (no model): an epoch of each length law is split into micro-batches for ``N`` ranks, either the
  usual way (shuffle, then ``bs`` examples per rank per step, ``bs`` chosen so that a micro-batch averages the
  token budget) or with :class:`~padfree_plugins.batching.sampler.TokenBudgetBatchSampler`. Reported per step: the rank
  token spread (max / min tokens over the ranks), the padding a padded batch would carry, and the idle share of
  a synchronous step (every rank waits for the one with the most tokens: ``1 - mean / max`` tokens).
* **throughput**: a tiny Llama, padding-free, runs forward + backward on every rank's micro-batch of the first
  steps, one after another (one thread: one simulated rank = one core); a synchronous data-parallel step takes as
  long as its slowest rank, so the step time is the max over the ranks. Reported: real tokens per second of the
  whole simulated cluster for both batchings, interleaved step by step in one run.

Length laws (:data:`~padfree_plugins.benchmarks.lengths.BATCHING_LAWS`): ``lognormal`` (median 120, sigma 0.6,
clipped to 8..2048, like SFT sets such as OrcaMath) and ``mix``
(:func:`~padfree_plugins.benchmarks.lengths.short_texts_and_long_documents`; longer than the ``mix`` of bench sft).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from padfree_plugins.batching.sampler import TokenBudgetBatchSampler
from padfree_plugins.benchmarks.lengths import BATCHING_LAWS, batching_law_lengths
from padfree_plugins.benchmarks.measure import torch_threads

LAWS = tuple(BATCHING_LAWS)


def example_count_plan(lengths: list[int], batch_size: int, num_replicas: int, seed: int = 0) -> list[list[int]]:
    """The usual batching: shuffle, then ``batch_size`` examples per rank per step (step-major, last partial
    step dropped)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    per_step = batch_size * num_replicas
    steps = len(order) // per_step
    return [order[i * batch_size : (i + 1) * batch_size].tolist() for i in range(steps * num_replicas)]


@dataclass
class BalanceResult:
    law: str
    ranks: int
    batching: str  # "examples (bs=…)" or "tokens (…)"
    steps: int
    tokens_per_micro_batch: float
    spread_mean: float
    spread_max: float
    padding: float  # share of a padded [bs, L_max] micro-batch that is padding
    idle: float  # share of rank-time spent waiting for the slowest rank (token-cost model)


def _balance(law: str, ranks: int, batching: str, lengths: np.ndarray, plan: list[list[int]]) -> BalanceResult:
    tokens = np.asarray([lengths[b].sum() for b in plan], dtype=np.float64).reshape(-1, ranks)
    padded = sum(len(b) * lengths[b].max() for b in plan)
    spread = tokens.max(axis=1) / tokens.min(axis=1)
    return BalanceResult(law, ranks, batching, len(tokens), float(tokens.mean()), float(spread.mean()),
                         float(spread.max()), 1 - float(tokens.sum()) / padded,
                         1 - float(tokens.sum()) / float(ranks * tokens.max(axis=1).sum()))


def plans(law: str, ranks: int, examples: int, max_tokens: int, seed: int = 0):
    """(lengths, example-count plan and its label, token-budget plan and its label) for one law and rank count."""
    lengths = batching_law_lengths(law, examples, seed)
    batch_size = max(1, round(max_tokens / float(np.mean(lengths))))
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, num_replicas=ranks, seed=seed)
    return (np.asarray(lengths), (f"examples (bs={batch_size})", example_count_plan(lengths, batch_size, ranks, seed)),
            (f"tokens ({max_tokens})", sampler.plan()))


def run_balance(laws=LAWS, ranks=(2, 8), examples: int = 20000, max_tokens: int = 4096,
                progress: Callable[[str], None] | None = None) -> list[BalanceResult]:
    """Balance figures for every law and rank count, both batchings; ``progress`` gets a line each."""
    say = progress or (lambda _: None)
    results = []
    for law in laws:
        for n in ranks:
            lengths, *both = plans(law, n, examples, max_tokens)
            results += [_balance(law, n, label, lengths, plan) for label, plan in both]
            say(f"balance {law}, {n} ranks: " + ", ".join(f"{r.batching} spread {r.spread_mean:.3f}"
                                                         for r in results[-len(both):]))
    return results


@dataclass
class ThroughputResult:
    law: str
    ranks: int
    batching: str
    steps: int
    real_tokens: int
    spread_mean: float
    seconds: float  # sum over steps of the slowest rank's forward + backward

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds


def _tiny_llama():
    """A tiny Llama (2 layers, d=128, GQA 4/2), random weights, patched padding-free (exact attention)."""
    from transformers import LlamaConfig, LlamaModel

    from padfree_plugins.assembly import assemble

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))
    return model.train(), assemble(model, {"task": "hidden_states", "attention": "exact"})


def _step_seconds(model, collator, rows: list[dict]) -> float:
    batch = collator(rows)
    start = time.perf_counter()
    model(**batch.model_inputs()).last_hidden_state.pow(2).mean().backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def run_throughput(law: str = "lognormal", ranks=(2, 8), steps: int = 8, max_tokens: int = 2048,
                   examples: int = 4000, seed: int = 0,
                   progress: Callable[[str], None] | None = None) -> list[ThroughputResult]:
    """Real tokens/s of a simulated synchronous data-parallel run, example-count vs token-budget batches;
    ``progress`` gets a line a step."""
    say = progress or (lambda _: None)
    model, assembly = _tiny_llama()
    vocab = model.config.vocab_size
    try:
        with torch_threads(1):  # one simulated rank = one core: steadier timings on a shared machine
            generator = torch.Generator().manual_seed(seed)
            results = []
            for n in ranks:
                lengths, *both = plans(law, n, examples, max_tokens, seed)
                rows = [{"input_ids": torch.randint(5, vocab, (int(length),), generator=generator).tolist()}
                        for length in lengths]
                _step_seconds(model, assembly.collator, [rows[0]])  # warm-up
                timed = {label: 0.0 for label, _ in both}
                for step in range(steps):  # interleaved, so machine noise hits both sides alike
                    for label, plan in both:
                        micro = plan[step * n : (step + 1) * n]
                        timed[label] += max(_step_seconds(model, assembly.collator, [rows[i] for i in b])
                                            for b in micro)
                    say(f"throughput {n} ranks, step {step + 1}/{steps}: "
                        + ", ".join(f"{label} {seconds:.2f} s" for label, seconds in timed.items()))
                for label, plan in both:
                    tokens = np.asarray([lengths[b].sum() for b in plan[: steps * n]]).reshape(steps, n)
                    results.append(ThroughputResult(law, n, label, steps, int(tokens.sum()),
                                                    float((tokens.max(1) / tokens.min(1)).mean()), timed[label]))
            return results
    finally:
        assembly.undo()


def gain(results: list[ThroughputResult]) -> dict[int, float]:
    """Token-budget tokens/s over example-count tokens/s, per rank count."""
    by_ranks: dict[int, dict[str, float]] = {}
    for r in results:
        by_ranks.setdefault(r.ranks, {})["tokens" if r.batching.startswith("tokens") else "examples"] = r.tokens_per_s
    return {n: v["tokens"] / v["examples"] for n, v in by_ranks.items() if len(v) == 2 and not math.isnan(v["tokens"])}
