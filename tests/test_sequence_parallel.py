"""Sequence parallelism (Ulysses) over packed rows equals one process on the same global batch.

Unit tests of the row arithmetic (join_rows / slice_row, kv_repeats, the slice guard) run without processes. The
distributed runs are two torchrun launches of tests/sequence_parallel_run.py on CPU (gloo): ``sp2`` (2 processes:
SP=2 for seven model types and every other hybrid family, gradient checkpointing, 3-step SGD runs, the deliberate
faults, a refusal) and ``sp4`` (4 processes: SP=2 x DP=2 and SP=4); each runs all its cases in one launch and writes
one result file per case.
The reference is computed here: one process, no sequence parallelism, every micro-step's examples of each group's
ranks packed into one row in rank order (the rows of the groups accumulated), the loss over ``num_items_in_batch``
= the micro-step's label count. A row is what a group trains: the MoE load-balancing loss (Qwen3-MoE with
``output_router_logits``) is the row's, not a sum over tokens.

One ``sp2`` case runs through ``torch.compile`` (a Qwen3.5-shaped hybrid, ``mixers: split``: the compiled graphs
around the split gated delta rule, which runs outside them) against the same eager one-process reference.

Tolerance: the summed loss, the row's logits and every gradient (and, for training, every weight) within 1e-5
**absolute**; the gradients compared are O(1e-2 .. 1), so this is far below their scale. Hybrid families run their
sequence mixers split (each rank its slice, the state passed across the cut: micro-step 0 cuts an example 8 + 3
tokens, the piece after the cut shorter than the conv kernel), Mamba1 families and one ``mixers: gather`` case on
the whole row. Each deliberate fault (a rank attending to its slice alone, labels shifted after the cut, a split
mixer's piece after the cut starting from zeros or from its own rank's state, a gathered mixer scanning its slice
alone, a router aux loss of the slice or of the slice's expert statistics) must differ by more than 1e-3 from the
same reference: the comparison has teeth.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import pytest
import torch

from padfree_plugins import assemble
from padfree_plugins.batching.distributed import num_label_tokens
from padfree_plugins.errors import BatchError, BoundaryError, ConfigError, PadfreeError
from padfree_plugins.modeling.attention.ulysses import SequenceGroup, kv_repeats
from padfree_plugins.modeling.patching import _check_packed_boundaries, _check_slice_boundaries
from padfree_plugins.modeling.router_aux import RouterAux, router_statistics, switch_loss
from padfree_plugins.packing.sequence_parallel import join_rows, padded_length, slice_row
from padfree_plugins.testing.models import random_examples, tiny_model
from tests import sequence_parallel_run as worker
from tests.hybrids_common import ATTENTION_FREE, HYBRIDS
from tests.shared_launch import launch_once
from tests.test_distributed import ROOT, free_port, run_group
from tests.ties import assert_clear

TOLERANCE = 1e-5
FAULT_GAP = 1e-3
LAUNCH_TIMEOUT_S = 300


# --- the row arithmetic, without processes ---------------------------------------------------------------------


@functools.cache
def collator():
    return assemble(tiny_model("llama", "causal_lm", vocab_size=worker.VOCAB), {"attention": "exact"}).collator


def collate(lengths, seed=0):
    return collator()(random_examples(lengths, worker.VOCAB, seed=seed, low=3))


def test_join_rows_is_the_row_of_all_examples():
    """Joined micro-batches are exactly the collator's row of all their examples: tokens, positions, example
    indices (offset, not restarted), labels, global boundaries, the longest example."""
    first, second = random_examples([3, 2], worker.VOCAB, seed=0, low=3), random_examples([1, 4], worker.VOCAB,
                                                                                             seed=1, low=3)
    joined, want = join_rows([collator()(first), collator()(second)]), collator()(first + second)
    assert list(joined) == list(want)
    for key, value in want.items():
        assert torch.equal(torch.as_tensor(joined[key]), torch.as_tensor(value)), key
    assert joined["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10] and joined["max_length_q"] == 4
    assert joined["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 3, 3, 3]]


def test_join_rows_concatenates_per_example_keys_and_refuses_differing_keys():
    rows = [collate([3, 2]), collate([4])]
    rows[0]["label"], rows[1]["label"] = torch.tensor([1, 0]), torch.tensor([1])
    assert join_rows(rows)["label"].tolist() == [1, 0, 1]
    del rows[1]["label"]
    with pytest.raises(BatchError, match="different batch keys.*same collator"):
        join_rows(rows)


def test_slice_row_shifts_labels_before_the_cut_and_keeps_boundaries_global():
    """A 7-token row (not a multiple of 2) of examples 3 + 4 in 2 slices: the cut at 4 falls inside the second
    example; the label of slice 0's last token is slice 1's first token; a 1-token padding segment of its own."""
    row = collate([3, 4])
    ids = row["input_ids"][0].tolist()
    slices = [slice_row(row, rank, 2, pad_token_id=1) for rank in (0, 1)]
    for local in slices:
        assert local["input_ids"].shape == (1, 4)
        assert local["cu_seq_lens_q"].tolist() == local["cu_seq_lens_k"].tolist() == [0, 3, 7, 8]  # global + padding
        assert local["max_length_q"] == local["max_length_k"] == 4
        assert local["shift_labels"] is local["labels"]
    assert slices[0]["labels"][0, -1].item() == slices[1]["input_ids"][0, 0].item() == ids[4]  # across the cut
    labels = torch.cat([s["labels"] for s in slices], dim=1)[0].tolist()
    # Shifted over the whole row: example ends and the example's own first label (masked) stay -100.
    assert labels == [ids[1], ids[2], -100, ids[4], ids[5], ids[6], -100, -100]
    assert torch.cat([s["position_ids"] for s in slices], dim=1)[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert slices[1]["input_ids"][0, -1].item() == 1  # the pad token
    assert slices[1]["seq_idx"][0].tolist() == [1, 1, 1, 2]  # the padding segment is an example of its own


def test_slice_row_one_token_example_at_the_cut_and_per_example_keys():
    """Examples 3, 1, 1, 3 in 2 slices of 4: two 1-token examples meet at the cut; per-example keys stay whole; a
    row that is a multiple of the size gets no padding segment."""
    row = collate([3, 1, 1, 3])
    row["label"] = torch.tensor([0, 1, 0, 1])
    slices = [slice_row(row, rank, 2) for rank in (0, 1)]
    assert [s["position_ids"][0].tolist() for s in slices] == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert slices[0]["labels"][0, -1].item() == -100  # a 1-token example has nothing to predict
    for local in slices:
        assert local["cu_seq_lens_q"].tolist() == [0, 3, 4, 5, 8]
        assert local["label"].tolist() == [0, 1, 0, 1]


def test_slice_row_drops_the_micro_batch_labelled_logits_and_refuses_multimodal_positions():
    row = collate([3, 4])
    row.update(logits_to_keep=torch.tensor([0, 1]), shift_labels=row["labels"][:, :2])
    local = slice_row(row, 0, 2)
    assert "logits_to_keep" not in local and local["shift_labels"] is local["labels"]
    row["position_ids"] = row["position_ids"].expand(4, 1, -1)
    with pytest.raises(BatchError, match=r"position_ids of shape \(4, 1, 7\).*multimodal"):
        slice_row(row, 0, 2)
    with pytest.raises(ValueError, match="rank 2 of a sequence-parallel group of 2"):
        slice_row(collate([3]), 2, 2)


def test_kv_repeats_keep_every_query_head_with_its_own_kv_head():
    """After ``repeat_interleave(kv_repeats)`` and the split over ``size`` ranks, each rank's query heads use the
    key/value heads they use without sequence parallelism; nothing is repeated when ``size`` divides the KV heads."""
    grid = [(heads, kv, size) for heads, kv in [(4, 4), (4, 2), (4, 1), (8, 2), (12, 4), (12, 3), (24, 8)]
            for size in (2, 3, 4, 8) if heads % size == 0]
    assert [kv_repeats(h, kv, n) for h, kv, n in [(4, 4, 2), (4, 2, 4), (4, 1, 4), (12, 4, 3)]] == [1, 2, 4, 3]
    for heads, kv_heads, size in grid:
        repeat = kv_repeats(heads, kv_heads, size)
        assert (repeat == 1) == (kv_heads % size == 0) and kv_heads * repeat % size == 0
        group, local_q, local_kv = heads // kv_heads, heads // size, kv_heads * repeat // size
        for rank in range(size):
            for i in range(local_q):
                repeated = rank * local_kv + i // (local_q // local_kv)
                assert repeated // repeat == (rank * local_q + i) // group, (heads, kv_heads, size)


def test_slice_guard_checks_the_restarts_inside_the_slice():
    """The ModelPatch guard under sequence parallelism: the global boundaries' restarts inside this rank's slice
    must be where its position ids restart."""
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)  # the slices above: [0 1 2 0 | 1 2 3 0]
    group0, group1 = SequenceGroup(None, 0, 2), SequenceGroup(None, 1, 2)
    _check_packed_boundaries(cu, cu, torch.tensor([[0, 1, 2, 0]]), group0)
    _check_packed_boundaries(cu, cu, torch.tensor([[1, 2, 3, 0]]), group1)
    with pytest.raises(BoundaryError, match="rank 1's slice.*start at \\[3\\].*restart at \\[2\\]"):
        _check_packed_boundaries(cu, cu, torch.tensor([[1, 2, 0, 1]]), group1)
    with pytest.raises(BoundaryError, match="rank 0's slice"):
        _check_slice_boundaries(cu, None, torch.tensor([1]), 4, group0)
    with pytest.raises(BoundaryError, match="3 tokens on each of 2 ranks.*describes a row of 8"):
        _check_packed_boundaries(cu, cu, torch.tensor([[0, 1, 2]]), group0)
    with pytest.raises(BoundaryError, match="does not match"):  # cu_seq_lens_k differing from cu_seq_lens_q
        _check_slice_boundaries(cu, torch.tensor([0, 4, 8]), torch.tensor([3]), 4, group0)


# --- refusals at assemble(), model untouched ---------------------------------------------------------------------


def test_router_statistics_give_transformers_load_balancing_loss():
    """The sums the group reduces (expert picks, router probabilities, rows) give transformers' own loss, also for
    the first rows of a slice only (the padding segment left out)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    generator = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(23, 6, generator=generator) for _ in range(3))
    want = load_balancing_loss_func(layers, 6, 2)
    torch.testing.assert_close(switch_loss(*router_statistics(layers, 2)), want, rtol=1e-6, atol=1e-7)
    first = load_balancing_loss_func(tuple(layer[:17] for layer in layers), 6, 2)
    torch.testing.assert_close(switch_loss(*router_statistics(layers, 2, rows=17)), first, rtol=1e-6, atol=1e-7)


