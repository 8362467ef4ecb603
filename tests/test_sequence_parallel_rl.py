"""TRL ``GRPOTrainer`` (two iterations, ``beta`` 0.1), ``RLOOTrainer`` (``beta`` 0.1), ``KTOTrainer`` (with its KL
completions) and ``RewardTrainer`` under ``sequence_parallel: {size: 2}`` on 2 CPU processes (gloo; the worker is
tests/sequence_parallel_rl_run.py, every run in one torchrun launch with a timeout), on a tiny Qwen3 (a sequence
classifier for the RewardTrainer).

Each rank trains its own micro-batches, as under data parallelism; every fused log-probability call — the policy's, the
old policy's (GRPO's second iteration), the reference model's, KTO's KL completions — packs its rows, the group joins
them into one row and each rank computes half of it, then keeps its own examples' per-token outputs. The
RewardTrainer's base model runs on the rank's half of the joined row, each rank's own texts' last hidden states come
from the halves that computed them (the gradient flows back to each half's owner) and each rank scores its own texts
with the head. TRL's generation (unsliced, per rank), advantages and loss code run unchanged. The reference is TRL's
own run, not accelerated (padded rows), on the same 2 processes: the same global batch, the same sampled completions
(asserted). Losses, every parameter's gradient at every step and the final weights agree within 1e-5 (SGD, no
clipping); the faults (no gather of the per-token outputs; the texts scored from the rank's own half alone) are far
off. Bad input is refused at ``accelerate()``, nothing changed. After training, KTO's and the RewardTrainer's
``evaluate()`` / ``predict()`` with ``compute_metrics`` equal TRL's run's; a fault at prediction is far off.
"""

from __future__ import annotations

import pytest

from tests.distributed_common import OUT, launch, launch_shared, run_differences

pytest.importorskip("trl")

TOLERANCE = 1e-5
KINDS = ("grpo", "rloo", "kto", "reward")
RUNS = ("grpo-sp", "grpo-padded", "grpo-no-gather", "rloo-sp", "rloo-padded", "kto-sp", "kto-padded",
        "kto-first-range", "reward-sp", "reward-padded", "reward-no-gather")
#: Split fused calls per rank over the 2 steps. GRPO: the old policy's and the reference model's (once: the second
#: iteration reuses the generation) and the policy's at each step. RLOO (one iteration: a generation each step): at
#: each step the old policy's (RLOO computes it always), the reference model's and the policy's.
#: KTO: at each step the policy's and the reference model's, each on the completions and on the KL completions.
#: Reward: the reward model's at each step.
SPLIT_CALLS = {"grpo": 4, "rloo": 6, "kto": 8, "reward": 2}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """Every run of the worker, in one 2-process launch (once per session)."""
    return launch_shared(request, tmp_path_factory, "sequence_parallel_rl_run.py", ",".join(RUNS), OUT, timeout=300)


def differences(run: dict, want: dict) -> tuple[float, float, float]:
    """Largest loss, gradient (any parameter, any step) and final-weight differences between two runs."""
    from tests.sequence_parallel_rl_run import STEPS

    return run_differences(run, want, STEPS)


