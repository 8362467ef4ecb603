"""The tasks that pool whole examples under ``sequence_parallel: {size: 2}``, through HF ``Trainer`` on 2 CPU processes
(gloo; the worker is tests/sequence_parallel_pooled_run.py, every run in one torchrun launch with a timeout):
``seq_cls`` on a tiny BERT (CLS -> pooler -> classifier), a tiny ModernBERT (mean pooling; local attention
windows of 4 tokens on every other layer) and a tiny Llama (GQA; last token -> score), ``embedding``
(MultipleNegativesRankingLoss over mean-pooled anchor / positive texts) and ``reranker`` (a BERT cross-encoder on
sentence pairs with token types, pointwise BCE).

Each rank loads its own micro-batch, as under data parallelism; the group joins them into one row and each rank runs
the base model on half of it (an encoder's attention bidirectional over each whole example: Ulysses gives every rank
all the row's tokens for its heads, windows included), each rank's own examples' last hidden states come from the
slices that computed them (one all-to-all) and each rank pools, scores and computes the loss of its own examples (an
in-batch-negatives loss: its own micro-batch's negatives, as under data parallelism). The reference is one process on
the same global batches: the trainer with both ranks' micro-batches of a step accumulated
(``gradient_accumulation_steps=2``; HF ``Trainer``'s own convention for each task's loss, the same under DDP). Logged
losses (1e-5), every parameter's gradient at every step and the final weights (1e-4), and ``predict``'s predictions
(1e-5) agree; the deliberate fault ``pooling_reads_local_slice`` (each rank pools from its own slice alone) is far
off. Bad input is refused at ``accelerate()``, nothing changed.
"""

from __future__ import annotations

import functools
import tempfile

import numpy as np
import pytest
import torch

from tests.sequence_parallel_pooled_run import CASES, FAULT, STEPS, make_model, make_trainer, result_of
from tests.distributed_common import OUT, launch, launch_shared

LOSS_TOLERANCE = 1e-5
TOLERANCE = 1e-4
FAULTS = ("bert-seq_cls" + FAULT, "bert-embedding" + FAULT)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """Every case of the worker, and the faults, in one 2-process launch (once per session)."""
    return launch_shared(request, tmp_path_factory, "sequence_parallel_pooled_run.py", OUT, *CASES, *FAULTS,
                         timeout=300)


@functools.lru_cache(maxsize=len(CASES))
def reference(case: str) -> dict:
    """One process, the same global batches (both ranks' micro-batches of a step accumulated), no sequence
    parallelism."""
    trainer, acceleration = make_trainer(case, tempfile.mkdtemp(), ranks=2)
    trainer.train()
    result = result_of(trainer)
    acceleration.undo()
    result["initial"] = {name: p.detach().clone() for name, p in make_model(case).named_parameters()}
    return result


def flat(predictions) -> list[np.ndarray]:
    return [np.asarray(p) for p in (predictions if isinstance(predictions, tuple) else (predictions,))]


def differences(run: dict, want: dict) -> tuple[float, float, float, float]:
    """Largest loss, gradient (any parameter, any step), final-weight and prediction differences."""
    assert len(run["losses"]) == len(want["losses"]) == STEPS
    assert len(run["grads"]) == len(want["grads"]) == STEPS
    assert all(got.keys() == ref.keys() and ref for got, ref in zip(run["grads"], want["grads"]))
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    grad = max((got[k] - ref[k]).abs().max().item() for got, ref in zip(run["grads"], want["grads"]) for k in ref)
    assert run["state"].keys() == want["state"].keys()
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    got, ref = flat(run["predictions"]), flat(want["predictions"])
    assert [p.shape for p in got] == [p.shape for p in ref]
    prediction = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    return loss, grad, weight, prediction


@pytest.mark.parametrize("case", list(CASES))
def test_pooled_task_under_sequence_parallelism_equals_one_process(launched, case):
    run, want = launched[case], reference(case)
    loss, grad, weight, prediction = differences(run, want)
    print(f"{case} sp2: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}, "
          f"predictions {prediction:.2e}")
    assert loss < LOSS_TOLERANCE and prediction < LOSS_TOLERANCE
    assert grad < TOLERANCE and weight < TOLERANCE
    # what is compared is far from zero: the gradients are large and the weights move
    assert max(g.abs().max().item() for step in want["grads"] for g in step.values()) > 1e3 * TOLERANCE
    assert max((want["state"][k] - want["initial"][k]).abs().max().item() for k in want["state"]) > 100 * TOLERANCE
    # each rank embedded half of the group's row (its slice), every training call; examples crossed the cut
    own, embedded = run["own"], run["embedded"]
    assert len(own[0]) == len(own[1]) == len(embedded[0]) == len(embedded[1]) == STEPS
    crossed = 0
    for step, (mine, theirs) in enumerate(zip(*own)):
        row = mine[-1] + theirs[-1]
        half = -(-row // 2)
        assert embedded[0][step] == embedded[1][step] == half
        starts = set(mine) | {mine[-1] + b for b in theirs}
        crossed += half not in starts  # the cut falls inside an example
    assert crossed >= 2


@pytest.mark.parametrize("case", FAULTS)
def test_pooling_from_the_local_slice_is_caught(launched, case):
    """Each rank pooling its examples from its own slice of the row alone (zeros where the other rank computed the
    hidden states) is far from one process."""
    loss, grad, weight, prediction = differences(launched[case], reference(case.removesuffix(FAULT)))
    print(f"{case}: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert loss > 100 * LOSS_TOLERANCE and grad > 100 * TOLERANCE


# -- one process: what sequence parallelism refuses, at accelerate(), nothing changed -----------------------------


def faked_group(monkeypatch) -> None:
    """A sequence-parallel group of 2 without a process group (nothing collective runs before a refusal)."""
    from padfree_plugins.modeling.attention.ulysses import SequenceGroup

    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))


