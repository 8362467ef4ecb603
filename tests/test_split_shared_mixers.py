"""Rows with shared prefixes through hybrid sequence mixers split across the ranks of a sequence-parallel group
(``sequence_parallel.mixers: split``) equal one process's padded call.

One torchrun launch of tests/split_shared_run.py, 4 CPU processes (gloo): groups of 2 (two groups, each the same
row) and of 4. The row (:data:`~tests.split_shared_run.ROWS`) is a two-level prefix tree whose cuts fall where the
split mixers must hand a state on across ranks: under SP2 inside a prompt, right after the first token of a prefix
that continues its one-token parent (a one-token piece: it hands on its start state and its token), and with
completions on rank 1 whose parent ended on rank 0; under SP4 with completions two ranks after their parent (its
state relayed). Gated DeltaNet (Qwen3.5), Mamba2 (Bamba, Nemotron-H) and short convolutions (LFM2): log-probabilities
of every vocabulary entry within 1e-5 and gradients within 1e-4 of their scale, also under gradient checkpointing
(the recompute reuses the received states) and with ``mixers: gather``. The deliberate faults — a completion starting
from the last state its previous rank handed on instead of its parent's, a piece after a cut starting from zeros —
are far off. Per-rank activation memory, split against gathered, is measured on the same row.
"""

from __future__ import annotations

import pytest
import torch

from padfree_plugins.packing.sequence_parallel import padded_length
from tests import split_shared_run as worker
from tests.distributed_common import launch_group
from tests.shared_launch import launch_once

LOG_PROBS = 1e-5
GRADS = 1e-4


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """The worker's results, from one launch (once per session: tests/shared_launch.py)."""

    def run(out, _):
        return launch_group("split_shared_run.py", str(out), out=out, processes=4, timeout=300)

    returncode, output, runs = launch_once(request, tmp_path_factory, "launched", [], run,
                                           lambda out: torch.load(out, weights_only=False))
    assert returncode == 0, output[-6000:]
    return runs


def reach(cu: list[int], parents: tuple[int, ...], sp: int) -> dict:
    """Where the row's segments sit on the ranks of a group of ``sp``."""
    length = padded_length(cu[-1], sp) // sp
    first = [start // length for start in cu[:-1]]
    last = [(end - 1) // length for end in cu[1:]]
    prefixes = {parent for parent in parents if parent >= 0}
    return {"prompt cut": any(first[s] < last[s] for s in prefixes),
            "ranks after parent": max(first[s] - last[p] for s, p in enumerate(parents) if p >= 0),
            "one-token piece": any(p >= 0 and first[s] < last[s] and cu[s] % length == length - 1
                                   for s, p in enumerate(parents)),
            "depth": max(1 + (parents[p] >= 0) for p in parents if p >= 0)}


def test_the_row_puts_a_state_across_every_kind_of_cut(launched):
    sp2, sp4 = (reach(launched["row"], launched["parents"], sp) for sp in (2, 4))
    assert sp2 == {"prompt cut": True, "ranks after parent": 1, "one-token piece": True, "depth": 2}, sp2
    assert sp4["ranks after parent"] == 2, sp4


@pytest.mark.parametrize("name", [case.name for case in worker.CASES if not case.fault])
def test_split_mixers_on_a_shared_row_equal_the_padded_call(launched, name):
    run = launched[name]
    assert "error" not in run, run["error"]
    print(f"{name}: log-probs {run['log_probs']:.1e}, gradients {run['grads']:.1e} of their scale")
    assert run["log_probs"] <= LOG_PROBS and run["grads"] <= GRADS, run
    assert run["shared"] and run["largest_grad"] > 1.0
    assert (run["split"] > 0) == name.endswith(("-sp2", "-sp4", "-checkpointing"))
    assert run["checkpointing"] == name.endswith("-checkpointing")


@pytest.mark.parametrize("name", [case.name for case in worker.CASES if case.fault])
def test_a_wrong_state_across_ranks_fails_the_comparison(launched, name):
    run = launched[name]
    assert "error" not in run, run["error"]
    print(f"{name}: log-probs {run['log_probs']:.1e}, gradients {run['grads']:.1e}")
    assert run["split"] > 0 and run["log_probs"] > 100 * LOG_PROBS and run["grads"] > 100 * GRADS


def test_split_mixers_keep_fewer_activations_than_gathered_ones(launched):
    """Each rank of the SP2 group saves for backward its slice's mixer activations split, the whole row's gathered."""
    ranks = launched["memory"]
    for rank in ranks:
        print(f"saved activations: split {rank['split'] / 2**20:.2f} MiB, gathered {rank['gather'] / 2**20:.2f} MiB")
    assert all(rank["split"] < 0.8 * rank["gather"] for rank in ranks), ranks
