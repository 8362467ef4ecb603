"""TRL ``DPOTrainer`` on image-text pairs under FSDP2 and ZeRO-3 (2 gloo CPU processes): a rank whose micro-batch has
no image still runs the vision towers, every step, so the sharded towers' all-gathers never wait on it.

The worker (tests/dpo_vision_sharded_run.py, one launch for both engines: tests/shared_launch.py) builds the DPO
trainer (tiny Qwen2.5-VL and its reference model) in each rank, makes it padding-free with ``accelerate(trainer)``,
shards both models and drives 3 steps itself: rank 0's pairs with images, rank 1's text only, through TRL's collator
and ``compute_loss`` (each fused log-probability call packed by ``pack_media_call``), plain SGD. Checked: the launch
finishes within its timeout; every fused call of both models on both ranks is packed; on rank 1 both towers run once
a step on the idle image (``modeling.vision.IdleTower``, reached through TRL's fused forward); the losses and every
final weight equal one process that trains the same global batches (each step the mean of the two micro-batches'
losses) within 1e-5. Without the idle tower the launch fails with a collective mismatch (or hangs, stopped by a short
timeout).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import pytest
import torch

from tests.dpo_vision_sharded_run import STEPS, reference
from tests.shared_launch import launch_once, selected
from tests.test_distributed import ROOT, free_port, run_group
from tests.test_sharded import needs_deepspeed

pytest.importorskip("PIL")
pytest.importorskip("trl")

TOLERANCE = 1e-5
ENGINES = ["fsdp2", pytest.param("zero3", marks=needs_deepspeed)]


@functools.lru_cache(maxsize=1)
def reference_run() -> dict:
    return reference()


def launch(tmp_path, engine: str, *flags: str, timeout: float) -> tuple[int, str, dict | None]:
    """``torchrun --nproc_per_node 2`` the worker; its exit status, output and results (``None`` if not written).
    A launch still running at ``timeout`` is killed and fails the test (``pytest.fail``)."""
    out = tmp_path / f"{engine}.pt"
    returncode, output = launch_to(out, engine, *flags, timeout=timeout)
    return returncode, output, torch.load(out, weights_only=True) if out.exists() else None


def launch_to(out, engine: str, *flags: str, timeout: float) -> tuple[int, str]:
    """Launch the worker writing to ``out``: its exit status and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / "dpo_vision_sharded_run.py"), engine, str(out), *flags]
    return run_group(command, env, timeout=timeout, results=[out])


def case_of(item) -> str | None:
    if item.originalname != "test_a_text_only_rank_runs_the_towers_every_step_and_trains_as_one_process":
        return None
    return item.callspec.params["engine"]


def launch_engines(request, tmp_path_factory, engine: str) -> dict:
    """``engine``'s run, from one launch training under every engine this session selected, one after the other
    (tests/shared_launch.py)."""
    engines = selected(request, case_of)
    assert engine in engines

    def run(out, engines):
        return launch_to(out, ",".join(engines), timeout=120 + 120 * len(engines))

    returncode, output, runs = launch_once(request, tmp_path_factory, "engines", engines, run)
    assert returncode == 0 and runs is not None, output[-6000:]
    return runs[engine] if len(engines) > 1 else runs


@pytest.mark.parametrize("engine", ENGINES)
def test_a_text_only_rank_runs_the_towers_every_step_and_trains_as_one_process(request, tmp_path_factory, engine):
    started = time.monotonic()
    run = launch_engines(request, tmp_path_factory, engine)
    assert run["media"] == [[True] * STEPS, [False] * STEPS]  # rank 0 images every step, rank 1 never
    assert run["sharding"]["local_numel"] < run["sharding"]["numel"] and all(run["ref_sharded"])
    assert run["packed"] == [[True] * 2 * STEPS] * 2  # each step the policy's and the reference's call, packed
    assert run["towers"] == [[2] * STEPS] * 2  # both models' towers, every step, on both ranks
    assert run["idle"] == [[0] * STEPS, [2] * STEPS]  # on rank 1 through the idle tower

    want = reference_run()
    losses = max(abs(a - b) / abs(b) for got, ref in zip(run["losses"], want["losses"]) for a, b in zip(got, ref))
    assert run["state"].keys() == want["state"].keys() and len(run["losses"]) == len(want["losses"]) == STEPS
    weights = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    print(f"{engine}: losses {losses:.1e} relative, weights {weights:.1e}, {time.monotonic() - started:.0f} s")
    assert losses < TOLERANCE and weights < TOLERANCE


def test_the_comparison_has_teeth():
    """The reference's weights move far beyond the tolerance, the vision tower's too (from rank 0's images)."""
    from tests.test_vision_trainers import model

    want, initial = reference_run(), dict(model().named_parameters())
    moved = {k: (want["state"][k] - initial[k]).abs().max().item() for k in want["state"]}
    assert max(moved.values()) > 100 * TOLERANCE
    assert max(value for name, value in moved.items() if ".visual." in name) > 100 * TOLERANCE


@pytest.mark.parametrize("engine", ENGINES)
def test_without_the_idle_tower_the_text_only_rank_fails_or_hangs(tmp_path, engine):
    """Rank 1's fused calls skip both towers, whose sharded blocks rank 0 all-gathers: a collective mismatch (or a
    hang, stopped by the timeout)."""
    try:
        returncode, output, run = launch(tmp_path, engine, "--no-idle-tower", timeout=60)
    except pytest.fail.Exception:
        return  # hung: killed at the timeout
    assert returncode != 0 and run is None, "the launch without the idle tower finished: the test shows nothing"
    assert "collective mismatch" in output, output[-6000:]
