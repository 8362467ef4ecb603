"""Worker of tests/test_position_limits.py (2 processes, ``torchrun``): a tiny Phi-3 with ``longrope`` (original length
32) under ``sequence_parallel.size: 2`` against one process on the same examples, the group's row holding short
examples on rank 0 and one example on rank 1. ``within``: every example within 32 tokens; ``beyond``: rank 1's
example of 40 tokens, fed through a collator without the limit (what sequence parallelism refuses). Rank 0 writes
``{case: {"loss": |SP - one process|, "grad": largest gradient difference, "refused": ranks whose real collator
refused their examples}}``
to ``<out>/result.pt``."""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from padfree_plugins import assemble
from padfree_plugins.batching.distributed import num_label_tokens
from padfree_plugins.errors import BatchError
from padfree_plugins.testing.models import random_examples, tiny_config, tiny_model

ORIGINAL = 32
CASES = {"within": ([10, 12, 15, 8], [30]), "beyond": ([10, 12, 15, 8], [40])}


def phi3_longrope() -> torch.nn.Module:
    plain = tiny_config("phi3")
    half = plain.hidden_size // plain.num_attention_heads // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0] * half, "long_factor": [4.0] * half}
    return tiny_model("phi3", "causal_lm", vocab_size=128, max_position_embeddings=2 * ORIGINAL,
                      original_max_position_embeddings=ORIGINAL, rope_parameters=rope).train()


def without_limit(collator):
    return dataclasses.replace(collator, packing=dataclasses.replace(collator.packing, max_length=None))


def labelled(lengths: list[int], seed: int) -> list[dict]:
    return [{**ex, "labels": list(ex["input_ids"])} for ex in random_examples(lengths, 128, seed=seed)]


def run(case: str, rank: int) -> dict:
    per_rank = [labelled(CASES[case][0], 0), labelled(CASES[case][1], 1)]
    model = phi3_longrope()
    assembly = assemble(model, {"attention": "exact", "sequence_parallel": {"size": 2}})
    refused = ""
    try:
        assembly.collator(per_rank[rank])
    except BatchError as error:
        refused = str(error)
    collator = without_limit(assembly.collator)
    count = num_label_tokens(collator(per_rank[rank])).clone()
    dist.all_reduce(count)
    loss = assembly.forward(model, collator(per_rank[rank]), num_items_in_batch=count).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    refusals = torch.tensor(int(bool(refused)))
    dist.all_reduce(refusals)
    if rank:
        return {}
    reference = phi3_longrope()
    alone = assemble(reference, {"attention": "exact"})
    examples = per_rank[0] + per_rank[1]
    batch = alone.collator(examples)
    want = alone.forward(reference, batch, num_items_in_batch=num_label_tokens(batch)).loss
    want.backward()
    grad = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return {"loss": abs(total.item() - want.item()), "grad": grad, "refused": int(refusals)}


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = {case: run(case, rank) for case in CASES}
    if rank == 0:
        torch.save(results, Path(out) / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
