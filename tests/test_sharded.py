"""Sharded training equals one process: FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 on 2 CPU processes (gloo).

The plain loop (tests/sharded_run.py, launched by torchrun) trains the tiny Llama of examples/accelerate_loop.py on
the token-budget plan of ``reference_run`` in tests/test_distributed.py, with the model sharded; the reference is
computed here: one process, each step's global batch (both ranks' micro-batches) packed into one row, the plain
mean token loss, the same AdamW. Loss curve and every final weight agree to 1e-5. One launch trains every engine's
case one after the other, then the HF ``Trainer``'s under ZeRO-3 (tests/shared_launch.py: one start-up, each test
asserts its case). Each launch has a
timeout, so a hang (a collective one rank never joins) fails instead of stalling.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time

import pytest

from tests.sharded_run import TILE_TOKENS, TRAINER
from tests.shared_launch import launch_once, selected
from tests.test_distributed import ROOT, free_port, load_example, reference_training, run_group

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed: "
                                     "pip install -c constraints.txt -e '.[deepspeed]' (part of .[dev])")
TOLERANCE = 1e-5


@functools.lru_cache(maxsize=2)
def reference(ranks: int = 2, per_rank_mean: bool = False) -> dict:
    """:func:`tests.test_distributed.reference_training`, once per argument pair."""
    return reference_training(ranks, per_rank_mean)


#: The launched tests, and the suffix of their case's name (the engine's name, tiled: ``-tiled``).
LAUNCHED = {"test_sharded_two_processes_equal_single_process": "",
            "test_tiled_mlp_and_loss_sharded_equal_the_untiled_single_process": "-tiled",
            "test_a_tile_dropping_a_token_under_zero3_fails_the_comparison": "-tiled-faulty"}


def case_of(item) -> str | None:
    if item.originalname == "test_trainer_under_zero3_equals_single_process":
        return TRAINER
    suffix = LAUNCHED.get(item.originalname)
    return None if suffix is None else item.callspec.params["engine"] + suffix


def launch_sharded(request, tmp_path_factory, case: str) -> dict:
    """The result of ``case``, from one launch training every case this session selected one after the other
    (tests/shared_launch.py)."""
    cases = selected(request, case_of)
    assert case in cases

    def launch(out, cases):
        model = []  # the Trainer's case trains a saved model
        if TRAINER in cases:
            model = [str(out.parent / "model")]
            load_example().tiny_llama().save_pretrained(model[0])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
               "DS_ACCELERATOR": "cpu"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(ROOT / "tests" / "sharded_run.py"), ",".join(cases), str(out), *model]
        return run_group(command, env, timeout=120 + 60 * len(cases), results=[out])

    returncode, output, runs = launch_once(request, tmp_path_factory, "sharded", cases, launch)
    assert returncode == 0 and runs is not None, output[-6000:]
    return runs[case] if len(cases) > 1 else runs


def differences(run: dict, want: dict) -> tuple[float, float]:
    """Largest loss difference and largest weight difference between two runs."""
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    assert run["state"].keys() == want["state"].keys()
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    return loss, weight


@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("zero2", marks=needs_deepspeed),
                                    pytest.param("zero3", marks=needs_deepspeed)])
def test_sharded_two_processes_equal_single_process(request, tmp_path_factory, engine):
    started = time.monotonic()
    run = launch_sharded(request, tmp_path_factory, engine)
    want = reference()
    assert run["processes"] == 2 and run["engine"] == engine
    assert run["tokens"] == want["tokens"]  # rank r trained micro-batch s*2 + r of the shared plan
    assert len(run["losses"]) == len(want["losses"]) >= 10  # two epochs
    evidence = run["sharding"]
    assert evidence["local_numel"] < evidence["numel"]  # the worker refused to run unsharded; this re-checks it
    loss, weight = differences(run, want)
    print(f"{engine}: max loss difference {loss:.2e}, max weight difference {weight:.2e}, "
          f"{time.monotonic() - started:.0f} s")
    assert loss < TOLERANCE and weight < TOLERANCE
    assert want["losses"][-1] < want["losses"][0]  # it trains
    moved = max((want["state"][k] - reference_init()[k]).abs().max().item() for k in want["state"])
    assert moved > 100 * TOLERANCE  # the weights moved far more than the tolerance: the comparison has teeth


@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_tiled_mlp_and_loss_sharded_equal_the_untiled_single_process(request, tmp_path_factory, engine):
    """``memory.tile_tokens`` under FSDP2 and ZeRO-3, the MLP and the loss tiled: the tiled MLP hands its
    parameters' gradients once per layer to the engine's hooks, the tiled head computes inside the head's (gathered)
    module call; the training equals the untiled single process. Under ZeRO-3 (which releases a parameter after
    every module call that used it, reuse distance 0) the first layer's ``gate_proj.weight`` is released, so
    gathered, twice a step (the forward, and the backward with its recompute), not once per tile: every row spans
    at least 3 tiles, so a gather per tile would be at least 3 in the forward alone."""
    run = launch_sharded(request, tmp_path_factory, engine + "-tiled")
    want = reference()
    assert run["engine"] == engine and run["sharding"]["local_numel"] < run["sharding"]["numel"]
    assert run["tiled"] == 1 + len(load_example().tiny_llama().model.layers)  # the loss and every layer's MLP
    loss, weight = differences(run, want)
    print(f"{engine} tiled: max loss difference {loss:.2e}, max weight difference {weight:.2e}, "
          f"releases {run['releases']} in {len(run['losses'])} steps")
    assert loss < TOLERANCE and weight < TOLERANCE
    if engine == "zero3":
        assert min(min(step) for step in run["tokens"]) > 2 * TILE_TOKENS  # every row spans at least 3 tiles
        assert run["releases"] <= 2 * len(run["losses"])


@needs_deepspeed
@pytest.mark.parametrize("engine", ["zero3"])
def test_a_tile_dropping_a_token_under_zero3_fails_the_comparison(request, tmp_path_factory, engine):
    """The comparison above has teeth under ZeRO-3: every MLP tile dropping its last token's output
    (``padfree_plugins.testing.faults.tile_drops_last_token``) trains far from the untiled single process."""
    run = launch_sharded(request, tmp_path_factory, engine + "-tiled-faulty")
    loss, weight = differences(run, reference())
    assert loss > 10 * TOLERANCE and weight > 10 * TOLERANCE, (loss, weight)


@functools.lru_cache(maxsize=1)
def reference_init() -> dict:
    return {name: p.detach().clone() for name, p in load_example().tiny_llama().named_parameters()}


def test_broken_normalisation_would_fail_the_comparison():
    """The tolerance has teeth: a run normalising each rank's loss by its own token count (a per-rank mean, the
    fault the global count fixes) differs from the reference by far more than the tolerance, in its losses and its
    weights, although the token budget balances the ranks to within a few tokens."""
    loss, weight = differences(reference(per_rank_mean=True), reference())
    assert loss > 10 * TOLERANCE and weight > 10 * TOLERANCE, (loss, weight)


@needs_deepspeed
def test_trainer_under_zero3_equals_single_process(request, tmp_path_factory, tmp_path):
    """HF ``Trainer`` + ``TrainingArguments(deepspeed=ZeRO-3)``, 2 processes, made padding-free by
    ``accelerate(trainer, cfg)`` with token-budget batches: the model loads partitioned (``zero.Init``), trains as
    a ``DeepSpeedEngine`` with partitioned parameters, and its loss curve and final weights equal one plain
    ``Trainer`` process on the same global batches: the plan of 2 replicas, its 2 micro-batches of a step
    accumulated (``gradient_accumulation_steps=2``).

    Why these are equal: with ``average_tokens_across_devices`` each rank's loss is ``2 × its token losses / the
    global count`` (``num_items_in_batch`` gathered over ranks); DeepSpeed averages gradients over the 2 ranks, so a
    step's gradient is ``∇(all token losses) / global count``, which is what one process accumulating both
    micro-batches against their summed count computes; the logged loss (mean over ranks of the scaled losses, or
    the sum of the accumulated ones) is the same number. A rank normalising by its own count instead fails this
    test (test_broken_normalisation_would_fail_the_comparison measures the gap on this plan); so do a rank that
    trains the wrong micro-batch, and a ZeRO-3 LM head computing on its placeholder weight (the labelled-logits
    path, on by default, calls ``lm_head`` as a module, so ZeRO-3 gathers it)."""
    from tests.sharded_run import trainer_losses, trainer_run

    started = time.monotonic()
    run = launch_sharded(request, tmp_path_factory, TRAINER)  # after the plain-loop cases, in their launch
    assert run["engine"] == TRAINER and run["processes"] == 2 and run["partitioned_at_assembly"]
    assert run["sharding"]["local_numel"] < run["sharding"]["numel"]

    trainer, _ = trainer_run(run["model_dir"], str(tmp_path / "reference"), gradient_accumulation_steps=2, ranks=2)
    trainer.train()
    want = {"losses": trainer_losses(trainer),
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()}}
    assert len(run["losses"]) == len(want["losses"]) >= 5
    loss, weight = differences(run, want)
    print(f"trainer-zero3: max loss difference {loss:.2e}, max weight difference {weight:.2e}, "
          f"{time.monotonic() - started:.0f} s")
    assert loss < TOLERANCE and weight < TOLERANCE
