"""torchrun worker of tests/test_sequence_parallel.py: every case of one launch, sequence-parallel, in one launch.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node N tests/sequence_parallel_run.py LAUNCH OUT_DIR

``LAUNCH`` names a list of :data:`LAUNCHES` (``"sp2"``: 2 processes, ``"sp4"``: 4). For each :class:`Case` every
rank builds the tiny model (:func:`build`), assembles it with ``sequence_parallel.size`` = ``case.sp``, and for each
step and each micro-step of :func:`micro_batches` packs its own examples (rank ``r`` takes ``[r]``) and runs the
assembly's forward + backward with ``num_items_in_batch`` = the micro-step's label count over all ranks. The
gradients are summed over all ranks (what DDP's all-reduce gives, times the world size a DDP loss is scaled by);
a training case then takes an SGD step. Rank 0 writes ``OUT_DIR/<case>.pt``: the step losses summed over ranks,
the last step's gradients, the final weights, and what shows the sequence-parallel path ran. A case that raises
writes its error instead (a refusal case expects one). ``case.fault`` deliberately breaks one thing (:data:`FAULTS`);
``case.compiled`` runs the forward through ``torch.compile(model)`` (aot_eager) and records its graphs and breaks.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from padfree_plugins import assemble
from padfree_plugins.batching.distributed import num_label_tokens
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from padfree_plugins.testing import faults
from padfree_plugins.testing.compiled import compile_report, counting_backend
from padfree_plugins.testing.models import random_examples, tiny_model

#: Example lengths of each rank's micro-batch (for up to 4 ranks), per micro-step. Micro-step 0: every cut of a
#: group's row falls inside an example, and the rows have odd lengths (SP2: 37 + 30 = 67 tokens, cut at 34 inside
#: the 3rd example; SP4: 113 tokens padded to 116, cuts 29 / 58 / 87, each inside one). Micro-step 1: every rank's
#: micro-batch but the first starts with a 1-token example (and rank 0's ends with one), so that with 15 tokens per
#: rank (14 on rank 3) a 1-token example sits right after every cut, of SP2, SP2 x DP2 and SP4 alike.
#: tests/test_sequence_parallel.py asserts these properties.
LENGTHS = (([7, 19, 11], [1, 23, 6], [13, 2, 9], [17, 5]),
           ([9, 5, 1], [1, 10, 4], [1, 8, 6], [1, 13]))
#: One more micro-step for the all-gather cases: at SP4 (78 tokens padded to 80, cuts 20 / 40 / 60) the example of 40
#: tokens at 5..45 spans ranks 0-2, and the one at 57..64 crosses the last cut: every cut falls inside an example.
SPANNING = ([5, 40], [9], [3, 7], [12, 2])
#: Rows where one example spans three ranks of SP4 (the row 132 tokens, cuts 33 / 66 / 99: the example at 3..73
#: covers all of rank 1's slice) and a 1-token piece follows a cut (the example at 80..100), for the split mixers.
SPANNING_MIXERS = ([3, 70], [2], [5, 20], [32])
#: The micro-steps of each case, by ``Case.lengths``.
LENGTH_SETS = {"": LENGTHS, "spanning": (*LENGTHS, SPANNING), "spanning-mixers": (SPANNING_MIXERS,),
               "first": LENGTHS[:1]}
VOCAB = 96
LR = 0.5
#: What each tiny model needs on top of tiny_model's defaults for the test to mean something.
MODELS = {
    "llama": {},
    "qwen3": {"num_key_value_heads": 2},  # fewer key/value heads than SP4 ranks: replicated
    # 6 attention heads (SP4 cannot split them: all-gather), 2 key / value heads (GQA groups of 3)
    "llama_kv2": {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48, "intermediate_size": 96},
    "gpt_oss": {"sliding_window": 6},  # shorter than most examples, so the sliding layers' window bites
    # soft-capped attention scores, sliding layers whose window bites (all-gather)
    "gemma2": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 2.0},
    "qwen3_5_text": {},  # gated delta rule layers around a full-attention one
    "nemotron_h": {},  # Mamba2 layers, attention, MoE
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"]},  # the tiny default has no conv layer
    # routed experts with their load-balancing loss in the loss, weighted so that its gradient shows
    "qwen3_moe": {"output_router_logits": True, "router_aux_loss_coef": 0.5},
}
#: Every other hybrid family (tests/hybrids_common.py lists them all), at its tiny defaults (the Mamba2 ones smaller,
#: below), in the sp2 launch: each runs its sequence mixers (gated delta rule, KDA, Mamba2, short conv) on its slice,
#: the state passed across the cut (Mamba1: on the whole row) under sequence parallelism.
OTHER_HYBRIDS = ("qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "granitemoehybrid", "bamba",
                 "falcon_h1", "jamba", "mamba", "falcon_mamba", "mamba2", "lfm2_moe")
MAIN_MODELS = tuple(MODELS)
MODELS.update({model_type: {} for model_type in OTHER_HYBRIDS})
#: The Mamba2 mixers of tests/hybrids_common.py (4 heads, state 8, scan chunks of 16 tokens, so that the rows span
#: several chunks) instead of transformers' defaults (128 heads, state 256, chunks of 256), whose reference PyTorch
#: scan took ~40 s a forward-backward on CPU.
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_expand=1,
              mamba_chunk_size=16)
MODELS.update(granitemoehybrid=MAMBA2, bamba=MAMBA2, falcon_h1={**MAMBA2, "mamba_d_ssm": 64})
#: The model types of the variants of :data:`MODELS` that are not model types.
BASE_TYPES = {"llama_kv2": "llama"}
#: The model types whose sequence mixers the sequence-parallel patch must have wrapped.
HYBRID_TYPES = ("qwen3_5_text", "nemotron_h", "lfm2", *OTHER_HYBRIDS)
#: Those whose mixers run split across the ranks (Mamba1 cannot start from a state: gathered).
SPLIT_TYPES = tuple(name for name in HYBRID_TYPES if name not in ("jamba", "mamba", "falcon_mamba"))


@dataclass(frozen=True)
class Case:
    """One sequence-parallel run: ``steps`` > 1 trains with SGD; ``labelled``: batches with labelled logits only;
    ``counted=False``: no ``num_items_in_batch`` (the forward counts its group's labels; the gradients are then
    averaged over the ranks, as DDP does); ``expect``: a refusal, the text its error must contain."""

    name: str
    model_type: str
    sp: int
    fault: str = ""
    steps: int = 1
    checkpointing: bool = False
    labelled: bool = False
    counted: bool = True
    expect: str = ""
    tile_tokens: int | None = None  # memory.tile_tokens: the MLP and the loss tiled (compared with untiled)
    attention: str = ""  # sequence_parallel.attention ("": the default, auto)
    lengths: str = ""  # the micro-steps' example lengths: a key of LENGTH_SETS
    mixers: str = "split"  # sequence_parallel.mixers
    compiled: bool = False  # the forward through torch.compile(model) (aot_eager: forward and backward traced)
    balance: str = ""  # sequence_parallel.balance ("": the default, auto)


LAUNCHES = {
    "sp2": [
        *(Case(model_type, model_type, 2) for model_type in MAIN_MODELS),
        Case("llama-checkpointing", "llama", 2, checkpointing=True),
        Case("qwen3_5_text-checkpointing", "qwen3_5_text", 2, checkpointing=True),
        Case("llama-train", "llama", 2, steps=3, labelled=True),
        Case("llama-tiled", "llama", 2, labelled=True, checkpointing=True, tile_tokens=8),
        Case("llama-uncounted", "llama", 2, counted=False),
        Case("llama-local-attention", "llama", 2, fault="local-attention"),
        Case("llama-labels-after-cut", "llama", 2, fault="labels-after-cut"),
        Case("qwen3_5_text-gather", "qwen3_5_text", 2, mixers="gather"),
        # compiled: one micro-step (its cut inside an example), the split gated delta rule outside the graph
        Case("qwen3_5_text-compiled", "qwen3_5_text", 2, compiled=True, lengths="first"),
        Case("qwen3_5_text-gather-local-mixer", "qwen3_5_text", 2, fault="local-mixer", mixers="gather"),
        *(Case(f"{model_type}-{fault}", model_type, 2, fault=fault) for model_type in ("qwen3_5_text", "nemotron_h",
                                                                                      "lfm2")
          for fault in ("slice-only", "wrong-rank")),
        Case("qwen3_moe-train", "qwen3_moe", 2, steps=3),
        Case("qwen3_moe-uncounted", "qwen3_moe", 2, counted=False),
        Case("qwen3_moe-slice-aux", "qwen3_moe", 2, fault="slice-aux"),
        Case("qwen3_moe-slice-statistics", "qwen3_moe", 2, fault="slice-statistics"),
        Case("llama-refused-world", "llama", 4, expect="does not divide the 2 processes"),
        Case("llama-refused-heads-and-world", "llama", 3, attention="ulysses",
             expect="cannot split (Ulysses gives each rank heads/size of them); and 3 does not divide the 2 processes; "
                    "use one of [2], or set sequence_parallel.attention: allgather"),
        Case("llama-refused-world-allgather", "llama", 3, expect="does not divide the 2 processes"),
        # all-gather context parallelism: forced where Ulysses runs too (both equal one process), with attention
        # sinks and sliding windows (gpt-oss), soft-capping (Gemma 2), and its deliberate faults
        Case("llama_kv2-allgather", "llama_kv2", 2, attention="allgather", lengths="spanning"),
        Case("llama_kv2-ulysses", "llama_kv2", 2, attention="ulysses", lengths="spanning"),
        Case("gpt_oss-allgather", "gpt_oss", 2, attention="allgather", lengths="spanning"),
        Case("gemma2-allgather", "gemma2", 2, attention="allgather", lengths="spanning"),
        *(Case(model_type, model_type, 2) for model_type in OTHER_HYBRIDS),
    ],
    "sp4": [
        Case("llama-sp2xdp2", "llama", 2),
        Case("llama-sp4", "llama", 4),
        Case("qwen3-sp4", "qwen3", 4),
        Case("qwen3_5_text-sp2xdp2", "qwen3_5_text", 2),
        Case("qwen3_5_text-sp4", "qwen3_5_text", 4),
        Case("qwen3_moe-sp2xdp2-train", "qwen3_moe", 2, steps=3),
        # 6 attention heads, 2 key / value heads: SP4 cannot split them; auto runs Ulysses within blocks of 2 ranks
        # and all-gather across the 2 blocks; allgather alone, forced
        Case("llama_kv2-sp4", "llama_kv2", 4, lengths="spanning"),
        Case("llama_kv2-sp4-allgather", "llama_kv2", 4, attention="allgather", lengths="spanning"),
        Case("llama_kv2-sp4-train", "llama_kv2", 4, steps=3, labelled=True, checkpointing=True),
        Case("llama_kv2-sp4-allgather-train", "llama_kv2", 4, attention="allgather", steps=3, labelled=True,
             checkpointing=True),
        Case("llama_kv2-sp2xdp2-allgather", "llama_kv2", 2, attention="allgather", balance="off"),  # contiguous
        # the causal work balanced (zigzag, as auto chooses above), its two deliberate faults
        Case("llama_kv2-sp4-zigzag-misaligned", "llama_kv2", 4, attention="allgather", balance="zigzag",
             fault="zigzag-misaligned", lengths="spanning"),
        Case("llama_kv2-sp4-zigzag-wrong-rank", "llama_kv2", 4, attention="allgather", balance="zigzag",
             fault="zigzag-wrong-rank", lengths="spanning"),
        Case("llama_kv2-sp4-own-slice-keys", "llama_kv2", 4, fault="own-slice-keys", lengths="spanning"),
        Case("llama_kv2-sp4-allgather-own-slice-keys", "llama_kv2", 4, attention="allgather",
             fault="own-slice-keys", lengths="spanning"),
        Case("llama_kv2-sp4-allgather-query-ahead", "llama_kv2", 4, attention="allgather", fault="query-ahead",
             lengths="spanning"),
        *(Case(f"{model_type}-sp4-spanning", model_type, 4, lengths="spanning-mixers")
          for model_type in ("qwen3_5_text", "nemotron_h", "lfm2")),
        Case("qwen3_5_text-sp4-spanning-wrong-rank", "qwen3_5_text", 4, fault="wrong-rank", lengths="spanning-mixers"),
    ],
}
WORLDS = {"sp2": 2, "sp4": 4}


def micro_batches(world: int, lengths: str = "") -> list[list[list[dict]]]:
    """The examples of every micro-step of a step, for each rank: ``[micro][rank]`` (the same on every rank; every
    step trains the same batches, so that a training run's loss falls); ``lengths``: a key of :data:`LENGTH_SETS`."""
    return [[random_examples(step[rank], VOCAB, seed=10 * micro + rank, low=3) for rank in range(world)]
            for micro, step in enumerate(LENGTH_SETS[lengths])]


def build(model_type: str, checkpointing: bool = False) -> torch.nn.Module:
    """The tiny model of ``model_type`` in train mode (same weights on every call). Attention sinks random, so that a
    rank using another rank's sinks would show; short convolutions' taps and input projection far larger than the
    initialiser's 0.02, so that a convolution cut at a slice's start shows (by ~0.2 in the gradients, not 1e-4).
    Routers whose load-balancing loss is trained: weights of ~0.3 (not 0.02), so that no token's top-k pick is near
    a tie (the loss counts picks; tests/test_sequence_parallel.py asserts the gaps)."""
    model = tiny_model(BASE_TYPES.get(model_type, model_type), "causal_lm", vocab_size=VOCAB, **MODELS[model_type])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".sinks"):
                parameter.normal_(0.0, 1.0, generator=generator)
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter") and model.config.output_router_logits:
                module.weight.normal_(0.0, 0.3, generator=generator)  # expert picks far from ties
            if type(module).__name__.endswith("ShortConv"):
                module.conv.weight.normal_(0.0, 1.0, generator=generator)
                module.in_proj.weight.normal_(0.0, 0.1, generator=generator)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def outputs_of(assembly, model, examples: list[dict], count: torch.Tensor | None, labelled: bool):
    batch = assembly.collator(examples)
    if labelled:
        keep_labelled_logits(batch)
    return assembly.forward(model, batch, num_items_in_batch=count)