@pytest.mark.parametrize("kind", KINDS)
def test_rl_and_kto_under_sequence_parallelism_equal_trls_run(launched, kind):
    run, want = launched[f"{kind}-sp"], launched[f"{kind}-padded"]
    assert run["completions"] == want["completions"]  # GRPO / RLOO: the same samples scored on each rank
    if kind in ("grpo", "rloo"):
        assert run["completions"][0] and run["completions"][0] != run["completions"][1]  # ranks: their own batches
    loss, grad, weight = differences(run, want)
    print(f"{kind} sp2: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert loss < TOLERANCE and grad < TOLERANCE and weight < TOLERANCE
    # what is compared is far from zero: the gradients are large and the weights move
    assert max(g.abs().max().item() for step in want["grads"] for g in step.values()) > 1e4 * TOLERANCE
    assert max((want["state"][k] - want["initial"][k]).abs().max().item()
               for k in want["state"]) > 100 * TOLERANCE
    # every fused call split, the same calls on both ranks, each half the joined row, an example across every cut
    seen = run["seen"]
    assert len(seen[0]) == len(seen[1]) == SPLIT_CALLS[kind]
    assert seen[0] == seen[1] and all(local == -(-joined // 2) for joined, local in seen[0])
    assert all(all(rank) for rank in run["cuts"])


#: What ``evaluate()`` and ``predict()`` report and the test compares (without the ``eval_`` / ``test_`` prefix): the
#: loss and the ``compute_metrics`` values (tests/distributed_common.py); and, from ``evaluate()``, TRL's own metrics
#: (continuous; both runs gather them over the same 2 ranks).
EVAL_KEYS = {"kto": ("loss", "nll", "rows"), "reward": ("loss", "mean_score", "square_score", "texts")}
TRL_EVAL_KEYS = {"kto": ("kl", "entropy", "num_tokens", "rewards/chosen", "rewards/rejected", "rewards/margins",
                         "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"),
                 "reward": ("mean_reward", "min_reward", "max_reward", "margin")}


@pytest.mark.parametrize("kind", ["kto", "reward"])
def test_kto_and_reward_evaluate_and_predict_under_sequence_parallelism_equal_trls_run(launched, kind):
    """After training, ``evaluate()`` and ``predict()`` with ``compute_metrics`` (3 rows a rank, split across the
    group: a completion's labelled tokens, or a text, across every cut) equal TRL's own run evaluating the same rows on
    the same ranks: the loss, TRL's metrics, the ``compute_metrics`` values and the predictions (KTO: the padded logits
    of TRL's extra forward, which runs on each rank's own rows; reward: every text's score, each rank scoring its own
    texts from the slices that computed them). Predicting once more under a fault (KTO: each rank keeping the joined
    row's first tokens; reward: texts scored from the rank's own slice alone) is far off."""
    from tests.distributed_common import evaluation_differences

    run, want = launched[f"{kind}-sp"]["evaluation"], launched[f"{kind}-padded"]["evaluation"]
    assert len(run["cuts"]) == (4 if kind == "kto" else 1) * 3 and all(run["cuts"]), run["cuts"]
    metrics, predictions = evaluation_differences(run, want, EVAL_KEYS[kind], TRL_EVAL_KEYS[kind])
    print(f"{kind} sp2 evaluation: max metric difference {metrics:.2e}, predictions {predictions:.2e}")
    assert metrics < TOLERANCE and predictions < TOLERANCE
    faulty = run["faulty"]
    loss = abs(faulty["metrics"]["test_loss"] - want["metrics"]["test_loss"])
    scores = (faulty["predictions"] - want["predictions"]).abs().max().item() if kind == "reward" else 0.0
    print(f"{kind} sp2 evaluation under a fault: loss difference {loss:.2e}, predictions {scores:.2e}")
    assert loss > 100 * TOLERANCE
    if kind == "reward":  # the scores themselves are what the fault breaks
        assert scores > 100 * TOLERANCE


@pytest.mark.parametrize("run", ["grpo-no-gather", "kto-first-range", "reward-no-gather"])
def test_sequence_parallel_rl_faults_are_caught(launched, run):
    """Each rank reading only its slice's per-token outputs (no gather), keeping the joined row's first tokens
    rather than its own, or scoring its texts from its own slice's hidden states only (zeros elsewhere), is far from
    TRL's run."""
    kind = run.split("-")[0]
    loss, grad, weight = differences(launched[run], launched[f"{kind}-padded"])
    print(f"{run}: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert max(loss, grad, weight) > 100 * TOLERANCE and grad > 100 * TOLERANCE


# -- one process: what sequence parallelism refuses, at accelerate(), nothing changed -----------------------------


def rl_trainer(kind: str, tmp_path):
    import copy

    import trl

    from tests import test_trl_rl
    from tests.test_trainer import tokenizer
    from tests.test_trl_preference import policy, unpaired

    if kind != "kto":
        return test_trl_rl.build(kind, str(tmp_path), max_steps=1)
    model = policy()
    args = trl.KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")
    return trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args, train_dataset=unpaired(8),
                          processing_class=copy.deepcopy(tokenizer()))


@pytest.mark.parametrize("kind, state, match", [
    ("grpo", {"aux_loss_enabled": True}, r"GRPOTrainer with the MoE router aux loss under sequence parallelism "
                                         r"\(sequence_parallel.size: 2\).*router_aux_loss_coef=0.0"),
    ("kto", {"aux_loss_enabled": True}, r"KTOTrainer with the MoE router aux loss under sequence parallelism"),
])
def test_what_sequence_parallel_rl_cannot_do_is_refused(monkeypatch, tmp_path, kind, state, match):
    from padfree_plugins import ConfigError, accelerate, patch_of
    from padfree_plugins.integrations.trl_fused import fused_forward_of
    from padfree_plugins.modeling.attention.ulysses import SequenceGroup

    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))
    trainer = rl_trainer(kind, tmp_path)
    for name, value in state.items():
        setattr(trainer, name, value)
    forward = fused_forward_of(trainer.model)
    with pytest.raises(ConfigError, match=match):
        accelerate(trainer, {"task": "causal_lm", "sequence_parallel": {"size": 2}})
    assert patch_of(trainer.model) is None and fused_forward_of(trainer.model) == forward
    assert "log" not in vars(trainer) and "get_train_dataloader" not in vars(trainer)


# -- SP = 2 x DP = 2: 4 processes, two groups ------------------------------------------------------------------------


def test_grpo_under_sequence_and_data_parallelism_equals_trls_run(tmp_path):
    """GRPO at SP = 2 x DP = 2 on 4 processes (ranks 0, 1 and 2, 3 each a group; every rank its own prompts and
    completions) against TRL's own 4-process run: the same sampled completions (asserted), losses, every gradient at
    every step and the final weights within 1e-5; each group split every fused call of its own row; the fault
    ``no-gather`` still fails the comparison."""
    out = tmp_path / "runs.pt"
    launched = launch("sequence_parallel_rl_run.py", "grpo-sp,grpo-padded,grpo-no-gather", str(out),
                      out=out, processes=4, timeout=300)
    run, want = launched["grpo-sp"], launched["grpo-padded"]
    assert run["completions"] == want["completions"] and len(run["completions"]) == 4
    assert len({repr(scored) for scored in run["completions"]}) == 4  # every rank scored its own completions
    loss, grad, weight = differences(run, want)
    print(f"grpo sp2 x dp2: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert loss < TOLERANCE and grad < TOLERANCE and weight < TOLERANCE
    assert max(g.abs().max().item() for step in want["grads"] for g in step.values()) > 1e4 * TOLERANCE
    # each group joined its own two ranks' rows (not the other group's), each rank half of it, examples across the cut
    seen = run["seen"]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    assert all(len(rank) == SPLIT_CALLS["grpo"] and all(local == -(-joined // 2) for joined, local in rank)
               for rank in seen)
    assert all(all(rank) for rank in run["cuts"])
    loss, grad, weight = differences(launched["grpo-no-gather"], want)
    print(f"grpo-no-gather sp2 x dp2: max loss difference {loss:.2e}, gradients {grad:.2e}, weights {weight:.2e}")
    assert grad > 100 * TOLERANCE
