"""A model assembled under sequence parallelism, undone, and assembled again with its mixers run another way, on 2 CPU
processes (gloo): one torchrun launch of tests/sequence_parallel_undo_run.py.

On one tiny Qwen3.5 hybrid (gated delta rule layers around attention), in turn: ``sequence_parallel.mixers: split``,
``gather``, ``split`` again, each undone before the next. Every assembly's loss and gradients (summed over the group)
equal one process's on the group's row (1e-5 / 1e-4 of their scale), each ran the mixers it was configured with, and
after every undo each module's ``__dict__``, hooks, configs and the packed-call markers are as before the first
assembly and the model's own padded call gives the same logits bit for bit. The deliberate fault — undo taking the
pieces off in installation order, as before the fix — leaves the packed mixer forwards on the gated delta rule layers,
and the gathered assembly after it fails with the error users saw ("packed call without a [1, T, H] hidden_states").
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_common import launch_group
from tests.shared_launch import launch_once

LOSS = 1e-5
GRADS = 1e-4


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> list[dict]:
    """Every rank's results, from one launch (once per session: tests/shared_launch.py)."""

    def run(out, _):
        return launch_group("sequence_parallel_undo_run.py", str(out), out=out, processes=2, timeout=240)

    returncode, output, runs = launch_once(request, tmp_path_factory, "launched", [], run,
                                           lambda out: torch.load(out, weights_only=False))
    assert returncode == 0, output[-6000:]
    return runs


def test_split_then_gather_then_split_each_equal_one_process_and_undo_cleanly(launched):
    for rank, result in enumerate(launched):
        assert [run["mode"] for run in result["runs"]] == ["split", "gather", "split"]
        for run in result["runs"]:
            assert "error" not in run, f"rank {rank}, {run['mode']}: {run['error']}"
            print(f"rank {rank}, {run['mode']}: loss {run['loss']:.1e}, gradients {run['grads']:.1e} of their scale")
            assert run["loss"] <= LOSS and run["grads"] <= GRADS, run
            assert (run["split"], run["gathered"]) == ((2, 0) if run["mode"] == "split" else (0, 2)), run
            assert run["padded"] == 0.0, run
        assert result["reference_loss"] > 1.0  # a real loss: the comparison can fail


def test_undo_in_installation_order_leaves_the_mixers_patched_and_the_next_assembly_fails(launched):
    for result in launched:
        fault = result["fault"]
        assert fault["left"] == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"], fault
        assert "packed call without a [1, T, H] hidden_states" in fault.get("error", ""), fault