def loss_of(assembly, model, examples: list[dict], count: torch.Tensor | None, labelled: bool) -> torch.Tensor:
    return outputs_of(assembly, model, examples, count, labelled).loss


def row_logits(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """The group's row of logits (SP = world): every rank's slice gathered, the padding segment cut off."""
    pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, logits.detach().contiguous())
    return torch.cat(pieces, dim=1)[:, :tokens]


def run_case(case: Case, rank: int, world: int) -> dict:
    model = build(case.model_type, case.checkpointing)
    before = model.config._attn_implementation
    with FAULTS.get(case.fault, contextlib.nullcontext)(rank % case.sp):
        try:
            memory = {} if case.tile_tokens is None else {"memory": {"tile_tokens": case.tile_tokens}}
            scheme = {"attention": case.attention} if case.attention else {}
            scheme.update({"balance": case.balance} if case.balance else {})
            assembly = assemble(model, {"attention": "exact", **memory,
                                        "sequence_parallel": {"size": case.sp, "mixers": case.mixers, **scheme}})
        except Exception as error:
            if not case.expect:
                raise
            untouched = model.config._attn_implementation == before and not any(
                "forward" in module.__dict__ for module in model.modules())
            return {"error": f"{type(error).__name__}: {error}", "untouched": untouched}
        evidence = {"implementation": model.config._attn_implementation,
                    "mixers": sum(type(module.__dict__.get("forward")).__name__ in ("WholeRowMixer", "SplitMixer")
                                  for module in model.modules()),
                    "split": sum(type(module.__dict__.get("forward")).__name__ == "SplitMixer"
                                 for module in model.modules()),
                    "tiled": sum(type(module.__dict__.get("forward")).__name__ == "_TiledForward"
                                 for module in model.modules())}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses, logits = [], []
        forward_model, compiling, counted = model, contextlib.ExitStack(), None
        if case.compiled:
            logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # its graph breaks are counted, not printed
            torch._dynamo.reset()
            counted = compiling.enter_context(compile_report())
            forward_model = torch.compile(model, backend=counting_backend(counted))
        for step in range(case.steps):
            total = torch.zeros(())
            for micro in micro_batches(world, case.lengths):
                count = None
                if case.counted:
                    count = num_label_tokens(assembly.collator(micro[rank])).clone()
                    dist.all_reduce(count)
                outputs = outputs_of(assembly, forward_model, micro[rank], count, case.labelled)
                loss = outputs.loss
                if case.sp == world and not case.labelled and step == 0:  # the row's logits, every micro-step
                    tokens = sum(len(example["input_ids"]) for examples in micro for example in examples)
                    logits.append(row_logits(outputs.logits, tokens))
                loss.backward()
                total += loss.detach()
            dist.all_reduce(total)
            mean = 1 if case.counted else world
            losses.append(total.item() / mean)
            grads = {}
            for name, parameter in model.named_parameters():
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad)
                parameter.grad /= mean
                grads[name] = parameter.grad.detach().clone()
            if case.steps > 1:
                optimizer.step()
            optimizer.zero_grad()
        compiling.close()
        if counted is not None:
            evidence["compiled"] = {"graphs": counted.graphs, "breaks": dict(counted.breaks)}
            torch._dynamo.reset()
    assembly.undo()
    state = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    return {"losses": losses, "grads": grads, "state": state, "world": world, "logits": logits, **evidence}


