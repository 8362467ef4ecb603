"""examples/ray_train.py: Ray Train's ``TorchTrainer`` with 2 CPU workers, HF datasets built inside ``train_func``,
equal to one process on the same global batches. ``make test`` installs ``ray[train]`` (the ``ray`` extra, in
``dev``); skipped where it is not installed (``pip install "padfree-plugins[ray]"``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_distributed import LOOP_ARGS, ROOT, reference_run

pytest.importorskip("ray.train", reason="ray[train] is not installed (pip install 'padfree-plugins[ray]')")


def test_ray_train_two_cpu_workers_equal_one_process(tmp_path):
    out = tmp_path / "ray.json"
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train.py"), "--workers", "2", *LOOP_ARGS,
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    run = json.loads(out.read_text())
    losses, _ = reference_run(ranks=2)
    assert run["processes"] == 2 and len(run["losses"]) == len(losses) >= 10
    difference = max(abs(a - b) for a, b in zip(run["losses"], losses))
    print(f"ray: max loss difference {difference:.2e}")
    assert difference < 1e-4
