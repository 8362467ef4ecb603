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
import torch

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
            "test_a_tile_dropping_a_token_under_zero3_fails_the_comparison": "-tiled-faulty",
            "test_tiled_mlp_under_zero3_on_moe_equals_the_untiled_single_process": "-tiled-moe",
            "test_evaluation_under_zero3_with_the_tiled_mlp_lets_every_parameter_go": "-tiled",
            "test_hybrid_under_zero3_with_rows_of_different_groups_equals_one_process": "-hybrid"}


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


@needs_deepspeed
@pytest.mark.parametrize("engine", ["zero3"])
def test_tiled_mlp_under_zero3_on_moe_equals_the_untiled_single_process(request, tmp_path_factory, engine):
    """The tiled MLP tiles a mixture of experts' routed experts (its router untiled): a tiny Qwen3-MoE under ZeRO-3
    (tests/same_modules_run.py's ``moe`` scenario: 8 experts, one per token, rank 0 rows of 98 tokens, rank 1 of 2),
    tiles of 16 tokens, equals the untiled single process. Both ranks run 7 tiles (rank 1's mostly empty: ZeRO-3
    gives every rank as many), and the first layer's ``experts.gate_up_proj`` is released (gathered) at most twice a
    step, not once per tile."""
    from tests.same_modules_run import STEPS, reference as same_modules_reference

    run = launch_sharded(request, tmp_path_factory, engine + "-tiled-moe")
    want = same_modules_reference("moe")
    assert run["sharding"]["local_numel"] < run["sharding"]["numel"]
    assert run["tiled"] == ["Qwen3MoeExperts"] * 2  # every layer's routed experts
    assert run["tokens"] == [[98, 2]] * STEPS and 98 > 6 * TILE_TOKENS  # rank 0's row spans 7 tiles
    loss, weight = differences(run, want)
    print(f"zero3 tiled moe: max loss difference {loss:.2e}, max weight difference {weight:.2e}, "
          f"releases {run['releases']} in {len(run['losses'])} steps")
    assert len(run["losses"]) == STEPS and loss < TOLERANCE and weight < TOLERANCE
    assert 1 <= run["releases"] <= 2 * STEPS


@functools.lru_cache(maxsize=1)
def reference_eval() -> list[float]:
    """One process, untiled, at the reference's trained weights: the eval loss (``no_grad``) of each of epoch 0's
    first global batches (both ranks' micro-batches in one row), as many as the launched evaluation runs."""
    from padfree_plugins import assemble, load_config
    from padfree_plugins.batching.sampler import token_budget_sampler
    from tests.sharded_run import EVAL_STEPS
    from tests.test_distributed import LOOP_ARGS

    loop = load_example()
    args = loop.parse_args(LOOP_ARGS)
    config = load_config(args.config)
    config.batching.max_tokens_per_batch = args.max_tokens
    model = loop.tiny_llama()
    model.load_state_dict(reference()["state"])
    assembly = assemble(model, config)
    dataset = loop.synthetic_dataset(args.examples, args.median_length, model.config.vocab_size)
    plan = token_budget_sampler(dataset, config, num_replicas=2).plan(0)
    model.eval()
    with torch.no_grad():
        losses = [assembly.forward(model, assembly.collator([dataset[i] for b in plan[2 * s:2 * s + 2] for i in b]))
                  .loss.item() for s in range(EVAL_STEPS)]
    assembly.undo()
    return losses


