"""Sequence parallelism on a sharded hybrid: a tiny Qwen3.5-shaped model (gated-DeltaNet mixers, slow decays so that
the state passed across a cut matters) at ``sequence_parallel.size: 2`` on 2 CPU processes (gloo), its weights
sharded by FSDP2 or DeepSpeed ZeRO-3, equal to one process on the same global batches.

One launch (tests/sequence_parallel_sharded_run.py, 240 s timeout): FSDP2 (``fully_shard`` per decoder layer and on
the root, every parameter a ``DTensor``; a plain loop, as HF ``Trainer`` cannot run FSDP2 on CPU) with the mixers
split across the ranks and gradient checkpointing, 3 SGD steps; the same with the deliberate fault
``state_from_wrong_rank``; HF ``Trainer`` under ZeRO-3 (every parameter partitioned) with ``mixers: gather`` and
checkpointing, 4 SGD steps. Split mixers under ZeRO-3 are refused at ``accelerate()`` (checked in one process): ZeRO-3
gathers a mixer's weights by a collective at every call, and the two sides of a cut call it a different number of
times, so the ranks wait for each other forever (seen: a hang in the first forward).
"""

from __future__ import annotations

import functools
import tempfile
import time

import pytest
import torch

from tests.distributed_common import OUT, launch_shared
from tests.test_sharded import needs_deepspeed


LOSS_TOLERANCE = 1e-5  # relative
TOLERANCE = 1e-4  # gradients and weights


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """Every case of the worker, in one 2-process launch (once per session); the wall time it took."""
    pytest.importorskip("deepspeed")
    started = time.monotonic()
    runs = launch_shared(request, tmp_path_factory, "sequence_parallel_sharded_run.py", OUT, "fsdp2",
                         "fsdp2-wrong-rank", "zero3", timeout=240, env={"DS_ACCELERATOR": "cpu"})
    print(f"sharded sequence-parallel launch: {time.monotonic() - started:.0f} s")
    return runs


@functools.cache
def loop_reference() -> dict:
    """One process: each step's examples of both ranks in one row, the mean token loss, the same SGD."""
    from padfree_plugins import assemble
    from padfree_plugins.batching.distributed import num_label_tokens
    from tests.sequence_parallel_sharded_run import LR, STEPS, loop_examples, loop_model

    model = loop_model()
    assembly = assemble(model, {"task": "causal_lm"})
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        batch = assembly.collator(loop_examples(step, 0) + loop_examples(step, 1))
        loss = assembly.forward(model, batch, num_items_in_batch=torch.tensor(float(num_label_tokens(batch)))).loss
        loss.backward()
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assembly.undo()
    return {"losses": losses, "grads": grads, "initial": initial,
            "state": {name: p.detach().clone() for name, p in model.named_parameters()}}


def loop_differences(run: dict, want: dict) -> tuple[float, float, float]:
    """Largest relative loss, gradient (any parameter, any step) and final-weight differences."""
    assert len(run["losses"]) == len(want["losses"]) == len(run["grads"]) == len(want["grads"]) >= 3
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], want["losses"]))
    assert all(got.keys() == ref.keys() for got, ref in zip(run["grads"], want["grads"]))
    grad = max((got[k] - ref[k]).abs().max().item() for got, ref in zip(run["grads"], want["grads"]) for k in ref)
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    return loss, grad, weight


