"""Sequence mixers scanned in tiles (``memory.tile_mixers``): the untiled loss and every gradient for gated-DeltaNet,
KDA and Mamba2 hybrids, with gradient checkpointing (each tile run twice: the layer's recompute takes the scan's
output; two rows of the same tiles in one graph each take their own, a recompute taking another's fails; reentrant
checkpointing recomputes), examples crossing the tile cuts; a row with shared prefixes
cut by tiles inside prompts, one-token branch points and completions equals its padded call; a tile that starts
from zeros (a deliberate fault) fails both; mixers that cannot continue a state stay whole and say so; ``check``
shows the choice; the peak of the tiled step is lower."""

from __future__ import annotations

import json
import warnings
from contextlib import nullcontext
from functools import cache
from unittest import mock

import pytest
import torch

from padfree_plugins import assemble
from padfree_plugins.modeling import tiled_mixers
from padfree_plugins.modeling.tiled_mixers import TiledMixer
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from padfree_plugins.testing import faults
from tests.conftest import make_examples
from tests.hybrids_common import LENGTHS, hybrid_model
from tests.test_hybrid_prefixes import assert_same as assert_same_as_padded, model_for, shared_and_padded
from tests.test_tiling import assert_same, loss_and_grads

#: Mixers only (the MLP and the loss untiled), tiles of 16 tokens: the hybrids' row of 350 tokens (examples of 1 to
#: 150 tokens) is cut inside examples, at their starts, and in their one- and two-token examples.
MIXERS_ONLY = {"tile_tokens": 16, "tile_mlp": False, "tile_loss": False}


def hybrid(model_type: str):
    model = hybrid_model(model_type).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def counting_tiles():
    """A patch that counts the tiles the mixers run (forward and recompute)."""
    counts = []
    original = tiled_mixers.run_one_tile

    def counted(*args, **kwargs):
        counts.append(1)
        return original(*args, **kwargs)

    return counts, mock.patch.object(tiled_mixers, "run_one_tile", counted)


@cache
def untiled(model_type: str):
    """The untiled loss and gradients of ``model_type``'s checkpointed step on the hybrids' row (computed once)."""
    return loss_and_grads(hybrid(model_type), lengths=LENGTHS)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "kimi_linear", "bamba"])
def test_tiled_mixers_give_the_untiled_loss_and_gradients(model_type):
    want = untiled(model_type)
    counts, counting = counting_tiles()
    with counting:
        got = loss_and_grads(hybrid(model_type), MIXERS_ONLY, lengths=LENGTHS)
    # 350 tokens: 22 tiles per mixer layer (2), each run in the forward and recomputed once in the backward: the
    # layer's checkpoint recompute takes the scan's output instead of scanning the row a third time
    assert len(counts) == 22 * 2 * 2
    assert_same(got, want)


def test_reentrant_checkpointing_recomputes_the_tiled_mixers_exactly():
    model = hybrid_model("qwen3_5_text").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert_same(loss_and_grads(model, MIXERS_ONLY, lengths=LENGTHS), untiled("qwen3_5_text"))


def two_rows_in_one_graph(memory, fault=None):
    """The loss and gradients of two rows of the same lengths (so the same tiles), other tokens, through one
    backward of the checkpointed qwen3_5 hybrid; and the scans' stashes still alive after it."""
    model = hybrid("qwen3_5_text")
    assembly = assemble(model, {"task": "causal_lm", "memory": memory})
    try:
        batches = [keep_labelled_logits(assembly.collator(make_examples(LENGTHS, seed=seed))) for seed in (3, 4)]
        with fault() if fault else nullcontext():
            loss = sum(assembly.forward(model, batch).loss for batch in batches)
            loss.backward()
        stashes = [m.forward.stashes for m in model.modules() if isinstance(vars(m).get("forward"), TiledMixer)]
        alive = [ref for s in stashes for ref in s.live if ref() is not None]
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return (loss.detach(), grads), alive
    finally:
        assembly.undo()


@pytest.mark.parametrize("fault", [None, faults.mixer_recompute_takes_any_stash])
def test_two_rows_of_the_same_tiles_in_one_graph_each_recompute_from_their_own_scan(fault):
    want, _ = two_rows_in_one_graph({**MIXERS_ONLY, "tile_mixers": False})
    counts, counting = counting_tiles()
    with counting:
        got, alive = two_rows_in_one_graph(MIXERS_ONLY, fault)
    assert not alive  # no stash outlives its backward
    if fault is None:
        assert len(counts) == 2 * 22 * 2 * 2  # each row's tiles twice: the forward, the tile's recompute
        assert_same(got, want)
    else:  # the second row's scan takes the first's output (their inputs not compared)
        with pytest.raises(AssertionError):
            assert_same(got, want)