@needs_deepspeed
@pytest.mark.parametrize("engine", ["zero3"])
def test_evaluation_under_zero3_with_the_tiled_mlp_lets_every_parameter_go(request, tmp_path_factory, engine):
    """Evaluation (``model.eval()``, ``no_grad``: no backward to let go of the parameters the tiled MLP holds gathered
    over its tiles) under ZeRO-3 with the MLP and the loss tiled, after the tiled training: its losses equal the
    untiled single process at the same weights; no tiled call holds a parameter afterwards, and after one more
    training step every parameter is back to its partitioned placeholder. The deliberate fault
    ``held_gather_never_let_go`` (the held parameters never let go) leaves every tiled MLP's parameters held after
    the evaluation: the check has teeth. (DeepSpeed itself leaves every parameter gathered after a forward without
    backward, tiled or not, once its trace holds a backward; its optimizer step partitions every parameter and
    clears every hold, so a hold left over does not outlive the next step.)"""
    from tests.sharded_run import EVAL_STEPS

    evaluation = launch_sharded(request, tmp_path_factory, engine + "-tiled")["eval"]
    clean, faulty = evaluation["clean"], evaluation["faulty"]
    want = reference_eval()
    difference = max(abs(a - b) for a, b in zip(clean["losses"], want))
    print(f"zero3 tiled eval: max loss difference {difference:.2e}; held after it {len(clean['held'])}, gathered "
          f"after the next step {len(clean['gathered_after_step'])}; with the fault: {len(faulty['held'])} held, "
          f"{len(faulty['gathered_after_step'])} gathered")
    assert len(clean["losses"]) == len(want) == EVAL_STEPS and difference < TOLERANCE
    assert clean["held"] == [] and clean["gathered_after_step"] == []
    mlp = {f"model.layers.{i}.mlp.{name}_proj.weight" for i in range(2) for name in ("gate", "up", "down")}
    assert set(faulty["held"]) == mlp, faulty


def hybrid_reference() -> dict:
    """One process, no ZeRO, no checkpointing: :data:`~tests.sharded_run.HYBRID_CASE`'s steps, each step's examples
    of both ranks in one row, the mean token loss, the same SGD; its losses, first-step gradients and final weights."""
    from padfree_plugins import assemble
    from padfree_plugins.batching.distributed import num_label_tokens
    from tests.sequence_parallel_sharded_run import loop_model
    from tests.sharded_run import HYBRID_STEPS, hybrid_examples

    model = loop_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    assembly = assemble(model, {"task": "causal_lm", "mixers": "exact"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], {}
    for step in range(HYBRID_STEPS):
        batch = assembly.collator(hybrid_examples(step, 0) + hybrid_examples(step, 1))
        loss = assembly.forward(model, batch, num_items_in_batch=num_label_tokens(batch)).loss
        loss.backward()
        if step == 0:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assembly.undo()
    return {"losses": losses, "grads": grads, "initial": initial,
            "state": {name: p.detach().clone() for name, p in model.named_parameters()}}


@needs_deepspeed
@pytest.mark.parametrize("engine", ["zero3"])
def test_hybrid_under_zero3_with_rows_of_different_groups_equals_one_process(request, tmp_path_factory, engine):
    """A hybrid (gated-DeltaNet mixers run on each example alone, ``mixers: exact``) under ZeRO-3 data parallelism,
    gradient checkpointing on, rank 0's rows of 150, 70 and 10 tokens (3 mixer calls per layer, one per number of
    64-token chunks), rank 1's of one 12-token example (1 call): ZeRO-3 gathers a mixer's weights at each of its
    calls, so rank 1 makes 2 more on zeros (their outputs tied in times 0). Every rank runs the first mixer's input
    projection as often, forward and backward; the ranks agreed on it by one all-reduce per forward (none in the
    recompute); losses, first-step gradients and final weights equal one process (which crashed with a gloo
    "collective mismatch" before). A dummy call left out of the backward graph
    (``padfree_plugins.testing.faults.dummy_calls_untied``) is caught by tests/test_mixer_call_agreement.py."""
    from tests.sharded_run import HYBRID_STEPS

    run = launch_sharded(request, tmp_path_factory, engine + "-hybrid")
    want = hybrid_reference()
    assert run["sharding"]["local_numel"] < run["sharding"]["numel"]
    assert run["agreements"] == [HYBRID_STEPS] * 2  # one per forward, none per layer or in the recompute
    for step in run["calls"]:  # per step: [[forward, backward] of rank 0, of rank 1]
        assert step[0] == step[1] and step[0][0] == 2 * 3 and step[0][1] == 3, run["calls"]  # 3 calls, recomputed
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    grad = max((run["grads"][k] - want["grads"][k]).abs().max().item() for k in want["grads"])
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    moved = max((want["state"][k] - want["initial"][k]).abs().max().item() for k in want["state"])
    print(f"zero3 hybrid: max loss difference {loss:.2e}, gradient {grad:.2e}, weight {weight:.2e} (moved {moved:.2e});"
          f" calls {run['calls']}")
    assert run["grads"].keys() == want["grads"].keys() and run["state"].keys() == want["state"].keys()
    assert len(run["losses"]) == HYBRID_STEPS and loss < TOLERANCE
    assert grad < 1e-4 and weight < 1e-4 and moved > 100 * 1e-4