def main(launch: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("SP_TIMEOUT_S", 90))))
    rank, world = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("SP_CASES")  # a comma-separated subset of the launch's cases (for debugging)
    for case in LAUNCHES[launch]:
        if only and case.name not in only.split(","):
            continue
        started = time.monotonic()
        try:
            result = run_case(case, rank, world)
        except Exception:
            result = {"error": traceback.format_exc()}
            print(f"rank {rank}, {case.name}: {result['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            torch.save(result, Path(out) / f"{case.name}.pt")
            print(f"{case.name}: {time.monotonic() - started:.1f} s", flush=True)
        dist.barrier()
    dist.destroy_process_group()


# Deliberate faults, each a context manager taking the rank's place in its group; each must fail the comparison.


def cut_to_slice(cu: torch.Tensor, rank: int, local: int) -> torch.Tensor:
    """The global boundaries ``cu`` cut to rank ``rank``'s slice of ``local`` tokens (as if it were a row alone)."""
    cu, start = cu.long(), rank * local
    inside = cu[(cu > start) & (cu < start + local)] - start
    return torch.cat([cu.new_zeros(1), inside, cu.new_tensor([local])]).to(torch.int32)


@contextlib.contextmanager
def attend_locally(rank: int):
    """Each rank attends within its own slice only (the boundaries cut to it): no all-to-all."""
    from padfree_plugins.modeling.attention.ulysses import UlyssesAttention

    def local(self, module, query, key, value, attention_mask, **kwargs):
        length = query.shape[2]
        cu = cut_to_slice(kwargs["cu_seq_lens_q"], rank, length)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=length, max_length_k=length)
        return self.inner(module, query, key, value, attention_mask, **kwargs)

    with patched(UlyssesAttention, "__call__", local):
        yield