def test_a_router_aux_loss_that_is_not_the_load_balancing_loss_is_refused():
    """A family whose ``aux_loss`` is another function of its router logits cannot be reduced from these sums."""
    generator = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(11, 4, generator=generator) for _ in range(2))
    aux = switch_loss(*router_statistics(layers, 2))
    router = RouterAux(top_k=2, coefficient=0.1)
    router.check({"router_logits": layers, "aux_loss": aux}, "Tiny")
    with pytest.raises(PadfreeError, match=r"Tiny's router aux loss .* is not the load-balancing loss.*Set "
                                           r"output_router_logits=False"):
        router.check({"router_logits": layers, "aux_loss": aux * 1.5}, "Tiny")
    with pytest.raises(PadfreeError, match=r"top-3"):  # another top-k counts other picks
        RouterAux(top_k=3, coefficient=0.1).check({"router_logits": layers, "aux_loss": aux}, "Tiny")


def untouched(model, implementation) -> bool:
    return model.config._attn_implementation == implementation and not any(
        "forward" in module.__dict__ for module in model.modules())


def refused(model, config) -> str:
    implementation = model.config._attn_implementation
    with pytest.raises(ConfigError) as error:
        assemble(model, {"attention": "exact", **config})
    assert untouched(model, implementation)
    return str(error.value)


