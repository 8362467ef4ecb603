"""One multi-process launch for several tests: the launch's start-up (a ``torchrun`` of 2 processes importing torch,
transformers, DeepSpeed) costs more than a tiny case it runs, so a module's cases run in one launch and each test
asserts its own case.

The launch runs once per test session, shared by the pytest-xdist workers (a file lock in the session's temporary
folder, as tests/test_packaging.py builds once), and only for the cases this session selected (``-k zero3`` launches
the ZeRO-3 case alone).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock  # a dependency of transformers (huggingface_hub)


def selected(request, case_of: Callable[[pytest.Item], str | None]) -> list[str]:
    """The cases ``case_of`` names for this module's tests that this session runs (``None``: a test that launches
    nothing), in the order of the tests."""
    cases = []
    for item in request.session.items:
        case = case_of(item) if item.module is request.module and not skipped(item) else None
        if case is not None and case not in cases:
            cases.append(case)
    return cases


def skipped(item) -> bool:
    """Whether a ``skip`` mark or a ``skipif`` mark with a true condition skips ``item`` (its case is not launched:
    a skipped DeepSpeed case must not fail the launch of the others)."""
    if any(True for _ in item.iter_markers("skip")):
        return True
    return any(mark.args and all(isinstance(c, bool) and c for c in mark.args) or mark.kwargs.get("condition") is True
               for mark in item.iter_markers("skipif"))


def launch_once(request, tmp_path_factory, name: str, cases: list[str],
                launch: Callable[[Path, list[str]], tuple[int, str]],
                load: Callable[[Path], dict | None] | None = None) -> tuple[int, str, dict | None]:
    """``launch(out, cases)`` (which runs the launch writing its results to ``out``: exit status, output) once per
    session for ``name`` and ``cases``; every caller gets ``(exit status, output, results or None)``, the results
    ``load(out)`` (by default ``out`` loaded, ``None`` if it was not written)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, shared by the workers
    key = f"{request.module.__name__}-{name}-{'-'.join(cases)}"
    folder, out = root / "shared-launch" / key, root / "shared-launch" / key / "results.pt"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / "lock")):
        if not (folder / "done.json").exists():
            try:
                returncode, output = launch(out, cases)
            except pytest.fail.Exception as failed:  # a hang, killed at the timeout: every caller fails with it
                returncode, output = None, str(failed)
            (folder / "done.json").write_text(json.dumps({"returncode": returncode, "output": output}))
    done = json.loads((folder / "done.json").read_text())
    if done["returncode"] is None:
        pytest.fail(done["output"])
    if load is None:
        return done["returncode"], done["output"], torch.load(out, weights_only=True) if out.exists() else None
    return done["returncode"], done["output"], load(out)
