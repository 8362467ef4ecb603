"""Sharded training of more than the plain causal LM equals one process (2 CPU processes, gloo; the worker is
tests/sharded_tasks_run.py, launched by torchrun with a timeout).

* The generative yes/no reranker under ZeRO-3 and under FSDP2 with the LM head a unit of its own: its scorer reads
  two rows of the LM head, whose weight is whole only inside the head's forward (a ZeRO-3 placeholder of shape
  ``[0]``, an FSDP2 shard outside it).
* LFM2 under ZeRO-3: its packed short convolution reads the ``conv`` submodule's weight.
* A peft LoRA model under FSDP2 (``fully_shard``, every parameter a ``DTensor``).

The ZeRO-3 launch turns DeepSpeed's automatic discovery of external parameters off
(:func:`tests.sharded_tasks_run.without_external_parameter_discovery`): with it, a read inside the engine's forward
is gathered behind the code's back, so a read of a placeholder would pass here and fail in a forward the engine does
not run. Losses and every trainable weight agree to 1e-5.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed_common import launch_group
from tests.shared_launch import launch_once, selected
from tests.test_distributed import ROOT, free_port, run_group

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
TOLERANCE = 1e-5
ZERO3_LOOPS = ("reranker-zero3", "lfm2-zero3")
FSDP2_LOOPS = ("reranker-fsdp2", "lora-fsdp2")


def launch(tmp_path, worker: str, *args: str, out_name: str, timeout: float = 300) -> dict:
    """``torchrun --nproc_per_node 2 tests/<worker> *args OUT``; what rank 0 wrote to ``OUT``."""
    out = tmp_path / out_name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / worker), *args, str(out)]
    returncode, output = run_group(command, env, timeout=timeout, results=[out])
    assert returncode == 0, output[-6000:]
    return torch.load(out, weights_only=True)


def loop_mode(item) -> str | None:
    return item.callspec.params["mode"] if item.originalname == "test_sharded_task_equals_single_process" else None


@pytest.fixture
def loop_runs(request, tmp_path_factory) -> dict:
    """Every plain-loop mode this session selected, in one launch (the start-up of a launch is most of its time),
    once per session even when the xdist workers share the tests (tests/shared_launch.py)."""
    modes = selected(request, loop_mode)

    def run(out, modes):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
               "DS_ACCELERATOR": "cpu"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(ROOT / "tests" / "sharded_tasks_run.py"), ",".join(modes), str(out)]
        return run_group(command, env, timeout=300, results=[out])

    returncode, output, runs = launch_once(request, tmp_path_factory, "loops", modes, run)
    assert returncode == 0 and runs is not None, output[-6000:]
    return runs


@functools.lru_cache(maxsize=None)
def reference(mode: str) -> dict:
    from tests.sharded_tasks_run import reference as run

    return run(mode)


def differences(run: dict, want: dict) -> tuple[float, float]:
    """Largest loss difference and largest weight difference between two runs."""
    assert len(run["losses"]) == len(want["losses"]) >= 3
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    assert run["state"].keys() == want["state"].keys()
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    return loss, weight


@pytest.mark.parametrize("mode", [*(pytest.param(m, marks=pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed: pip install -c constraints.txt -e '.[deepspeed]'"))
    for m in ZERO3_LOOPS), *FSDP2_LOOPS])
def test_sharded_task_equals_single_process(loop_runs, mode):
    run, want = loop_runs[mode], reference(mode)
    assert run["processes"] == 2 and run["mode"] == mode
    evidence = run["sharding"]
    assert evidence["local_numel"] < evidence["numel"]  # the worker refused to run unsharded; this re-checks it
    if mode.endswith("fsdp2"):
        assert evidence["dtensor_parameters"] >= len(run["state"])  # every parameter a DTensor (the worker checks)
    loss, weight = differences(run, want)
    print(f"{mode}: max loss difference {loss:.2e}, max weight difference {weight:.2e}")
    assert loss < TOLERANCE and weight < TOLERANCE
    moved = max((want["state"][k] - want["initial"][k]).abs().max().item() for k in want["state"])
    assert moved > 100 * TOLERANCE  # the weights moved far more than the tolerance: the comparison has teeth


#: The Trainer tests under ZeRO-3 and their run in the launch they share (``full``: the run the other resumes).
TRAINER_PARTS = {"test_dpo_with_reference_model_under_zero3_equals_single_process": "dpo",
                 "test_trainer_resumes_a_zero3_checkpoint_exactly": "full"}


def trainer_runs(request, tmp_path_factory, part: str) -> tuple[dict, Path]:
    """``part``'s run, from one launch of every Trainer run under ZeRO-3 this session selected, one after the other
    (once per session: tests/shared_launch.py); and the launch's folder (``model``: the tiny Llama it trained,
    ``run``: its checkpoints)."""
    parts = selected(request, lambda item: TRAINER_PARTS.get(item.originalname))
    assert part in parts

    def run(out: Path, parts: list[str]) -> tuple[int, str]:
        from tests.test_distributed import load_example

        model_dir, run_dir = out.parent / "model", out.parent / "run"
        load_example().tiny_llama().save_pretrained(model_dir)
        return launch_group("sharded_tasks_run.py", "trainers-zero3", ",".join(parts), str(model_dir), str(run_dir),
                            str(out), out=out, timeout=180 + 120 * len(parts), env={"DS_ACCELERATOR": "cpu"})

    def load(out: Path) -> tuple[dict, Path] | None:
        return (torch.load(out, weights_only=True), out.parent) if out.exists() else None

    returncode, output, loaded = launch_once(request, tmp_path_factory, "trainers", parts, run, load)
    assert returncode == 0 and loaded is not None, output[-6000:]
    runs, folder = loaded
    return runs[part] if len(parts) > 1 else runs, folder


needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed: "
                                     "pip install -c constraints.txt -e '.[deepspeed]' (part of .[dev])")


@needs_deepspeed
def test_dpo_with_reference_model_under_zero3_equals_single_process(request, tmp_path_factory, tmp_path):
    """TRL ``DPOTrainer`` (sigmoid loss, a separate reference model), padding-free through the ``trl_dpo`` plugin,
    under ``DPOConfig(deepspeed=ZeRO-3)`` on 2 processes of 2 pairs a step: the policy a ``DeepSpeedEngine``, the
    reference model partitioned by TRL's ``prepare_deepspeed``; its losses, reward margins and final weights equal
    one plain process of 4 pairs a step (accelerate's batch sharding hands rank ``r`` batch ``2s + r`` of the same
    shuffle; the DPO loss is a mean over pairs and DeepSpeed averages the ranks' gradients)."""
    import tempfile

    pytest.importorskip("trl")
    from tests.sharded_tasks_run import dpo_trainer, logged

    run, _ = trainer_runs(request, tmp_path_factory, "dpo")
    assert run["processes"] == 2 and run["sharding"]["local_numel"] < run["sharding"]["numel"]
    trainer = dpo_trainer(tempfile.mkdtemp(dir=tmp_path), deepspeed=None, batch_size=4)
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    want = {"losses": logged(trainer), "state": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}
    loss, weight = differences(run, want)
    margin = max(abs(a - b) for a, b in zip(run["margins"], logged(trainer, "rewards/margins")))
    print(f"dpo-zero3: max loss difference {loss:.2e}, margins {margin:.2e}, weights {weight:.2e}")
    assert loss < TOLERANCE and weight < TOLERANCE and margin < TOLERANCE
    assert max(map(abs, run["margins"])) > 1e-2  # the policy moved away from the reference
    assert max((want["state"][k] - initial[k]).abs().max().item() for k in initial) > 100 * TOLERANCE


@needs_deepspeed
def test_trainer_resumes_a_zero3_checkpoint_exactly(request, tmp_path_factory, tmp_path):
    """HF ``Trainer`` under ZeRO-3 (2 processes, token-budget batches through ``accelerate``, AdamW with linear decay)
    trains 4 steps saving a checkpoint at step 2 (in the launch that trains the DPO test's run too); a new launch
    ``train(resume_from_checkpoint=…/checkpoint-2)`` trains steps 3-4 only, and their losses and the final weights
    equal the uninterrupted run's: the DeepSpeed checkpoint restores the partitioned weights and optimizer state, the
    Trainer the scheduler and the data position (the token-budget plan resumes at its third micro-batch pair)."""
    from tests.sharded_tasks_run import RESUME_STEPS, SAVE_AT

    full, folder = trainer_runs(request, tmp_path_factory, "full")
    model_dir, run_dir = folder / "model", folder / "run"
    assert (run_dir / f"checkpoint-{SAVE_AT}").is_dir()
    resumed = launch(tmp_path, "sharded_tasks_run.py", "resume-zero3", "resume", str(model_dir), str(run_dir),
                     out_name="resumed.pt")
    assert full["steps_run"] == list(range(1, RESUME_STEPS + 1))
    assert resumed["steps_run"] == list(range(SAVE_AT + 1, RESUME_STEPS + 1))  # it resumed, not started over
    later = range(SAVE_AT + 1, RESUME_STEPS + 1)
    loss = max(abs(resumed["losses"][step] - full["losses"][step]) for step in later)
    assert full["state"].keys() == resumed["state"].keys()
    weight = max((resumed["state"][k] - full["state"][k]).abs().max().item() for k in full["state"])
    print(f"resume-zero3: max loss difference (steps 3-4) {loss:.2e}, max weight difference {weight:.2e}")
    assert loss < TOLERANCE and weight < TOLERANCE
    assert len({round(full["losses"][step], 6) for step in range(1, RESUME_STEPS + 1)}) == RESUME_STEPS
