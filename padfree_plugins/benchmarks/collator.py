"""Collator benchmark: our packing collator vs ``transformers.DataCollatorWithFlattening`` on the same batches.

Both produce the same packed row (ids, labels with each example's first label ignored, positions, boundaries,
seq_idx); the benchmark checks that, then times both, interleaved, and reports the ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from padfree_plugins.benchmarks.lengths import lognormal_lengths
from padfree_plugins.packing.collator import PackingCollator


@dataclass
class CollatorResult:
    batch_size: int
    batches: int
    ours_ms: float
    hf_ms: float

    @property
    def ratio(self) -> float:
        """Our time as a fraction of HF's (lower is better; the target is <= 0.5)."""
        return self.ours_ms / self.hf_ms


def make_batches(batch_size: int, batches: int, median: float = 120, sigma: float = 0.6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batches):
        lengths = lognormal_lengths(batch_size, median, sigma, 8, 2048, seed + b)
        rows = []
        for n in lengths:
            ids = torch.randint(3, 32000, (n,), generator=generator).tolist()
            rows.append({"input_ids": ids, "labels": list(ids)})
        out.append(rows)
    return out


def _check_same(ours: dict, theirs: dict) -> None:
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        if not torch.equal(ours[key], theirs[key]):
            raise AssertionError(f"collators disagree on {key}")
    if ours["max_length_q"] != theirs["max_length_q"]:
        raise AssertionError("collators disagree on max_length_q")


def run_collator_benchmark(batch_size: int = 16, batches: int = 200, rounds: int = 3,
                           progress: Callable[[str], None] | None = None) -> CollatorResult:
    """Median-of-rounds time per batch for both collators on identical batches; ``progress`` gets a line a round."""
    say = progress or (lambda _: None)
    from transformers import DataCollatorWithFlattening

    data = make_batches(batch_size, batches)
    ours = PackingCollator(token_keys=("labels",), masked_first_keys=("labels",))
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    _check_same(ours(data[0]), hf(data[0]))
    times = {"ours": [], "hf": []}
    for r in range(rounds):
        for name, collator in (("ours", ours), ("hf", hf)):
            start = time.perf_counter()
            for rows in data:
                collator(rows)
            times[name].append((time.perf_counter() - start) / batches * 1e3)
        say(f"bs{batch_size} round {r + 1}/{rounds}: ours {times['ours'][-1]:.3f} ms, HF {times['hf'][-1]:.3f} ms "
            "per batch")
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return CollatorResult(batch_size, batches, median["ours"], median["hf"])