def test_refuses_tasks_that_neither_model_language_nor_pool_examples():
    message = refused(tiny_model("llama"), {"task": "hidden_states", "sequence_parallel": {"size": 2}})
    assert "task 'hidden_states'" in message and "sequence_parallel.size: 1" in message


def test_refuses_encoders_but_for_the_tasks_that_pool_examples():
    message = refused(tiny_model("bert", "causal_lm"), {"sequence_parallel": {"size": 2}})
    assert "is an encoder" in message and "(seq_cls, embedding, reranker), not 'causal_lm'" in message


def test_refuses_image_blocks_under_allgather_attention():
    """Image-text rows with bidirectional image blocks (Gemma 3) split under Ulysses only; Qwen-VL's take all-gather
    too (tests/test_sequence_parallel_vision.py)."""
    from tests.vision_trl import model

    message = refused(model("gemma3"), {"sequence_parallel": {"size": 2, "attention": "allgather"}})
    assert "bidirectional image blocks" in message and "sequence_parallel.attention: ulysses" in message


def test_refuses_heads_ulysses_cannot_split():
    message = refused(tiny_model("llama", "causal_lm"), {"sequence_parallel": {"size": 3, "attention": "ulysses"}})
    assert "4 attention heads" in message and "use one of [2, 4]" in message
    assert "sequence_parallel.attention: allgather" in message


