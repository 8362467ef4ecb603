"""Shared by the torchrun worker scripts (tests/*_run.py) and the tests that launch them.

Worker side: :func:`gloo_group` joins the launch's process group, :func:`save_result` has rank 0 write the result
whole, :func:`finish` writes it and waits for every rank, :func:`leave` exits without the interpreter's teardown.
Test side: :func:`launch` runs a worker under torchrun with a timeout and returns what it wrote (:func:`launch_shared`
once per test session, :func:`engine_runs` once for every engine a module's tests selected), and
:func:`run_differences` compares two training runs a worker recorded. :func:`chosen_runs` reads a worker's
``KIND-MODE`` run names. Evaluations: :func:`evaluated` records ``evaluate`` / ``predict`` with the
``compute_metrics`` of TRL's trainers (:func:`token_metrics`, :func:`score_metrics`), :func:`evaluation_differences`
compares two. Deliberate divergence (ranks that run different modules): a worker's :func:`modules_run` and the
test's :func:`launch_diverging`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def token_metrics(prediction) -> dict:
    """``compute_metrics`` of the TRL evaluations whose predictions are per-token logits (DPO, KTO: ``[rows, width,
    vocab]``, ``label_ids`` the rows' ``input_ids``; -100 where the evaluation loop padded one batch to another's
    width): the mean negative log-likelihood of each row's next tokens, and the rows counted (continuous or exact:
    no argmax)."""
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    logits, labels = logits[:, :-1].double(), labels[:, 1:]
    counted = labels != -100
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"nll": -(picked * counted).sum().item() / counted.sum().item(), "rows": int(labels.shape[0])}


def score_metrics(prediction) -> dict:
    """``compute_metrics`` of a RewardTrainer's evaluation (predictions: every text's score): their mean and mean
    square, and the texts counted."""
    scores = torch.as_tensor(prediction.predictions).double()
    return {"mean_score": scores.mean().item(), "square_score": scores.square().mean().item(),
            "texts": int(scores.shape[0])}


def evaluated(trainer, fault: Any = None) -> dict:
    """What an evaluation test compares: ``trainer.evaluate()``'s metrics (with what it logged: TRL's own metrics),
    ``trainer.predict()``'s predictions, label ids and metrics (on the trainer's evaluation set); then, when ``fault``
    is a context manager, ``predict`` once more inside it (``faulty``)."""
    output = trainer.predict(trainer.eval_dataset)
    metrics = trainer.evaluate()  # TRL's trainers log their own metrics beside it
    result = {"evaluate": {**trainer.state.log_history[-1], **metrics},
              "predictions": torch.as_tensor(output.predictions), "label_ids": torch.as_tensor(output.label_ids),
              "metrics": output.metrics}
    if fault is not None:
        with fault:
            output = trainer.predict(trainer.eval_dataset)
        result["faulty"] = {"predictions": torch.as_tensor(output.predictions), "metrics": output.metrics}
    return result


def evaluation_differences(run: dict, want: dict, keys: tuple[str, ...],
                           evaluate_keys: tuple[str, ...] = ()) -> tuple[float, float]:
    """Largest difference of the metrics ``keys`` (without their ``eval_`` / ``test_`` prefix) of ``evaluate`` and of
    ``predict`` (and ``evaluate_keys`` of ``evaluate`` alone: TRL's own metrics), relative to the value where it
    exceeds 1 (a sum of log-probabilities), and of the predictions (equal shapes, label ids equal), between two
    :func:`evaluated` records."""
    assert run["predictions"].shape == want["predictions"].shape and torch.equal(run["label_ids"], want["label_ids"])
    predictions = (run["predictions"] - want["predictions"]).abs().max().item()
    metrics = 0.0
    for source, prefix, names in (("evaluate", "eval_", keys + evaluate_keys), ("metrics", "test_", keys)):
        for key in names:
            got, expected = run[source].get(prefix + key), want[source].get(prefix + key)
            assert got is not None and expected is not None, (prefix + key, run[source], want[source])
            metrics = max(metrics, abs(got - expected) / max(1.0, abs(expected)))
    return metrics, predictions


def leave() -> None:
    """Exit now, without the interpreter's teardown, where a thread of the gloo group can abort the process: call
    it once the results are on disk and every rank is past its last collective."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_group(script: str, *args: str, out: Path, processes: int = 2, timeout: float,
                 env: dict | None = None) -> tuple[int, str]:
    """Run ``tests/<script> args`` under torchrun on ``processes`` CPU processes (one thread each, offline), never
    longer than ``timeout`` s; return its exit status and output. ``env``: more environment variables."""
    # imported here: the workers import this module, and need neither pytest nor the launch machinery
    from tests.test_distributed import ROOT, free_port, run_group

    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
               str(free_port()), str(ROOT / "tests" / script), *args]
    return run_group(command, environment, timeout=timeout, results=[out])


def launch(script: str, *args: str, out: Path, processes: int = 2, timeout: float, env: dict | None = None) -> Any:
    """:func:`launch_group`, failing with the end of its output unless it exits 0; return what it wrote to ``out``."""
    returncode, output = launch_group(script, *args, out=out, processes=processes, timeout=timeout, env=env)
    assert returncode == 0, output[-6000:]
    return torch.load(out, weights_only=False)


#: In the arguments of :func:`launch_shared`: the results file.
OUT = "{out}"