def test_a_tile_starting_from_zeros_fails_the_comparison():
    want = untiled("qwen3_5_text")
    got = loss_and_grads(hybrid("qwen3_5_text"), MIXERS_ONLY, lengths=LENGTHS, fault=faults.mixer_tile_starts_from_zero)
    with pytest.raises(AssertionError):
        assert_same(got, want)


@pytest.mark.parametrize("fault", [None, faults.mixer_tile_starts_from_zero])
def test_a_shared_row_cut_into_tiles_equals_its_padded_call(fault):
    """Tiles of 8 tokens cut the shared row inside prompts, completions and one-token branch points: a completion's
    state is handed on from tile to tile until it runs, as on the ranks of a sequence-parallel group."""
    model = model_for("qwen3_5_text")
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off",
                                "memory": {"tile_tokens": 8, "tile_mlp": False, "tile_loss": False}})
    try:
        counts, counting = counting_tiles()
        with counting, (fault() if fault else nullcontext()):
            outputs = shared_and_padded(model)
        assert counts
        if fault is None:
            assert_same_as_padded(outputs)
        else:
            with pytest.raises(AssertionError):
                assert_same_as_padded(outputs)
    finally:
        assembly.undo()


def test_mixers_that_cannot_continue_a_state_stay_whole_and_say_why():
    model = hybrid_model("mamba")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assembly = assemble(model, {"task": "causal_lm", "memory": MIXERS_ONLY})
    try:
        assert not any(isinstance(vars(m).get("forward"), TiledMixer) for m in model.modules())
        assert any("MambaMixer runs untiled" in str(w.message) and "initial" in str(w.message) for w in caught)
    finally:
        assembly.undo()


def test_tile_mixers_false_and_undo_leave_the_mixers_whole():
    model = hybrid("qwen3_5_text")
    assembly = assemble(model, {"task": "causal_lm", "memory": {**MIXERS_ONLY, "tile_mixers": False}})
    assert not any(isinstance(vars(m).get("forward"), TiledMixer) for m in model.modules())
    assembly.undo()
    assembly = assemble(model, {"task": "causal_lm", "memory": MIXERS_ONLY})
    tiled = [m for m in model.modules() if isinstance(vars(m).get("forward"), TiledMixer)]
    assert len(tiled) == 2  # the two gated-DeltaNet layers
    assembly.undo()
    assert not any("forward" in vars(m) for m in tiled)


@pytest.mark.parametrize("tile_mixers", [True, False])
def test_check_shows_what_tiling_does_for_the_mixers(tmp_path, tile_mixers):
    from typer.testing import CliRunner

    from padfree_plugins.cli import app

    config = tmp_path / "padfree.yaml"
    config.write_text(f"memory:\n  tile_tokens: auto\n  tile_mixers: {str(tile_mixers).lower()}\n")
    result = CliRunner().invoke(app, ["check", str(config), "--model-type", "qwen3_5_text", "--device", "cpu",
                                      "--json"])
    assert result.exit_code == 0, result.output
    memory = json.loads(result.output)["memory"]
    if tile_mixers:
        assert "sequence mixers in tiles of 4096 tokens, each continuing the previous tile's state" in memory
        assert "refused under DeepSpeed ZeRO-3: set memory.tile_mixers: false there" in memory
    else:
        assert "sequence mixers untiled (memory.tile_mixers: false)" in memory


def peak_allocated(memory, trace) -> int:
    """The growth of the CPU allocator's total over one checkpointed step of a qwen3_5 hybrid on a row of 2,048
    tokens, at its peak (the profiler's memory events, written to ``trace``)."""
    model = hybrid_model("qwen3_5_text", linear_num_value_heads=8, linear_value_head_dim=32,
                         max_position_embeddings=4096).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assembly = assemble(model, {"task": "causal_lm", "memory": memory})
    try:
        generator = torch.Generator().manual_seed(0)
        examples = [{"input_ids": torch.randint(5, 128, (512,), generator=generator).tolist()} for _ in range(4)]
        batch = keep_labelled_logits(assembly.collator(examples))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            assembly.forward(model, batch).loss.backward()
        prof.export_chrome_trace(str(trace))
        events = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"),
                        key=lambda e: e["ts"])
        before = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
        return max(e["args"]["Total Allocated"] for e in events) - before
    finally:
        assembly.undo()