@pytest.mark.parametrize("world, size, fragments", [
    (2, 3, ["4 attention heads, which 3 ranks cannot split", "3 does not divide the 2 processes", "use one of [2]"]),
    (4, 3, ["4 attention heads, which 3 ranks cannot split", "3 does not divide the 4 processes",
            "use one of [2, 4]"]),
    (6, 3, ["4 attention heads, which 3 ranks cannot split", "use one of [2]"]),
    (3, 3, ["3 ranks cannot split", "no size above 1 divides both the 4 heads and the 3 processes",
            "sequence_parallel.size: 1"]),
])
def test_sizes_suggested_for_heads_the_group_cannot_split_suit_the_processes_too(monkeypatch, world, size, fragments):
    """Launched on ``world`` processes, the sizes suggested divide both the heads and the number of processes."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    message = refused(tiny_model("llama", "causal_lm"), {"sequence_parallel": {"size": size, "attention": "ulysses"}})
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert ("does not divide the" in message) == bool(world % size)


def test_refuses_unpad_always():
    message = refused(tiny_model("llama", "causal_lm"), {"unpad": "always", "sequence_parallel": {"size": 2}})
    assert "unpad: always" in message and "unpad: auto" in message


def test_refuses_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    message = refused(tiny_model("llama", "causal_lm"), {"sequence_parallel": {"size": 2}})
    assert "needs torch.distributed initialised" in message and "torchrun" in message


# --- the distributed runs -----------------------------------------------------------------------------------------


@pytest.fixture
def launches(request, tmp_path_factory):
    """``launches(name)``: the results of launch ``name`` of the worker, by case name (each launch runs once per
    session, also when the xdist workers share its tests: tests/shared_launch.py)."""

    def get(name: str) -> dict:
        return launch(request, tmp_path_factory, name)

    return get


def launch(request, tmp_path_factory, name: str) -> dict:
    cases = worker.LAUNCHES[name]

    def run(out, _):
        started = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(worker.WORLDS[name]),
                   "--master_port", str(free_port()), str(ROOT / "tests" / "sequence_parallel_run.py"), name,
                   str(out.parent)]
        result = run_group(command, env, timeout=LAUNCH_TIMEOUT_S, results=files(out))
        print(f"launch {name}: {len(cases)} cases, {time.monotonic() - started:.0f} s")
        return result

    def files(out) -> list:
        return [out.parent / f"{case.name}.pt" for case in cases]

    def load(out) -> dict | None:
        if not all(path.exists() for path in files(out)):
            return None
        return {case.name: torch.load(path, weights_only=True) for case, path in zip(cases, files(out))}

    returncode, output, results = launch_once(request, tmp_path_factory, name, [name], run, load)
    assert returncode == 0 and results is not None, output[-6000:]
    return results


@functools.cache
def reference(model_type: str, world: int, steps: int = 1, checkpointing: bool = False,
              labelled: bool = False, sp: int | None = None, lengths: str = "") -> dict:
    """One process on the same global batches: each micro-step's examples of every group of ``sp`` ranks (all
    ranks: ``None``) in one row, in rank order, the rows accumulated, the loss over the micro-step's label count."""
    model = worker.build(model_type, checkpointing)
    assembly = assemble(model, {"attention": "exact"})
    optimizer = torch.optim.SGD(model.parameters(), lr=worker.LR)
    sp = sp or world
    gaps: list = []
    hooks = [module.register_forward_hook(functools.partial(record_pick_gaps, gaps, model.config))
             for module in model.modules() if type(module).__name__.endswith("TopKRouter")]
    losses, logits = [], []
    for step in range(steps):
        total = 0.0
        for micro in worker.micro_batches(world, lengths):
            count = num_label_tokens(assembly.collator([example for rank in micro for example in rank]))
            for start in range(0, world, sp):
                examples = [example for rank in micro[start:start + sp] for example in rank]
                outputs = worker.outputs_of(assembly, model, examples, count, labelled)
                if sp == world and not labelled and step == 0:
                    logits.append(outputs.logits.detach())
                loss = outputs.loss
                loss.backward()
                total += loss.item()
        losses.append(total)
        grads = {name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for name, p in model.named_parameters()}
        if steps > 1:
            optimizer.step()
        optimizer.zero_grad()
    assembly.undo()
    for hook in hooks:
        hook.remove()
    return {"losses": losses, "grads": grads, "logits": logits, "pick_gaps": torch.cat(gaps) if gaps else None,
            "state": {name: p.detach().clone() for name, p in model.named_parameters()}}


