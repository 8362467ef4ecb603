"""``padfree-plugins bench scale`` at the test suite's size (``--quick``, the Llama: one 2-process run, the row's
causal-LM step and the TRL DPO and GRPO steps): the output's structure, sane figures, SP=2 on less memory per rank
than SP=1 at the same loss (every step: a sequence-parallel run that computes another loss fails here, shown with a
fault); the communication volume from the config; the groups of the DPO / GRPO steps; the launcher's timeout and
errors. (Speed is measured by the benchmark itself, never asserted here.)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from padfree_plugins.benchmarks import scale
from padfree_plugins.benchmarks.scale import (
    VARIANTS,
    ScaleSettings,
    _halves,
    communication,
    model_config,
    row_lengths,
    run_scale_benchmark,
    variants,
)
from padfree_plugins.benchmarks.scale_rl import DPO_PAIRS, GRPO_GENERATIONS, dpo_pairs, grpo_group, grpo_inputs
from padfree_plugins.cli.app import app
from padfree_plugins.errors import PadfreeError


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-scale")
    result = CliRunner().invoke(app, ["bench", "scale", "--quick", "--models", "llama", "--steps", "sft,dpo,grpo",
                                      "--timeout", "300", "--out", str(out)])
    return result, json.loads((out / "bench_scale.json").read_text()) if result.exit_code == 0 else None


def test_quick_run_prints_the_table_and_writes_the_figures(quick_run):
    result, data = quick_run
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())  # the table's and the notes' lines wrap at the console's width
    for words in ("SP=2 communication, llama: 4 attention layer(s): 4 all-to-alls per layer", "torch.profiler",
                  "│ pass │", "no speed target", "a TRL DPO step on a group (8 pairs",
                  "a TRL GRPO step on a group (2 prompts x 8 completions"):
        assert words in printed
    steps = {(row["step"], row["variant"]): row for row in data["rows"]}
    assert list(steps) == ([("sft", v) for v in VARIANTS]
                           + [(step, v) for step in ("dpo", "grpo") for v in ("ddp", "sp2")])
    assert all(row["model"] == "llama" for row in data["rows"])
    assert data["memory_target"] == 0.55 and data["memory_target_met"] is True
    for row in data["rows"]:
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and row["saved_bytes"] > 0 and row["weight_bytes"] > 0
        assert len(row["peak_bytes_by_rank"]) == 2 and min(row["peak_bytes_by_rank"]) > 0
        assert row["loss_rel_diff"] < 1e-5  # the same examples and weights: the same loss, however trained
    for step in ("dpo", "grpo"):  # the group's tokens: on every rank (ddp), or split over the two
        ddp, sp = steps[step, "ddp"], steps[step, "sp2"]
        assert (ddp["tokens_per_step"], sp["tokens_per_step"]) == (2 * 1024, 1024)
        assert sp["peak_bytes"] < 0.75 * ddp["peak_bytes"] and sp["saved_bytes"] < 0.75 * ddp["saved_bytes"]
        assert abs(ddp["loss"]) > 1e-3
    rows = {variant: row for (step, variant), row in steps.items() if step == "sft"}
    assert rows["ddp"]["tokens_per_step"] == 2 * 1024 and rows["sp2"]["tokens_per_step"] == 1024
    assert rows["sp2"]["peak_bytes"] < rows["ddp"]["peak_bytes"]
    assert rows["sp2"]["saved_bytes"] < rows["ddp"]["saved_bytes"]
    assert rows["fsdp2"]["weight_bytes"] == rows["ddp"]["weight_bytes"] // 2  # sharded over the 2 ranks
    assert data["communication"]["llama"]["attention bytes per layer"] > 0


def test_communication_per_layer_follows_the_config():
    llama = communication(model_config("llama", 1024), 1024)  # 8 query / 2 kv heads of 32, SP=2
    assert llama["attention layers"] == 4 and llama["mixer layers"] == 0 and llama["kv repeat"] == 1
    assert llama["attention bytes per layer"] == 512 * (2 * 8 + 2 * 2) * 32 * 4
    replicated = communication(model_config("llama", 1024), 1024, size=4)  # 2 kv heads over 4 ranks: repeated
    assert replicated["kv repeat"] == 2
    assert replicated["attention bytes per layer"] == 256 * (2 * 8 + 2 * 2 * 2) * 32 * 4
    assert llama["allgather bytes per layer"] == 1024 * 2 * 2 * 32 * 4  # the row's k and v, 2 kv heads
    hybrid = communication(model_config("qwen3_5_text", 1024), 1024)
    assert (hybrid["attention layers"], hybrid["mixer layers"]) == (1, 3)
    assert hybrid["mixer bytes per layer"] == 1024 * 256 * 4  # gathered: the whole row's input
    # split: one state per cut, [4 value heads, 64, 64] and conv taps [2 x 2 x 64 + 4 x 64 channels, K=4]
    assert hybrid["mixer state elements (recurrent, conv)"] == [4 * 64 * 64, (2 * 2 * 64 + 4 * 64) * 4]
    mamba2 = communication(model_config("granite4h", 1024), 1024)  # [8 heads, 64, state 64]; conv 512 + 2 x 64
    assert (mamba2["attention layers"], mamba2["mixer layers"]) == (1, 5)
    assert mamba2["mixer state elements (recurrent, conv)"] == [8 * 64 * 64, (512 + 2 * 64) * 4]
    assert mamba2["mixer state bytes per cut"] == (8 * 64 * 64 + 640 * 4) * 4


def test_unknown_variants_are_refused():
    with pytest.raises(PadfreeError, match="--variants: sp3; choose from ddp, fsdp2, sp2, sp2-allgather, "
                                           "sp2-allgather-contiguous, sp2-gather"):
        run_scale_benchmark(ScaleSettings(tokens=1024, models=("llama",), chosen=("ddp", "sp3")))


def test_the_row_holds_exactly_its_tokens_and_splits_into_consecutive_halves():
    lengths = row_lengths(16384, seed=0)
    assert sum(lengths) == 16384 and min(lengths) > 0
    examples = [{"input_ids": [0] * n} for n in lengths]
    halves = _halves(examples, 2)
    assert halves[0] + halves[1] == examples and all(halves)


def test_a_run_past_its_timeout_is_killed_with_a_clear_error():
    with pytest.raises(PadfreeError, match="did not finish within 1 s"):
        run_scale_benchmark(ScaleSettings(tokens=1024, models=("llama",), timeout=1))


#: A launcher that starts a worker in a session of its own (as torch elastic does), prints its pid, and waits.
_LAUNCHER = ("import subprocess, sys, time; worker = subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(120)'], start_new_session=True); print('worker', worker.pid, flush=True); {then}; "
             "time.sleep(120)")


def _alive(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat")
    return state.exists() and state.read_text().split(") ", 1)[1][0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds a launch's workers through /proc")
def test_a_killed_launch_takes_its_workers_in_other_sessions_with_it():
    with pytest.raises(PadfreeError, match="did not finish within 3 s") as refused:
        scale._launch([sys.executable, "-c", _LAUNCHER.format(then="pass")], dict(os.environ), 3, lambda _: None)
    worker = int(str(refused.value).split("worker ", 1)[1].split()[0])
    assert not _alive(worker), "the launch's worker outlived it"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds a launch's workers through /proc")
def test_a_launch_lingering_after_its_result_is_killed_and_judged_on_it(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "TEARDOWN_GRACE_S", 1.0)
    result, said = tmp_path / "result.json", []
    then = f"open({str(result)!r}, 'w').write('{{}}')"
    scale._launch([sys.executable, "-c", _LAUNCHER.format(then=then)], dict(os.environ), 60, said.append,
                  result=result)
    assert result.exists() and any("the results stand" in line for line in said)


def test_variants_of_a_larger_world_and_all_gather():
    assert variants() == VARIANTS == ("ddp", "fsdp2", "sp2")
    assert variants(4, allgather=True) == ("ddp", "fsdp2", "sp4", "sp4-allgather", "sp4-allgather-contiguous")
    with pytest.raises(PadfreeError, match="multiple of the 4 processes"):
        run_scale_benchmark(ScaleSettings(tokens=1026, world=4))
    with pytest.raises(PadfreeError, match="at least 2 processes"):
        run_scale_benchmark(ScaleSettings(world=1))


def test_unknown_model_and_odd_row_are_refused():
    with pytest.raises(PadfreeError, match="unknown model.*mamba.*choose from llama, qwen3_5_text"):
        run_scale_benchmark(ScaleSettings(models=("mamba",)))
    with pytest.raises(PadfreeError, match="even number"):
        run_scale_benchmark(ScaleSettings(tokens=1001))


def test_the_rl_steps_catch_a_sequence_parallel_fault(monkeypatch):
    """With each rank reading only its own slice of the fused log-probabilities (no gather: tests/scale_fault), the
    GRPO step's SP=2 loss is far from ddp's: the quick run's loss check would fail."""
    fault = Path(__file__).parent / "scale_fault"
    monkeypatch.setenv("PYTHONPATH", f"{fault}:{Path(__file__).parent.parent}")
    result = run_scale_benchmark(ScaleSettings(tokens=256, models=("llama",), steps=("grpo",), rounds=1, warmup=0,
                                               chosen=("ddp", "sp2"), timeout=300))
    assert result.row("llama", "sp2", "grpo").loss_rel_diff > 1e-3