@pytest.mark.parametrize("task, match", [
    ("hidden_states", r"sequence_parallel.size: 2 trains causal language models \(task: causal_lm\) and the tasks "
                      r"that pool whole examples \(seq_cls, embedding, reranker\); task 'hidden_states'"),
])
def test_a_task_that_does_not_pool_is_refused(monkeypatch, tmp_path, task, match):
    from transformers import Trainer, TrainingArguments

    from padfree_plugins import ConfigError, accelerate, patch_of

    faked_group(monkeypatch)
    model = make_model("bert-embedding")
    implementation = model.config._attn_implementation
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True))
    collator = trainer.data_collator
    with pytest.raises(ConfigError, match=match):
        accelerate(trainer, {"task": task, "sequence_parallel": {"size": 2}})
    assert patch_of(model) is None and model.config._attn_implementation == implementation
    assert trainer.data_collator is collator and "compute_loss" not in vars(trainer)



@pytest.mark.parametrize("sizes, local, plans", [
    # 2 ranks, 30 + 20 tokens, slices of 25: rank 0's slice all its own; rank 1's 5 of rank 0's, then its 20
    ([30, 20], 25, [([25, 0], [25, 5]), ([5, 20], [0, 20])]),
    # 31 + 20 tokens, slices of 26 (one padding token last): rank 1 sends 5 of rank 0's, 20 of its own
    ([31, 20], 26, [([26, 0], [26, 5]), ([5, 20], [0, 20])]),
    # 3 ranks, a long micro-batch on rank 0 spanning two slices, an empty one on rank 1
    ([20, 0, 4], 8, [([8, 0, 0], [8, 8, 4]), ([8, 0, 0], [0, 0, 0]), ([4, 0, 4], [0, 0, 4])]),
])
def test_the_exchange_plan_sends_each_rank_its_own_tokens(sizes, local, plans):
    from padfree_plugins.modeling.sequence_parallel import exchange_plan

    for rank, plan in enumerate(plans):
        assert exchange_plan(sizes, rank, local) == plan
    for rank in range(len(sizes)):  # what every rank receives from rank q is what rank q sends it
        assert [exchange_plan(sizes, q, local)[0][rank] for q in range(len(sizes))] == \
            exchange_plan(sizes, rank, local)[1]


def test_only_what_the_base_reads_is_exchanged_and_a_per_example_input_is_refused():
    """The group's row carries the per-token keys and the boundaries; the per-example keys (labels, counts) stay on
    their rank. A per-example input of the base (X-MOD's ``lang_ids`` per example) cannot be sliced: refused, before
    any exchange."""
    from padfree_plugins import PadfreeError
    from padfree_plugins.modeling.sequence_parallel import base_inputs
    from padfree_plugins.packing.batch import PackedBatch

    batch = PackedBatch(input_ids=torch.arange(5)[None], position_ids=torch.tensor([[0, 1, 2, 0, 1]]),
                        cu_seq_lens_q=torch.tensor([0, 3, 5], dtype=torch.int32), max_length_q=3,
                        labels=torch.tensor([0, 1]), num_rows=2)
    batch.model_keys = ("token_type_ids",)
    kept = base_inputs(batch)
    assert list(kept) == ["input_ids", "position_ids", "cu_seq_lens_q", "max_length_q"]
    assert kept.model_keys == ("token_type_ids",)
    with pytest.raises(PadfreeError, match=r"lang_ids holds one value per example.*sequence_parallel.size: 1"):
        base_inputs(PackedBatch(batch, lang_ids=torch.tensor([0, 1])))


def test_seq_cls_under_sequence_and_data_parallelism_equals_one_process(tmp_path):
    """``seq_cls`` on the tiny Llama at SP = 2 x DP = 2 on 4 processes (two groups of 2, each rank its own
    micro-batches): losses, every gradient at every step, the final weights and ``predict``'s predictions equal one
    process accumulating the 4 ranks' micro-batches of each step; each group embedded its own joined row."""
    case = "llama-seq_cls"
    out = tmp_path / "runs.pt"
    run = launch("sequence_parallel_pooled_run.py", str(out), case, out=out, processes=4, timeout=300)[case]
    trainer, acceleration = make_trainer(case, tempfile.mkdtemp(), ranks=4)
    trainer.train()
    want = result_of(trainer)
    acceleration.undo()
    loss, grad, weight, prediction = differences(run, want)
    print(f"{case} sp2 x dp2: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}, "
          f"predictions {prediction:.2e}")
    assert loss < LOSS_TOLERANCE and prediction < LOSS_TOLERANCE and grad < TOLERANCE and weight < TOLERANCE
    assert max(g.abs().max().item() for step in want["grads"] for g in step.values()) > 1e3 * TOLERANCE
    own, embedded = run["own"], run["embedded"]
    for first in (0, 2):  # each group's ranks embedded half of their own two micro-batches' row at every step
        rows = [mine[-1] + theirs[-1] for mine, theirs in zip(own[first], own[first + 1])]
        assert embedded[first] == embedded[first + 1] == [-(-row // 2) for row in rows] and len(rows) == STEPS
    assert embedded[0] != embedded[2]