@needs_deepspeed
def test_split_mixers_under_fsdp2_equal_one_process(launched):
    """FSDP2 with the gated-DeltaNet mixers split across the ranks (the state passed across the cut through FSDP's
    gathered layers, recomputed under checkpointing): losses, every gradient at every step, the final weights."""
    from tests.sequence_parallel_sharded_run import PER_RANK, STEPS, loop_examples

    run, want = launched["fsdp2"], loop_reference()
    assert run["split_mixers"] > 0 and run["sharding"]["local_numel"] < run["sharding"]["numel"]
    # the cut falls inside an example at every step (each rank holds half of the joined row)
    for step in range(STEPS):
        lengths = [len(e["input_ids"]) for rank in (0, 1) for e in loop_examples(step, rank)]
        assert [sum(lengths[:PER_RANK]), sum(lengths[PER_RANK:])] == [m[step] for m in run["micro_batches"]]
        cut, bounds = -(-sum(lengths) // 2), {sum(lengths[:i]) for i in range(len(lengths) + 1)}
        assert cut not in bounds, (step, lengths)
    loss, grad, weight = loop_differences(run, want)
    print(f"fsdp2 split mixers: max relative loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert loss < LOSS_TOLERANCE and grad < TOLERANCE and weight < TOLERANCE
    # what is compared is far from zero: the gradients are large and the weights move
    assert max(g.abs().max().item() for step in want["grads"] for g in step.values()) > 1e3 * TOLERANCE
    assert max((want["state"][k] - want["initial"][k]).abs().max().item() for k in want["state"]) > 100 * TOLERANCE


@needs_deepspeed
def test_state_from_the_wrong_rank_under_fsdp2_is_caught(launched):
    """The deliberate fault ``state_from_wrong_rank`` (the piece after the cut starts from its own rank's last state,
    not the previous rank's) fails the FSDP2 comparison."""
    loss, grad, weight = loop_differences(launched["fsdp2-wrong-rank"], loop_reference())
    print(f"fsdp2 state from the wrong rank: loss {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert grad > 100 * TOLERANCE


@needs_deepspeed
def test_trainer_under_zero3_with_gathered_mixers_equals_one_process(launched):
    """HF ``Trainer`` under DeepSpeed ZeRO-3 (``mixers: gather``, checkpointing, SGD, no clipping): the logged losses,
    every step's gradient (its weight update over the rate), the final weights and ``eval_loss`` equal one plain
    ``Trainer`` process accumulating both ranks' micro-batches of each step."""
    from tests.sequence_parallel_sharded_run import StepWeights
    from tests.sequence_parallel_trainer_run import SHARDED_CASES, TRAINER_CONFIG, make_trainer, trainer_result

    run = launched["zero3"]
    assert run["whole_row_mixers"] > 0 and run["split_mixers"] == 0
    assert run["sharding"]["local_numel"] < run["sharding"]["numel"]
    trainer, acceleration = make_trainer("hf-hybrid-zero3", tempfile.mkdtemp(), TRAINER_CONFIG, ranks=2)
    steps = StepWeights.attach(trainer)
    trainer.train()
    want = trainer_result(trainer)
    acceleration.undo()
    rate = SHARDED_CASES["hf-hybrid-zero3"]["lr"]
    assert len(run["losses"]) == len(want["losses"]) >= 3 and len(run["steps"]) == len(steps.weights)
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], want["losses"]))
    updates = [(run["steps"][s][k] - run["steps"][s + 1][k], steps.weights[s][k] - steps.weights[s + 1][k])
               for s in range(len(steps.weights) - 1) for k in steps.weights[s]]
    grad = max((a - b).abs().max().item() for a, b in updates) / rate
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    evaluation = abs(run["eval_loss"] - want["eval_loss"]) / want["eval_loss"]
    print(f"zero3 gathered mixers: max relative loss difference {loss:.2e}, gradients {grad:.2e}, "
          f"weights {weight:.2e}, eval_loss {evaluation:.2e}")
    assert loss < LOSS_TOLERANCE and grad < TOLERANCE and weight < TOLERANCE and evaluation < LOSS_TOLERANCE
    assert max(b.abs().max().item() for _, b in updates) / rate > 1e3 * TOLERANCE  # real gradients


@needs_deepspeed
def test_split_mixers_under_zero3_are_refused(monkeypatch, tmp_path):
    """``mixers: split`` (the default) with DeepSpeed ZeRO-3 configured is refused at ``accelerate()`` with the reason
    and what to set; the trainer and model are left as they were; ``mixers: gather`` is accepted."""
    from transformers import Trainer, TrainingArguments
    from transformers.integrations import HfDeepSpeedConfig

    from padfree_plugins import ConfigError, accelerate, assemble, patch_of
    from padfree_plugins.modeling.attention.ulysses import SequenceGroup
    from tests.sequence_parallel_trainer_run import ZERO3, rows, tiny_hybrid

    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))
    import datasets

    model = tiny_hybrid()
    forwards = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
                      train_dataset=datasets.Dataset.from_list(rows(4, 0)))
    zero3 = HfDeepSpeedConfig({**ZERO3, "train_micro_batch_size_per_gpu": 1, "train_batch_size": 2,
                               "gradient_accumulation_steps": 1, "gradient_clipping": 0.0})  # noqa: F841 (kept alive)
    with pytest.raises(ConfigError, match=r"sequence_parallel.mixers: split under DeepSpeed ZeRO-3 "
                                          r"\(Qwen3_5GatedDeltaNet\).*wait for each other forever.*"
                                          r"sequence_parallel.mixers: gather"):
        accelerate(trainer, {"task": "causal_lm", "sequence_parallel": {"size": 2}})
    assert patch_of(model) is None
    assert {name: module.__dict__.get("forward") for name, module in model.named_modules()} == forwards
    acceleration = accelerate(trainer, {"task": "causal_lm", "sequence_parallel": {"size": 2, "mixers": "gather"}})
    acceleration.undo()
    del zero3
    # a model already partitioned (loaded under zero.Init: its parameters carry ds_id) is refused without the config
    partitioned = tiny_hybrid()
    for number, parameter in enumerate(partitioned.parameters()):
        parameter.ds_id = number
    with pytest.raises(ConfigError, match=r"mixers: split under DeepSpeed ZeRO-3"):
        assemble(partitioned, {"task": "causal_lm", "sequence_parallel": {"size": 2}})
    assert patch_of(partitioned) is None