def test_the_dpo_and_grpo_groups_hold_their_tokens():
    pairs = dpo_pairs(4096, 4096, seed=0)
    assert len(pairs) == DPO_PAIRS
    assert sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs) == 4096
    assert all(p["chosen_ids"][-1] == p["rejected_ids"][-1] == 2 for p in pairs)  # answers end with EOS
    group = grpo_group(4096, 4096, seed=0)
    assert sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in group) == 4096
    first = group[:GRPO_GENERATIONS]
    assert all(r["prompt_ids"] == first[0]["prompt_ids"] for r in first)
    assert first[0]["prompt_ids"] != group[-1]["prompt_ids"]
    assert abs(sum(r["advantage"] for r in first)) < 1e-4  # normalised within the group
    inputs = grpo_inputs(group[:3], completion_tokens=100)
    width = max(len(r["completion_ids"]) for r in group[:3])
    assert inputs["completion_ids"].shape == inputs["old_per_token_logps"].shape == (3, width)
    assert inputs["prompt_mask"][:, -1].all() and inputs["completion_mask"][:, 0].all()  # left / right padded
    assert int(inputs["num_items_in_batch"]) == 100


def test_unknown_steps_and_uneven_groups_are_refused():
    with pytest.raises(PadfreeError, match="--steps: ppo; choose from sft, dpo, grpo"):
        run_scale_benchmark(ScaleSettings(tokens=1024, models=("llama",), steps=("ppo",)))
    with pytest.raises(PadfreeError, match="8 pairs must split evenly over --world 3"):
        run_scale_benchmark(ScaleSettings(tokens=1026, models=("llama",), steps=("dpo",), world=3))
