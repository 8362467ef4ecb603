"""Shared by the torchrun worker scripts (tests/*_run.py) and the tests that launch them.

Worker side: :func:`gloo_group` joins the launch's process group, :func:`save_result` has rank 0 write the result
whole, :func:`finish` writes it and waits for every rank, :func:`leave` exits without the interpreter's teardown.
Test side: :func:`launch` runs a worker under torchrun with a timeout and returns what it wrote, and
:func:`run_differences` compares two training runs a worker recorded. :func:`chosen_runs` reads a worker's
``KIND-MODE`` run names.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def gloo_group() -> None:
    """Join the launch's gloo process group; a collective waits at most ``SP_TIMEOUT_S`` seconds (default 90)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("SP_TIMEOUT_S", 90))))


def save_result(result: Any, out: str | Path) -> None:
    """On rank 0, ``torch.save`` ``result`` to ``out``: written beside it, then renamed, so that the file appears
    whole (:func:`tests.test_distributed.run_group` watches for it)."""
    if dist.get_rank() == 0:
        partial = Path(f"{out}.partial")
        torch.save(result, partial)
        os.replace(partial, out)


def finish(result: Any, out: str | Path, destroy: bool = True) -> None:
    """:func:`save_result`, then wait for every rank (no rank leaves while another still talks to it) and, with
    ``destroy``, destroy the process group."""
    save_result(result, out)
    dist.barrier()
    if destroy:
        dist.destroy_process_group()


def chosen_runs(names: str, kinds, modes) -> list[str]:
    """The comma-separated ``KIND-MODE`` run names a worker was given, each kind among ``kinds`` and each mode among
    ``modes``; any other name ends the worker with the names it takes."""
    chosen = names.split(",")
    bad = [run for run in chosen if run.partition("-")[0] not in kinds or run.partition("-")[2] not in modes]
    if bad:
        sys.exit(f"runs are KIND-MODE, KIND among {', '.join(kinds)}, MODE among {', '.join(modes)}: not {bad}")
    return chosen


def run_differences(run: dict, want: dict, steps: int) -> tuple[float, float, float]:
    """Largest loss, gradient (any parameter, any step) and final-weight differences between two runs of ``steps``
    steps (each with ``losses``, ``grads`` a dict per step, and the final ``state``)."""
    assert len(run["losses"]) == len(want["losses"]) == steps
    assert len(run["grads"]) == len(want["grads"]) == steps
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    assert all(got.keys() == ref.keys() and ref for got, ref in zip(run["grads"], want["grads"]))
    grad = max((got[k] - ref[k]).abs().max().item() for got, ref in zip(run["grads"], want["grads"]) for k in ref)
    assert run["state"].keys() == want["state"].keys()
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    return loss, grad, weight


def leave() -> None:
    """Exit now, without the interpreter's teardown, where a thread of the gloo group can abort the process: call
    it once the results are on disk and every rank is past its last collective."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(script: str, *args: str, out: Path, processes: int = 2, timeout: float, env: dict | None = None) -> Any:
    """Run ``tests/<script> args`` under torchrun on ``processes`` CPU processes (one thread each, offline), never
    longer than ``timeout`` s; fail with the end of its output unless it exits 0; return what it wrote to ``out``.
    ``env``: more environment variables."""
    # imported here: the workers import this module, and need neither pytest nor the launch machinery
    from tests.test_distributed import ROOT, free_port, run_group

    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
               str(free_port()), str(ROOT / "tests" / script), *args]
    returncode, output = run_group(command, environment, timeout=timeout, results=[out])
    assert returncode == 0, output[-6000:]
    return torch.load(out, weights_only=False)
