"""TRL ``DPOTrainer`` under ``sequence_parallel: {size: 2}`` on 2 CPU processes (gloo; the worker is
tests/sequence_parallel_trl_run.py, launched by torchrun with a timeout).

Each rank loads 2 pairs a step, as under data parallelism; every fused log-probability call, the policy's and the
reference model's, packs its rows, the group joins them into one row and each rank computes half of it; each rank
keeps its own examples' log-probabilities, so TRL's loss and metrics are those of data parallelism. Losses, reward
margins and final weights equal one process of 4 pairs a step (sigmoid loss, a separate reference model) to 1e-5;
the two faults (no gather of the per-token outputs; each rank keeping the joined row's first tokens) are far off.
After training, ``evaluate()`` and ``predict()`` with ``compute_metrics`` (2 pairs a rank, a completion across every
cut) equal one process's; predicting with each rank keeping the joined row's first tokens is far off.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import pytest
import torch

from tests.shared_launch import launch_once
from tests.test_distributed import ROOT, free_port, run_group

pytest.importorskip("trl")

TOLERANCE = 1e-5
MODES = ("exact", "no-gather", "first-range")


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """Every mode of the worker, in one 2-process launch (once per session: tests/shared_launch.py)."""

    def run(out, _):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(ROOT / "tests" / "sequence_parallel_trl_run.py"), ",".join(MODES), str(out)]
        return run_group(command, env, timeout=240, results=[out])

    returncode, output, runs = launch_once(request, tmp_path_factory, "launched", [], run,
                                           lambda out: torch.load(out, weights_only=False))
    assert returncode == 0, output[-6000:]
    return runs


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, padding-free without sequence parallelism, 4 pairs a step: the global batches of the launch. With
    ``compute_metrics``, ``accelerate()`` says that TRL's extra forward for its logits runs padded."""
    from tests.sequence_parallel_trl_run import dpo_trainer, result

    from tests.distributed_common import evaluated

    with pytest.warns(UserWarning, match=r"DPOTrainer with compute_metrics: TRL recomputes the logits.*padded"):
        trainer = dpo_trainer(tempfile.mkdtemp(), {"task": "causal_lm"}, batch_size=4)
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    return {**result(trainer), "initial": initial, "evaluation": evaluated(trainer)}


def differences(run: dict, want: dict) -> tuple[float, float, float]:
    """Largest loss, reward-margin and weight differences between two runs."""
    assert len(run["losses"]) == len(want["losses"]) == 3 and len(run["margins"]) == 3
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    margin = max(abs(a - b) for a, b in zip(run["margins"], want["margins"]))
    assert run["state"].keys() == want["state"].keys()
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    return loss, margin, weight