def test_tiled_mixers_lower_the_peak_of_a_checkpointed_step(tmp_path):
    untiled = peak_allocated({"tile_tokens": 256, "tile_mixers": False}, tmp_path / "untiled.json")
    tiled = peak_allocated({"tile_tokens": 256}, tmp_path / "tiled.json")
    assert untiled > 0 and tiled < 0.7 * untiled, (tiled, untiled)


def test_tile_mixers_under_zero3_are_refused_at_accelerate_and_change_nothing(tmp_path):
    """``memory.tile_mixers`` with DeepSpeed ZeRO-3 configured is refused at ``accelerate()`` (before any training
    step) with the reason and what to set; the trainer and the model are left as they were (every module's forward,
    the data collator, the trainer's methods); ``memory.tile_mixers: false`` is then accepted, the MLP still tiled.
    A model already partitioned (``zero.Init``: its parameters carry ``ds_id``) is refused by ``assemble`` without
    the config, and one partitioned after assembly at its first tiled call."""
    import datasets
    from transformers import Trainer, TrainingArguments
    from transformers.integrations import HfDeepSpeedConfig

    from padfree_plugins import ConfigError, accelerate, patch_of
    from padfree_plugins.errors import UnsupportedArchitectureError
    from tests.sequence_parallel_trainer_run import ZERO3, rows, tiny_hybrid

    model = tiny_hybrid()
    forwards = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
                      train_dataset=datasets.Dataset.from_list(rows(4, 0)))
    trainer_state = dict(vars(trainer))
    zero3 = HfDeepSpeedConfig({**ZERO3, "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1,
                               "gradient_accumulation_steps": 1, "gradient_clipping": 0.0})
    with pytest.raises(ConfigError, match=r"memory.tile_mixers under DeepSpeed ZeRO-3 \(Qwen3_5GatedDeltaNet\).*"
                                          r"differs between ranks.*Set memory.tile_mixers: false"):
        accelerate(trainer, {"task": "causal_lm", "memory": MIXERS_ONLY})
    assert patch_of(model) is None
    assert {name: module.__dict__.get("forward") for name, module in model.named_modules()} == forwards
    assert vars(trainer).keys() == trainer_state.keys()
    assert all(vars(trainer)[key] is value for key, value in trainer_state.items())
    acceleration = accelerate(trainer, {"task": "causal_lm", "memory": {"tile_tokens": 16, "tile_mixers": False}})
    assert not any(isinstance(vars(m).get("forward"), TiledMixer) for m in model.modules())
    assert any(type(vars(m).get("forward")).__name__ == "_TiledForward" for m in model.modules())  # the MLP tiles
    acceleration.undo()
    del zero3
    partitioned = tiny_hybrid()
    for number, parameter in enumerate(partitioned.parameters()):
        parameter.ds_id = number
    before = {name: module.__dict__.get("forward") for name, module in partitioned.named_modules()}
    with pytest.raises(ConfigError, match=r"memory.tile_mixers under DeepSpeed ZeRO-3"):
        assemble(partitioned, {"task": "causal_lm", "memory": MIXERS_ONLY})
    assert patch_of(partitioned) is None
    assert {name: module.__dict__.get("forward") for name, module in partitioned.named_modules()} == before
    # partitioned after assembly: the first tiled call refuses (every rank alike, before any gather)
    later = tiny_hybrid()
    assembly = assemble(later, {"task": "causal_lm", "memory": MIXERS_ONLY})
    module = next(m for m in later.modules() if isinstance(vars(m).get("forward"), TiledMixer))
    for number, parameter in enumerate(module.parameters()):
        parameter.ds_id = number
    hidden = torch.zeros(1, 40, later.config.hidden_size)
    with pytest.raises(UnsupportedArchitectureError, match=r"memory.tile_mixers under DeepSpeed ZeRO-3"):
        module(hidden_states=hidden, cu_seq_lens_q=torch.tensor([0, 40], dtype=torch.int32))
    assembly.undo()


def test_a_stash_whose_output_changed_in_place_is_not_taken():
    plans = [object()]
    hidden = torch.randn(8, 4)
    stashes = tiled_mixers.Stashes()
    output = torch.randn(8, 4)
    kept = stashes.add(tiled_mixers._Stash(plans, tiled_mixers.fingerprint(hidden), output.detach(), output._version,
                                           [], [], []))
    assert stashes.take(plans, hidden.clone() + 1) is None  # another input
    output.mul_(2)  # the scan's output changed after its forward
    assert stashes.take(plans, hidden.clone()) is None
    kept.version = output._version
    assert stashes.take(plans, hidden.clone()) is kept and stashes.take(plans, hidden.clone()) is None  # taken once