def record_pick_gaps(gaps: list, config, module, args, output) -> None:
    """The gap between every token's k-th and (k+1)-th router logit: where an expert pick (which the load-balancing
    loss counts) could flip."""
    top = output[0].detach().double().topk(config.num_experts_per_tok + 1, dim=-1).values
    gaps.append(top[..., -2] - top[..., -1])


def result(launches, launch_name: str, case: worker.Case) -> dict:
    run = launches(launch_name)[case.name]
    assert "error" not in run, run["error"]
    return run


def differences(run: dict, want: dict) -> dict[str, float]:
    """Largest differences of the losses, the gradients and the weights."""
    assert run["grads"].keys() == want["grads"].keys()
    assert len(run["logits"]) == len(want["logits"])
    return {"loss": max(abs(a - b) for a, b in zip(run["losses"], want["losses"])),
            "grad": max((run["grads"][k] - want["grads"][k]).abs().max().item() for k in want["grads"]),
            "weight": max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"]),
            "logits": max([(a - b).abs().max().item() for a, b in zip(run["logits"], want["logits"])], default=0.0)}


def cases(launch_name: str, faulty: bool = False, refusals: bool = False) -> list:
    return [pytest.param(launch_name, case, id=case.name) for case in worker.LAUNCHES[launch_name]
            if bool(case.fault) == faulty and bool(case.expect) == refusals]


def group_rows(world: int, sp: int, steps=worker.LENGTHS) -> list[list[int]]:
    """The example lengths of every group's row, over the micro-steps ``steps``."""
    return [[n for rank in range(start, start + sp) for n in lengths[rank]]
            for lengths in steps for start in range(0, world, sp)]