@contextlib.contextmanager
def labels_shifted_after_cut(rank: int):
    """Each rank shifts its own slice's labels: the label of a slice's last token (the next slice's first token)
    is lost."""
    from padfree_plugins.modeling.sequence_parallel import SequenceParallelForward

    right = SequenceParallelForward.slice

    def wrong(self, batch, *args, **kwargs):
        local = right(self, batch, *args, **kwargs)
        labels = local["labels"].clone()
        labels[:, -1] = -100
        local.update(labels=labels, shift_labels=labels)
        local.pop("logits_to_keep", None)
        return local

    with patched(SequenceParallelForward, "slice", wrong):
        yield


@contextlib.contextmanager
def scan_locally(rank: int):
    """Each sequence mixer runs on its rank's slice alone, the boundaries cut to the slice (so that the mixer's own
    check of the token count passes): every example crossing a cut restarts its state there."""
    from padfree_plugins.modeling.mixers import PACKED_ROW, PackedRow
    from padfree_plugins.modeling.sequence_parallel import WholeRowMixer

    def local(self, *args, **kwargs):
        row, cu = PACKED_ROW.get(), kwargs.get("cu_seq_lens_q")
        if cu is None and row is None:
            return self.forward(*args, **kwargs)
        hidden = args[0] if args else kwargs["hidden_states"]
        cut = cut_to_slice(cu if cu is not None else row.cu_seq_lens, rank, hidden.shape[1])
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if kwargs.get(key) is not None:
                kwargs[key] = cut
        token = PACKED_ROW.set(PackedRow(cut))
        try:
            return self.forward(*args, **kwargs)
        finally:
            PACKED_ROW.reset(token)

    with patched(WholeRowMixer, "__call__", local):
        yield


