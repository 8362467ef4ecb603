"""Launchers: multi-node ``torchrun`` on this machine, and every shipped accelerate config launched on CPU processes.

Each run is ``examples/accelerate_loop.py`` (the tiny Llama, token-budget micro-batches, the loss over the global
token count) and is compared with one process training each step's global batch packed into one row
(``tests/test_distributed.py``'s reference). Every launch has a timeout and is killed, workers included, at its end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.test_distributed import LOOP_ARGS, ROOT, finish_launches, free_port, reference_run
TOLERANCE = 1e-4
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
       "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def run_nodes(commands: list[list[str]], timeout: float) -> list[str]:
    """Start one launcher per node, wait for all (``timeout`` s, so that a hang fails), kill what is left."""
    token = uuid.uuid4().hex
    logs = [tempfile.NamedTemporaryFile("w+", suffix=f".node{i}.log", delete=False) for i in range(len(commands))]
    processes = [subprocess.Popen(command, cwd=ROOT, env={**ENV, "PADFREE_TEST_LAUNCH": token}, stdout=log,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for command, log in zip(commands, logs)]
    try:
        return finish_launches(processes, logs, token, timeout)
    finally:
        for log in logs:
            os.unlink(log.name)


def torchrun_node(rank: int, nodes: int, per_node: int, port: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(rank),
            "--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(ROOT / "examples" / "accelerate_loop.py"), *args]


def assert_equals_one_process(run: dict, ranks: int) -> None:
    losses, tokens = reference_run(ranks=ranks)
    assert run["processes"] == ranks and len(run["losses"]) == len(losses) >= 3
    assert run["tokens"] == tokens  # rank r trained micro-batch s*N + r of the shared plan
    difference = max(abs(a - b) for a, b in zip(run["losses"], losses))
    print(f"{ranks} ranks: max loss difference {difference:.2e}")
    assert difference < TOLERANCE


def test_two_nodes_of_one_process_equal_one_process(tmp_path):
    """``torchrun --nnodes 2 --node_rank 0|1`` (one process each, rendezvous on 127.0.0.1): the loss curve of one
    process on the same global batches."""
    out, port = tmp_path / "nodes.json", free_port()
    run_nodes([torchrun_node(rank, 2, 1, port, [*LOOP_ARGS, "--out", str(out)]) for rank in (0, 1)], timeout=240)
    run = json.loads(out.read_text())
    assert run["distributed_type"] == "MULTI_CPU"
    assert [(rank["node"], rank["rows_with"]) for rank in run["sequence_groups"]] == [(0, [0]), (1, [1])]
    assert_equals_one_process(run, ranks=2)


def test_two_nodes_of_two_processes_with_sequence_parallel_groups_inside_a_node(tmp_path):
    """2 nodes x 2 processes, ``sequence_parallel.size: 2``: each node's two ranks (consecutive ranks, as torchrun
    numbers them node by node) share each packed row; the two groups are data-parallel across the nodes. Equal to
    one process on each step's 4 micro-batches."""
    config = tmp_path / "sp.yaml"
    config.write_text((ROOT / "configs" / "token_budget.yaml").read_text() + "\nsequence_parallel:\n  size: 2\n")
    out, port = tmp_path / "nodes.json", free_port()
    args = [*LOOP_ARGS, "--config", str(config), "--out", str(out)]
    run_nodes([torchrun_node(rank, 2, 2, port, args) for rank in (0, 1)], timeout=300)
    run = json.loads(out.read_text())
    assert run["sequence_groups"] == [{"rank": 0, "node": 0, "rows_with": [0, 1]},
                                      {"rank": 1, "node": 0, "rows_with": [0, 1]},
                                      {"rank": 2, "node": 1, "rows_with": [2, 3]},
                                      {"rank": 3, "node": 1, "rows_with": [2, 3]}]
    assert_equals_one_process(run, ranks=4)


#: What accelerate 1.15 runs each shipped config as on CPU processes (ACCELERATE_USE_CPU=true): FSDP and DeepSpeed
#: only start from a GPU-like device, so their CPU processes train DDP over gloo (docs/scaling.md says why; the
#: sharding engines themselves are tested through fully_shard / deepspeed.initialize in tests/test_sharded.py).
SHIPPED = {"ddp_cpu.yaml": "MULTI_CPU", "ddp.yaml": "MULTI_CPU", "fsdp.yaml": "MULTI_CPU",
           "deepspeed_zero2.yaml": "MULTI_CPU", "deepspeed_zero3.yaml": "MULTI_CPU", "ddp_2_machines.yaml": "MULTI_CPU"}


def test_every_shipped_accelerate_config_is_launched():
    assert sorted(SHIPPED) == sorted(path.name for path in (ROOT / "configs" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("name", [name for name in SHIPPED if name not in ("ddp_cpu.yaml", "ddp_2_machines.yaml")])
def test_shipped_accelerate_config_launches_on_cpu_processes(tmp_path, name):
    """``accelerate launch --config_file configs/accelerate/<name> --num_processes 2 --mixed_precision no`` on CPU
    processes: 2 processes, the distributed type accelerate picks on CPU, the loss curve of one process."""
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / name), "--num_processes", "2", "--mixed_precision", "no",
               "--main_process_port", str(free_port()), str(ROOT / "examples" / "accelerate_loop.py"), *LOOP_ARGS,
               "--out", str(out)]
    run_nodes([command], timeout=240)
    run = json.loads(out.read_text())
    assert run["distributed_type"] == SHIPPED[name]
    assert_equals_one_process(run, ranks=2)


def test_the_two_machine_config_launches_as_two_nodes_on_this_machine(tmp_path):
    """``configs/accelerate/ddp_2_machines.yaml``: two ``accelerate launch`` commands, ``--machine_rank 0`` and
    ``1``, rendezvous on 127.0.0.1 (one CPU process each): the loss curve of one process."""
    out, port = tmp_path / "run.json", free_port()
    commands = [[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                 str(ROOT / "configs" / "accelerate" / "ddp_2_machines.yaml"), "--machine_rank", str(rank),
                 "--num_processes", "2", "--mixed_precision", "no", "--main_process_ip", "127.0.0.1",
                 "--main_process_port", str(port), str(ROOT / "examples" / "accelerate_loop.py"), *LOOP_ARGS,
                 "--out", str(out)] for rank in (0, 1)]
    run_nodes(commands, timeout=240)
    run = json.loads(out.read_text())
    assert [rank["node"] for rank in run["sequence_groups"]] == [0, 1]
    assert_equals_one_process(run, ranks=2)
