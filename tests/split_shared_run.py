"""torchrun worker of tests/test_split_shared_mixers.py: a row with shared prefixes through hybrid models whose sequence
mixers run split across the ranks of a sequence-parallel group (``sequence_parallel.mixers: split``), against one
process's padded call.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 tests/split_shared_run.py OUT

Every rank builds the tiny model (slow decays: a wrong state shows), computes the padded call alone (the reference:
log-probabilities of every vocabulary entry at the tokens of the shared row, and the parameter gradients of one
weighted sum of them), then assembles the model with ``sequence_parallel.size`` of the case (groups of 2 or 4 ranks),
runs its slice of the shared row, and sums the gradients over its group. Rank 0 writes ``OUT``: per case the largest
log-probability difference, the largest gradient difference relative to its parameter's gradient scale, and the
evidence that the split path ran (split mixers installed, the structure in the slice); per memory case the bytes of
activations autograd saved on each rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from padfree_plugins import assemble
from padfree_plugins.benchmarks.measure import saved_activation_bytes
from padfree_plugins.modeling import unpad
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY
from padfree_plugins.packing.sequence_parallel import SEGMENT_PARENTS_KEY, segment_parents, slice_row
from padfree_plugins.testing import faults
from tests.distributed_common import finish, gloo_group, leave

VOCAB = 96
#: Prompt lengths and each row's (prompt, completion length). Prompt 2 begins with prompt 1's first token, so the row
#: is a two-level tree: a one-token root (that token), under it prompt 1's rest (21 tokens: a prefix of its own, with
#: 3 completions) and prompt 2's two rows. 153 tokens: under SP2 (slices of 77) the cut falls inside prompt 1's rest,
#: whose first token is the last of rank 0 (a one-token piece continuing its parent's state), and prompt 2's rows
#: sit on rank 1, their one-token parent on rank 0; under SP4 (slices of 39) prompt 0's last children sit on rank 1,
#: prompt 2's rows on rank 3 (their parent's state relayed through ranks 1 and 2). tests/test_split_shared_mixers.py
#: asserts these properties.
PROMPTS = {0: 22, 1: 23, 2: 2}
ROWS = [(0, 5), (0, 39), (1, 2), (2, 4), (0, 1), (1, 39), (0, 5), (2, 2), (1, 4)]
MODES = ("split", "gather")


@dataclass(frozen=True)
class Case:
    name: str
    model_type: str
    sp: int
    fault: str = ""
    checkpointing: bool = False
    mixers: str = "split"


CASES = [
    Case("qwen3_5_text-sp2", "qwen3_5_text", 2),
    Case("bamba-sp2", "bamba", 2),
    Case("nemotron_h-sp2", "nemotron_h", 2),
    Case("lfm2-sp2", "lfm2", 2),
    Case("qwen3_5_text-sp4", "qwen3_5_text", 4),
    Case("bamba-sp4", "bamba", 4),
    Case("qwen3_5_text-sp2-checkpointing", "qwen3_5_text", 2, checkpointing=True),
    Case("qwen3_5_text-sp2-gather", "qwen3_5_text", 2, mixers="gather"),
    Case("qwen3_5_text-sp2-predecessor", "qwen3_5_text", 2, fault="predecessor"),
    Case("bamba-sp4-predecessor", "bamba", 4, fault="predecessor"),
    Case("lfm2-sp2-predecessor", "lfm2", 2, fault="predecessor"),
    Case("qwen3_5_text-sp2-slice-only", "qwen3_5_text", 2, fault="slice-only"),
]
FAULTS = {"predecessor": faults.child_starts_from_rank_predecessor, "slice-only": faults.mixer_scans_only_its_slice}
#: The model and the group size whose activations are measured split and gathered.
MEMORY = ("qwen3_5_text", 2)


def padded_call(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The right-padded rows of :data:`ROWS`, labels on the completions (tests/test_hybrid_prefixes.py's)."""
    from tests.test_hybrid_prefixes import padded_rows

    generator = torch.Generator().manual_seed(0)
    prompts = {key: torch.randint(3, vocab, (length,), generator=generator) for key, length in PROMPTS.items()}
    prompts[0][0] = prompts[1][0] % (vocab - 3) + 3  # prompt 0 shares no token with the others
    prompts[2][0] = prompts[1][0]
    return padded_rows([(prompts[key], torch.randint(3, vocab, (length,), generator=generator))
                        for key, length in ROWS])


def shared_row(ids, mask, labels) -> tuple[dict, torch.Tensor]:
    """The shared row of the padded call and where its tokens sit in the padded call (flat indices)."""
    packed, unpadded = unpad.pack_padded_call({"input_ids": ids}, mask, labels, False, True)
    return packed, unpadded.index