def examples_and_cuts(lengths: list[int], sp: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The ``(start, end)`` of every example of a group's row, and the cuts between its ranks' slices."""
    local = padded_length(sum(lengths), sp) // sp
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return list(zip(starts[:-1], starts[1:])), [rank * local for rank in range(1, sp)]


def test_the_spanning_step_crosses_every_cut_and_spans_three_ranks():
    """The all-gather cases' extra micro-step: at SP4 every cut falls inside an example, one example spans three
    ranks' slices; at SP2 the long example crosses the cut."""
    examples, cuts = examples_and_cuts(group_rows(4, 4, [worker.SPANNING])[0], 4)
    assert all(any(begin < cut < end for begin, end in examples) for cut in cuts)
    assert any(begin < cuts[0] and end > cuts[1] for begin, end in examples)
    examples, cuts = examples_and_cuts(group_rows(2, 2, [worker.SPANNING])[0], 2)
    assert any(begin < cuts[0] < end for begin, end in examples)


def implementation_suffix(case: worker.Case) -> str:
    """The attention a case's group runs, as its implementation's name ends: Ulysses (``""``), all-gather where
    asked, or Ulysses within blocks and all-gather across them where auto finds the heads unsplittable."""
    heads = worker.build(case.model_type).config.num_attention_heads
    share = case.sp if case.attention == "ulysses" else 1 if case.attention == "allgather" else \
        max(n for n in range(1, case.sp + 1) if case.sp % n == 0 and heads % n == 0)
    balanced = "_zigzag" if case.balance != "off" else ""  # auto balances wherever all-gather runs
    return "" if share == case.sp else f"_allgather{balanced}" if share == 1 else \
        f"_ulysses{share}x{case.sp // share}{balanced}"


def test_the_kv2_cases_run_every_layout():
    suffixes = {implementation_suffix(case) for launch in worker.LAUNCHES.values() for case in launch
                if case.model_type == "llama_kv2"}
    assert suffixes == {"", "_allgather", "_allgather_zigzag", "_ulysses2x2_zigzag"}


@pytest.mark.parametrize("world, sp", [(2, 2), (4, 2), (4, 4)])
def test_the_data_cut_examples_and_one_token_examples(world, sp):
    """Every launch's rows hold what sequence parallelism gets wrong most easily: an example crossing a cut, a
    1-token example right at a cut, a row whose length is not a multiple of the group size."""
    crossing = one_token_at_cut = uneven = False
    for lengths in group_rows(world, sp):
        tokens = sum(lengths)
        local = padded_length(tokens, sp) // sp
        cuts = [rank * local for rank in range(1, sp)]
        starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
        examples = list(zip(starts[:-1], starts[1:]))
        crossing |= any(begin < cut < end for cut in cuts for begin, end in examples)
        one_token_at_cut |= any(end - begin == 1 and cut in (begin, end) for cut in cuts for begin, end in examples)
        uneven |= tokens % sp != 0
    assert crossing and one_token_at_cut and uneven


def test_the_tiny_models_have_what_the_cases_are_for():
    """gpt-oss: sliding layers whose window is shorter than examples that cross the cut, random attention sinks;
    qwen3 (and qwen3.5) at SP4: fewer key/value heads than ranks, replicated; the hybrids: their mixers, the Mamba2
    ones scanning rows of several chunks."""
    gpt_oss = worker.build("gpt_oss")
    assert "sliding_attention" in gpt_oss.config.layer_types and "full_attention" in gpt_oss.config.layer_types
    assert gpt_oss.config.sliding_window < max(max(lengths) for step in worker.LENGTHS for lengths in step)
    sinks = [p for name, p in gpt_oss.named_parameters() if name.endswith(".sinks")]
    assert len(sinks) == gpt_oss.config.num_hidden_layers and min(s.std().item() for s in sinks) > 0.1
    for model_type in ("qwen3", "qwen3_5_text"):
        config = worker.build(model_type).config
        assert config.num_key_value_heads < 4 and kv_repeats(config.num_attention_heads,
                                                             config.num_key_value_heads, 4) > 1
    assert "conv" in worker.build("lfm2").config.layer_types
    shortest = min(sum(step[0]) + sum(step[1]) for step in worker.LENGTHS)  # the SP2 rows
    for model_type in ("granitemoehybrid", "bamba", "falcon_h1"):  # their scans cross chunk boundaries
        assert worker.build(model_type).config.mamba_chunk_size < shortest


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("launch_name, case", cases("sp2") + cases("sp4"))
def test_sequence_parallel_equals_one_process(launches, launch_name, case):
    run = result(launches, launch_name, case)
    if case.model_type not in ATTENTION_FREE:
        assert run["implementation"] == f"padfree_exact_sp{case.sp}{implementation_suffix(case)}"
    assert (run["mixers"] > 0) == (case.model_type in worker.HYBRID_TYPES)
    # split: every mixer that can start from a state runs on the slice alone (Mamba1 families gather the row)
    assert (run["split"] > 0) == (case.model_type in worker.SPLIT_TYPES and case.mixers == "split")
    assert (run["tiled"] > 0) == (case.tile_tokens is not None)  # tiled against the untiled reference
    want = reference(case.model_type, run["world"], case.steps, case.checkpointing, case.labelled, case.sp,
                     case.lengths)
    diff = differences(run, want)
    scale = max(g.abs().max().item() for g in want["grads"].values())
    print(f"{case.name}: loss {diff['loss']:.1e}, grad {diff['grad']:.1e} (largest grad {scale:.2f}), "
          f"weight {diff['weight']:.1e}, logits {diff['logits']:.1e}")
    assert diff["loss"] < TOLERANCE and diff["grad"] < TOLERANCE and diff["weight"] < TOLERANCE, diff
    assert diff["logits"] < TOLERANCE and bool(run["logits"]) == (case.sp == run["world"] and not case.labelled)
    assert scale > 1e-2  # gradients far above the tolerance
    if worker.MODELS[case.model_type].get("output_router_logits"):  # the load-balancing loss counts expert picks
        assert_clear(want["pick_gaps"], "router top-k gaps")
    if case.steps > 1:
        initial = {name: p.detach() for name, p in worker.build(case.model_type).named_parameters()}
        moved = max((want["state"][k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 100 * TOLERANCE and want["losses"][-1] < want["losses"][0]  # it trains


def test_a_compiled_hybrid_runs_its_split_mixers_outside_the_graph(launches):
    """``qwen3_5_text-compiled``: ``torch.compile`` (aot_eager: forward and backward traced) of a Qwen3.5-shaped hybrid
    under SP2 with ``mixers: split``. Graphs were compiled, and each split gated-delta-rule call left the graph (its
    run reads the slice's segments on the host and exchanges states with the neighbouring rank); its loss, row
    logits and gradients equal one process (``test_sequence_parallel_equals_one_process``)."""
    run = result(launches, "sp2", next(case for case in worker.LAUNCHES["sp2"] if case.compiled))
    compiled = run["compiled"]
    assert compiled["graphs"] > 0 and run["split"] > 0, run
    assert any("_run_split_eagerly" in reason for reason in compiled["breaks"]), compiled["breaks"]


def test_every_hybrid_family_is_tested_under_sequence_parallelism():
    """Every hybrid family with a builtin plugin (tests/hybrids_common.py, and LFM2's short convolutions) has an
    equivalence case: a family whose mixers scanned only their slice would be silently wrong."""
    tested = {case.model_type for case in worker.LAUNCHES["sp2"] if not case.fault}
    assert {*HYBRIDS, "lfm2", "lfm2_moe"} <= tested


def test_allgather_equals_ulysses(launches):
    """The same model and rows through both schemes (SP2, where Ulysses splits the 6 heads): equal to each other,
    as each equals one process."""
    runs = launches("sp2")
    allgather, ulysses = runs["llama_kv2-allgather"], runs["llama_kv2-ulysses"]
    assert "_allgather" in allgather["implementation"] and "_allgather" not in ulysses["implementation"]
    diff = differences(allgather, ulysses)
    assert diff["loss"] < TOLERANCE and diff["grad"] < TOLERANCE, diff


@pytest.mark.parametrize("launch_name, case", cases("sp2", faulty=True) + cases("sp4", faulty=True))
def test_a_deliberate_fault_fails_the_comparison(launches, launch_name, case):
    run = result(launches, launch_name, case)
    diff = differences(run, reference(case.model_type, run["world"], sp=case.sp, lengths=case.lengths))
    print(f"{case.name}: loss {diff['loss']:.1e}, grad {diff['grad']:.1e}")
    assert diff["grad"] > FAULT_GAP, diff
    if case.fault in ("slice-only", "wrong-rank"):  # the split mixers' faults, on the split path
        assert run["split"] > 0


@pytest.mark.parametrize("launch_name, case", cases("sp2", refusals=True))
def test_a_world_the_size_does_not_divide_is_refused(launches, launch_name, case):
    run = launches(launch_name)[case.name]
    assert "error" in run and run["error"].startswith("ConfigError") and case.expect in run["error"], run
    assert run["untouched"]