def launch_shared(request, tmp_path_factory, script: str, *args: str, processes: int = 2, timeout: float,
                  env: dict | None = None) -> Any:
    """:func:`launch` once per test session for the requesting module, also where the pytest-xdist workers share its
    tests (tests/shared_launch.py: without it, each worker that runs some of them launches the worker again). ``OUT``
    among ``args`` stands for the results file."""
    from tests.shared_launch import launch_once

    def run(out: Path, _) -> tuple[int, str]:
        arguments = [str(out) if arg == OUT else arg for arg in args]
        return launch_group(script, *arguments, out=out, processes=processes, timeout=timeout, env=env)

    def load(out: Path) -> Any:
        return torch.load(out, weights_only=False) if out.exists() else None

    returncode, output, results = launch_once(request, tmp_path_factory, "launched", [], run, load)
    assert returncode == 0 and results is not None, output[-6000:]
    return results


def engine_runs(request, tmp_path_factory, script: str, *args: str) -> Any:
    """The requesting test's engine's result (its ``engine`` parameter) from one launch of ``tests/<script>
    ENGINE[,ENGINE] OUT args`` (2 processes, DeepSpeed on the CPU) training under every engine of that test that the
    session selected, one after the other, once per session (tests/shared_launch.py)."""
    from tests.shared_launch import launch_once, selected

    name = request.node.originalname

    def case_of(item) -> str | None:
        return item.callspec.params["engine"] if item.originalname == name else None

    engine, engines = request.node.callspec.params["engine"], selected(request, case_of)
    assert engine in engines

    def run(out: Path, engines: list[str]) -> tuple[int, str]:
        return launch_engines(script, out, ",".join(engines), *args, timeout=120 + 120 * len(engines))

    returncode, output, runs = launch_once(request, tmp_path_factory, "engines", engines, run)
    assert returncode == 0 and runs is not None, output[-6000:]
    return runs[engine] if len(engines) > 1 else runs


def launch_engines(script: str, out: Path, engines: str, *args: str, timeout: float) -> tuple[int, str]:
    """``tests/<script> ENGINES OUT args`` on 2 processes (DeepSpeed on the CPU): its exit status and output."""
    return launch_group(script, engines, str(out), *args, out=out, timeout=timeout, env={"DS_ACCELERATOR": "cpu"})


# -- deliberate divergence: ranks that run different modules --------------------------------------------------------

#: A diverging launch's environment: every collective first compares its fingerprint (operation, shapes) across the
#: ranks and raises :data:`MISMATCH` naming both when they differ, instead of waiting on a peer that never comes.
DIVERGING_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "SP_TIMEOUT_S": "30"}
MISMATCH = "Detected mismatch between collectives on ranks"
#: The environment variable naming the folder where :func:`modules_run` writes each rank's record
#: (``rank<R>.json``): a file per rank, as the ranks' printed lines can interleave on the launch's one stdout.
MODULES_RUN_DIR = "PADFREE_TEST_MODULES_RUN_DIR"


@contextmanager
def modules_run(**models: Any) -> Iterator[None]:
    """Within the block, record every module of ``models`` (``prefix=model``) whose forward starts on this rank; if the
    block raises, first write their names (a JSON list of ``prefix.name``) to ``rank<R>.json`` in the folder
    :data:`MODULES_RUN_DIR` names (read by :func:`launch_diverging`), and print them."""
    names = {id(module): f"{prefix}.{name}".rstrip(".") for prefix, model in models.items()
             for name, module in model.named_modules()}
    ran: set[str] = set()

    def record(module: Any, args: tuple) -> None:
        if id(module) in names:
            ran.add(names[id(module)])

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield
    except BaseException:
        record_dir = os.environ.get(MODULES_RUN_DIR)
        if record_dir:
            Path(record_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(sorted(ran)))
        print(f"modules run on rank {dist.get_rank()}: {json.dumps(sorted(ran))}", flush=True)
        raise
    finally:
        handle.remove()


def launch_diverging(script: str, out: Path, engine: str, *args: str, timeout: float) -> dict[int, set[str]]:
    """:func:`launch_engines` of a deliberate fault whose ranks run different modules (``DIVERGING_ENV``: the worker
    joins with :func:`gloo_group` and runs under :func:`modules_run`); assert that it fails fast with
    :data:`MISMATCH` and wrote no result, and return the modules each rank had run. A launch that finishes, hangs
    until ``timeout`` (kept as a safety net) or fails otherwise fails the test: the fault was not caught."""
    import pytest  # the workers import this module, and need no pytest

    records = out.parent / f"{out.stem}-modules-run"
    records.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        returncode, output = launch_group(script, engine, str(out), *args, out=out, timeout=timeout,
                                          env={"DS_ACCELERATOR": "cpu", **DIVERGING_ENV,
                                               MODULES_RUN_DIR: str(records)})
    except pytest.fail.Exception as hung:  # run_group's timeout
        pytest.fail(f"the fault launch hung for {timeout} s instead of failing with a collective mismatch:\n"
                    f"{str(hung)[-6000:]}")
    elapsed = time.monotonic() - started
    print(f"{script} {engine} {' '.join(args)}: ended after {elapsed:.1f} s (safety net {timeout} s)")
    assert returncode != 0 and not out.exists(), (f"the fault launch finished (exit status {returncode}, results "
                                                  f"written: {out.exists()}): the check shows nothing\n"
                                                  f"{output[-6000:]}")
    assert MISMATCH in output, f"the fault launch failed, but not with a collective mismatch:\n{output[-6000:]}"
    ran = {int(record.stem.removeprefix("rank")): set(json.loads(record.read_text()))
           for record in records.glob("rank*.json")}
    assert sorted(ran) == [0, 1], f"no record of the modules each rank ran:\n{output[-6000:]}"
    return ran