@contextlib.contextmanager
def aux_of_the_slice(rank: int):
    """Each rank keeps the model's own router aux loss: its slice's load-balancing loss, not the group row's."""
    from padfree_plugins.modeling.sequence_parallel import SequenceParallelForward

    with patched(SequenceParallelForward, "share_router_aux", lambda self, model, local, outputs: None):
        yield


@contextlib.contextmanager
def statistics_of_the_slice(rank: int):
    """Each rank's share is made from its slice's expert picks and token count, not reduced over the group."""
    from padfree_plugins.modeling import router_aux

    with patched(router_aux, "group_statistics", lambda counts, rows, group: (counts.detach(), rows.detach())):
        yield


@contextlib.contextmanager
def patched(owner, name: str, value):
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


FAULTS = {"local-attention": attend_locally, "labels-after-cut": labels_shifted_after_cut,
          "local-mixer": scan_locally, "slice-aux": aux_of_the_slice, "slice-statistics": statistics_of_the_slice,
          "own-slice-keys": lambda rank: faults.context_keys_from_own_slice_only(),
          "query-ahead": lambda rank: faults.context_queries_one_token_ahead(),
          "zigzag-misaligned": lambda rank: faults.zigzag_chunks_masked_as_one_run(),
          "zigzag-wrong-rank": lambda rank: faults.zigzag_outputs_to_wrong_rank(),
          "slice-only": lambda rank: faults.mixer_scans_only_its_slice(),
          "wrong-rank": lambda rank: faults.state_from_wrong_rank()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)