def build(model_type: str, checkpointing: bool):
    from tests.test_hybrid_prefixes import model_for

    model = model_for(model_type)
    if checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def weights(tokens: int, vocab: int) -> torch.Tensor:
    return torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(1))


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for name, p in model.named_parameters()}


def reference(model, ids, mask, index) -> tuple[torch.Tensor, dict]:
    """The padded call alone: log-probabilities at the shared row's tokens (in its order) and the gradients."""
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    log_probs = logits.reshape(-1, logits.shape[-1])[index].log_softmax(-1)
    (log_probs * weights(*log_probs.shape)).sum().backward()
    return log_probs.detach(), gradients(model)


def local_slice(packed: dict, rank: int, sp: int) -> dict:
    row = dict(packed)
    row[SEGMENT_PARENTS_KEY] = segment_parents(row)
    row.pop(SHARED_PREFIXES_KEY)
    local = slice_row(row, rank, sp)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
            SHARED_PREFIXES_KEY)
    return {key: local[key] for key in keys}


def split_step(model, local: dict, rank: int, sp: int, tokens: int) -> torch.Tensor:
    """This rank's slice of the shared row through the model: its share of the weighted sum."""
    logits = model(**local, use_cache=False).logits.float()[0]
    length, vocab = logits.shape
    weight = torch.cat([weights(tokens, vocab), torch.zeros(length * sp - tokens, vocab)])[rank * length:
                                                                                           (rank + 1) * length]
    local_log_probs = logits.log_softmax(-1)
    split_step.log_probs = local_log_probs.detach()
    return (local_log_probs * weight).sum()


def run_case(case: Case, rank: int, world: int, ids, mask, labels) -> dict:
    model = build(case.model_type, case.checkpointing)
    packed, index = shared_row(ids, mask, labels)
    want, want_grads = reference(model, ids, mask, index)
    parents = packed[SHARED_PREFIXES_KEY].parents
    model.zero_grad()
    group_rank = rank % case.sp
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact",
                                "sequence_parallel": {"size": case.sp, "mixers": case.mixers}})
    split = sum(type(module.__dict__.get("forward")).__name__ == "SplitMixer" for module in model.modules())
    local = local_slice(packed, group_rank, case.sp)
    tokens = index.numel()
    with FAULTS[case.fault]() if case.fault else contextlib.nullcontext():
        split_step(model, local, group_rank, case.sp, tokens).backward()
    pieces = [torch.empty_like(split_step.log_probs) for _ in range(world)]
    dist.all_gather(pieces, split_step.log_probs.contiguous())
    got = torch.cat(pieces[:case.sp])[:tokens]
    grads = gradients(model)
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= world // case.sp
    assembly.undo()
    grad_diff = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-3)) for n, g in want_grads.items())
    return {"log_probs": float((got - want).abs().max()), "grads": grad_diff, "split": split,
            "checkpointing": model.is_gradient_checkpointing and model.training,
            "shared": local[SHARED_PREFIXES_KEY].parents[:len(parents)] == parents,
            "largest_grad": max(float(g.abs().max()) for g in want_grads.values())}


def memory(rank: int, world: int, ids, mask, labels) -> dict:
    """Bytes of activations autograd saves on this rank for its slice of the shared row, mixers split and gathered."""
    model_type, sp = MEMORY
    packed, index = shared_row(ids, mask, labels)
    saved = {}
    for mode in MODES:
        model = build(model_type, False)
        assembly = assemble(model, {"task": "causal_lm", "attention": "exact",
                                    "sequence_parallel": {"size": sp, "mixers": mode}})
        local = local_slice(packed, rank % sp, sp)
        saved[mode] = saved_activation_bytes(lambda: split_step(model, local, rank % sp, sp, index.numel()))
        model.zero_grad()
        assembly.undo()
    return saved


def main(out: str) -> None:
    gloo_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, mask, labels = padded_call()
    results: dict = {"row": shared_row(ids, mask, labels)[0]["cu_seq_lens_q"].tolist(),
                     "parents": shared_row(ids, mask, labels)[0][SHARED_PREFIXES_KEY].parents}
    only = os.environ.get("SP_CASES")  # a comma-separated subset of the cases (for debugging)
    for case in CASES:
        if only and case.name not in only.split(","):
            continue
        started = time.monotonic()
        try:
            results[case.name] = run_case(case, rank, world, ids, mask, labels)
        except Exception:
            results[case.name] = {"error": traceback.format_exc()}
            print(f"rank {rank}, {case.name}: {results[case.name]['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            print(f"{case.name}: {time.monotonic() - started:.1f} s {results[case.name]}", flush=True)
        dist.barrier()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, memory(rank, world, ids, mask, labels))
    results["memory"] = everyone
    finish(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
    leave()