def test_dpo_under_sequence_parallelism_equals_one_process(launched, reference):
    run = launched["exact"]
    assert run["processes"] == 2
    loss, margin, weight = differences(run, reference)
    print(f"dpo sp2: max loss difference {loss:.2e}, margins {margin:.2e}, weights {weight:.2e}")
    assert loss < TOLERANCE and margin < TOLERANCE and weight < TOLERANCE
    assert max(map(abs, reference["margins"])) > 1e-2  # the policy moved away from the reference
    initial = reference["initial"]
    assert max((reference["state"][k] - initial[k]).abs().max().item() for k in initial) > 100 * TOLERANCE
    # every fused call (policy and reference, 3 steps, each a forward) split: each rank computed half the joined row
    seen = run["seen"]
    assert len(seen[0]) == len(seen[1]) >= 2 * 3
    assert all(local == -(-joined // 2) for rank in seen for joined, local in rank)
    assert [joined for joined, _ in seen[0]] == [joined for joined, _ in seen[1]]


#: What ``evaluate()`` and ``predict()`` report and the test compares: the loss, the ``compute_metrics`` values
#: (tests/distributed_common.py ``token_metrics``) and, from ``evaluate()``, TRL's metrics that are means over pairs
#: (its ``logits/*`` and ``mean_token_accuracy`` are ratios of sums per logged batch, so one process evaluating 2
#: pairs a batch averages them otherwise than 2 ranks gathered; accuracies are discontinuous).
EVAL_KEYS = ("loss", "nll", "rows")
TRL_EVAL_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def test_dpo_evaluate_and_predict_under_sequence_parallelism_equal_one_process(launched, reference):
    """``evaluate()`` and ``predict()`` with ``compute_metrics``, after training, each rank evaluating 2 pairs whose
    fused calls are split across the group (a completion across every cut): the loss, the metrics and the predictions
    (the padded logits of TRL's extra forward, which runs on each rank's own pairs) equal one process evaluating the
    same pairs 2 at a time. Predicting with each rank keeping the joined row's first tokens (not its own) changes the
    loss far beyond the tolerance."""
    from tests.distributed_common import evaluation_differences

    run, want = launched["exact"]["evaluation"], reference["evaluation"]
    cuts = launched["exact"]["evaluation_cuts"]
    assert cuts[0] == cuts[1] and len(cuts[0]) >= 2 and all(cuts[0]), cuts  # policy and reference calls, each cut
    assert run["metrics"]["test_rows"] == 2 * 4  # every pair's chosen and rejected row, each once
    metrics, predictions = evaluation_differences(run, want, EVAL_KEYS, TRL_EVAL_KEYS)
    print(f"dpo sp2 evaluation: max metric difference {metrics:.2e}, predictions {predictions:.2e}")
    assert metrics < TOLERANCE and predictions < TOLERANCE
    assert abs(want["evaluate"]["eval_rewards/margins"]) > 1e-2  # the trained policy, away from the reference
    faulty = abs(run["faulty"]["metrics"]["test_loss"] - want["metrics"]["test_loss"])
    print(f"dpo sp2 evaluation, first-range: loss difference {faulty:.2e}")
    assert faulty > 100 * TOLERANCE


@pytest.mark.parametrize("fault", ["no-gather", "first-range"])
def test_sequence_parallel_dpo_faults_are_caught(launched, reference, fault):
    """Reading the slice's own outputs without the gather, or another rank's tokens, is far from one process."""
    loss, margin, weight = differences(launched[fault], reference)
    print(f"dpo sp2 {fault}: max loss difference {loss:.2e}, margins {margin:.2e}, weights {weight:.2e}")
    assert max(loss, margin, weight) > 100 * TOLERANCE


# -- one process: a group of one rank (gloo), the pieces the launch relies on --------------------------------------


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone, and the sequence-parallel group of it."""
    import torch.distributed as dist

    from padfree_plugins.modeling.attention.ulysses import SequenceGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield SequenceGroup(None, 0, 1)
    finally:
        dist.destroy_process_group()


def test_a_pre_shifted_row_is_sliced_without_shifting_again():
    """TRL's fused calls carry ``shift_labels`` (targets already shifted): sliced as they are, padded with -100."""
    from padfree_plugins.packing.sequence_parallel import slice_row

    row = {"input_ids": torch.arange(5)[None], "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
           "cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
           "cu_seq_lens_k": torch.tensor([0, 3, 5], dtype=torch.int32), "max_length_q": 3, "max_length_k": 3,
           "shift_labels": torch.tensor([[11, 12, -100, 14, -100]])}
    slices = [slice_row(row, rank, 2, pre_shifted=True) for rank in (0, 1)]
    assert [s["shift_labels"].tolist() for s in slices] == [[[11, 12, -100]], [[14, -100, -100]]]
    assert "labels" not in slices[0] and slices[1]["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]
    assert "shift_labels" not in slice_row(row, 0, 2)  # the default: labelled logits are recomputed, not carried


def sequence_parallel_head(group, monkeypatch):
    """A tiny fused Llama, an assembled copy of it whose fused head runs with ``group``, and the list that records
    each call of :func:`~padfree_plugins.integrations.trl_fused.fused_on_slice`."""
    from padfree_plugins import assemble
    from padfree_plugins.integrations import trl_fused
    from tests.test_trl_fused import fused, tiny_model

    torch.manual_seed(0)
    reference = fused(tiny_model("llama", "causal_lm", num_key_value_heads=2)).train()
    packed = copy.deepcopy(reference)
    assemble(packed, {"task": "causal_lm"})
    trl_fused.PackedFusedHead.install(packed).sequence = group
    split, original = [], trl_fused.fused_on_slice

    def spy(*args):
        split.append(1)
        return original(*args)

    monkeypatch.setattr(trl_fused, "fused_on_slice", spy)
    return reference, packed, split


def assert_trls_outputs(got, want) -> None:
    from tests.test_trl_fused import FIELDS

    for name in (*FIELDS, "label_mask", "loss"):
        torch.testing.assert_close(getattr(got, name).float(), getattr(want, name).float(), atol=1e-5, rtol=1e-5,
                                   msg=name)


def test_an_unpadded_fused_call_is_split_under_sequence_parallelism(one_rank_group, monkeypatch):
    """Under sequence parallelism a fused call without any pad is packed too (every rank must exchange its row; one
    that ran TRL's padded forward would leave the others waiting), and equals TRL's outputs."""
    from tests.test_trl_fused import fused_call, padded_batch

    reference, packed, split = sequence_parallel_head(one_rank_group, monkeypatch)
    batch = padded_batch([(3, 5), (4, 4), (2, 6)], "right", reference.config.vocab_size)  # every row 8 tokens
    assert bool(batch["attention_mask"].all())
    got, want = fused_call(packed, batch), fused_call(reference, batch)
    assert split == [1], "the unpadded fused call was not split"
    assert_trls_outputs(got, want)


def test_a_call_another_rank_cannot_pack_runs_padded_on_every_rank(one_rank_group, monkeypatch):
    """When one rank of the group cannot pack its fused call, every rank runs TRL's padded forward (no exchange)."""
    from padfree_plugins.integrations import trl_fused
    from tests.test_trl_fused import SHAPES, fused_call, padded_batch

    reference, packed, split = sequence_parallel_head(one_rank_group, monkeypatch)
    asked = []
    monkeypatch.setattr(trl_fused, "all_ranks_pack", lambda packs, group, device: asked.append(packs) and False)
    batch = padded_batch(SHAPES, "right", reference.config.vocab_size)
    got, want = fused_call(packed, batch), fused_call(reference, batch)
    assert asked == [True] and split == []  # this rank could pack; another could not: none did
    assert_trls_outputs(got, want)


@pytest.mark.parametrize("state, match", [
    ({"aux_loss_enabled": True}, r"MoE router aux loss under sequence parallelism.*router_aux_loss_coef=0.0"),
])
def test_what_sequence_parallel_dpo_cannot_do_is_refused(state, match):
    """The fused calls do not take each rank's share of the MoE load-balancing loss of the group's row (image-text
    calls are split: tests/test_sequence_parallel_vision.py)."""
    import types

    from padfree_plugins import ConfigError, load_config
    from padfree_plugins.integrations.trl_dpo import DPOTrainerPatch

    trainer = type("DPOTrainer", (), dict(state))()
    assembly = types.SimpleNamespace(config=load_config({"task": "causal_lm", "sequence_parallel": {"size": 2}}))
    with pytest.raises(ConfigError, match=match):
        DPOTrainerPatch(trainer, assembly).check()
