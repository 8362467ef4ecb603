"""Sequence parallelism (``sequence_parallel: {size: 2}``) through the trainers and the plain loop, on 2 CPU processes
(gloo): each rank loads its own micro-batch, the group trains their joined row, each rank computing half of it.

One launch (tests/sequence_parallel_trainer_run.py) trains HF ``Trainer`` (gradient checkpointing; gradient
accumulation 2; accelerate's ``split_batches=True``, each global batch split across the ranks; a tiny Qwen3-MoE
with its router aux loss, split batches, so that the group's row is the one process's batch), TRL ``SFTTrainer``
(accumulation 2 and checkpointing) and examples/accelerate_loop.py's loop; each
equals one process on the same global batches (both ranks' micro-batches of a step), to 1e-5: the logged losses
(the trainer logs the mean over ranks of ``2 x slice losses / global label count``: the one-process loss), the final
weights and the loss-only ``eval_loss``. The same launch runs HF ``Trainer.predict`` / ``evaluate`` with
``compute_metrics``: the padded logits, labels and metrics equal one process's (and, in a launch of its own on 4
processes, at SP = 2 x DP = 2). Refusals (trainer untouched) are
checked in one process, with the sequence-parallel group faked (no collective runs before the refusal).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import types

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments

from padfree_plugins import ConfigError, PadfreeError, accelerate, load_config, patch_of
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from tests.sequence_parallel_trainer_run import CASES, EVAL_BATCH, PREDICT_ROWS, SP_CONFIG, SPLIT_BATCH, \
    TRAINER_CONFIG, make_model, make_trainer, predict_trainer, predicted, rows, sft_predicted, trainer_result
from tests.shared_launch import launch_once, selected
from tests.test_distributed import ROOT, free_port, load_example, reference_training, run_group
from tests.test_sequence_parallel import record_pick_gaps
from tests.ties import assert_clear

trl = pytest.importorskip("trl")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """Every case of the worker, in one 2-process launch (once per session: tests/shared_launch.py)."""
    def run(out, _):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(ROOT / "tests" / "sequence_parallel_trainer_run.py"), str(out), *CASES,
                   "loop", "predict"]
        return run_group(command, env, timeout=300, results=[out])

    returncode, output, runs = launch_once(request, tmp_path_factory, "launched", [], run,
                                           lambda out: torch.load(out, weights_only=False))
    assert returncode == 0, output[-6000:]
    return runs


@functools.lru_cache(maxsize=2)
def initial_weights(case: str = "loop") -> dict:
    model = load_example().tiny_llama() if case == "loop" else make_model(case)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def differences(run: dict, want: dict, case: str = "loop") -> tuple[float, float]:
    assert len(run["losses"]) == len(want["losses"]) >= 3
    assert run["state"].keys() == want["state"].keys()
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    moved = max((want["state"][k] - initial_weights(case)[k]).abs().max().item() for k in want["state"])
    assert moved > 100 * TOLERANCE  # the weights moved far more than the tolerance: the comparison has teeth
    return loss, weight


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_under_sequence_parallelism_equals_one_process(launched, case):
    run = launched[case]
    trainer, _ = make_trainer(case, tempfile.mkdtemp(), TRAINER_CONFIG, ranks=2)
    gaps: list = []
    hooks = [module.register_forward_hook(functools.partial(record_pick_gaps, gaps, trainer.model.config))
             for module in trainer.model.modules() if type(module).__name__.endswith("TopKRouter")]
    trainer.train()
    for hook in hooks:
        hook.remove()
    if CASES[case].get("model") == "moe":  # the load-balancing loss counts expert picks: none near a tie
        assert_clear(torch.cat(gaps), "router top-k gaps")
    want = trainer_result(trainer)
    loss, weight = differences(run, want, case)
    evaluation = abs(run["eval_loss"] - want["eval_loss"])
    print(f"{case}: max loss difference {loss:.2e}, max weight difference {weight:.2e}, eval_loss {evaluation:.2e}")
    assert loss < TOLERANCE and weight < TOLERANCE and evaluation < TOLERANCE
    assert run["num_tokens"] == want["num_tokens"]  # SFT: every rank's own tokens, gathered (empty for HF)
    # each rank computed half of the group's row (both ranks' micro-batches, padded to even) at every forward
    embedded = [seen["embedded"] for seen in run["seen"]]
    own = list(zip(*(seen["micro_batches"] for seen in run["seen"])))
    assert embedded[0] == embedded[1] == [-(-sum(sizes) // 2) for sizes in own] and len(own) >= 3
    if CASES[case]["strategy"] == "examples":  # the cut falls inside a rank's micro-batch, not between them
        assert any(a != b for a, b in own), own
    # split_batches=True is accepted: each rank trained half of every global batch (not all of it, which would give
    # the same loss on duplicated examples), and the group's row is the one process's batch
    split = [seen["examples"] for seen in run["seen"]]
    assert run["split_batches"] == CASES[case].get("split_batches", False)
    assert (run["split_mixers"] > 0) == (CASES[case].get("model") == "hybrid")  # each rank ran its slice's mixers
    if run["split_batches"]:
        assert split[0] == split[1] == [SPLIT_BATCH // 2] * len(own), split
    if CASES[case]["kind"] == "hf":  # the LM head on the slice's labelled positions only (recomputed on the slice)
        assert run["labelled_logits"]
        projected = [seen["projected"] for seen in run["seen"]]
        assert all(0 < p <= e for rank in (0, 1) for p, e in zip(projected[rank], embedded[rank]))
        assert sum(map(sum, projected)) < sum(map(sum, embedded))
    else:  # without num_items_in_batch the loss is the mean over the group's row
        uncounted = run["uncounted"]
        batch = trainer._prepare_inputs(trainer.data_collator(uncounted["examples"]))
        with torch.no_grad():
            joined = trainer.compute_loss(trainer.model, batch).item()
        assert abs(uncounted["loss"] - joined) < TOLERANCE, (uncounted["loss"], joined)


def test_plain_loop_under_sequence_parallelism_equals_one_process(launched):
    """examples/accelerate_loop.py (the loss over the global label count, times the number of processes) with
    ``sequence_parallel.size: 2``: the loss curve, tokens per rank and final weights of one process."""
    run, want = launched["loop"], reference_training(ranks=2)
    assert run["tokens"] == want["tokens"]  # rank r loaded micro-batch s*2 + r of the shared plan
    loss, weight = differences(run, want)
    print(f"loop: max loss difference {loss:.2e}, max weight difference {weight:.2e}")
    assert loss < TOLERANCE and weight < TOLERANCE


def one_process_prediction(ranks: int) -> dict:
    """:func:`predicted` of one process whose evaluation batches hold the ``ranks`` ranks' micro-batches."""
    trainer = predict_trainer(ranks=ranks)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    want = predicted(trainer)
    acceleration.undo()
    return want


def logits_difference(predictions: torch.Tensor, want: torch.Tensor) -> float:
    """The largest logits difference over each example's own tokens (past them: padding)."""
    lengths = [len(row["input_ids"]) for row in rows(PREDICT_ROWS, 3)]
    return max((predictions[i, :n] - want[i, :n]).abs().max().item() for i, n in enumerate(lengths))


def assert_same_prediction(run: dict, want: dict, what: str) -> None:
    """``predict``'s padded logits and labels and the metrics of ``predict`` and ``evaluate`` equal; every example
    counted once."""
    assert run["predictions"].shape == want["predictions"].shape and run["predictions"].shape[0] == PREDICT_ROWS
    assert torch.equal(run["label_ids"], want["label_ids"])
    for got, reference in ((run["metrics"], want["metrics"]), (run["evaluate"], want["evaluate"])):
        prefix = "test" if "test_nll" in reference else "eval"
        assert got[f"{prefix}_examples"] == reference[f"{prefix}_examples"] == PREDICT_ROWS  # none counted twice
        assert got[f"{prefix}_labelled"] == reference[f"{prefix}_labelled"]
        for name in ("nll", "loss"):
            assert abs(got[f"{prefix}_{name}"] - reference[f"{prefix}_{name}"]) < TOLERANCE, (name, got, reference)
    logits = logits_difference(run["predictions"], want["predictions"])
    print(f"{what}: max logits difference {logits:.2e}")
    assert logits < TOLERANCE


def test_predict_and_compute_metrics_under_sequence_parallelism_equal_one_process(launched):
    """``predict`` / ``evaluate`` with ``compute_metrics`` on 2 ranks of one group: each rank's own examples' logits,
    gathered from the group's slices, re-padded as one process pads them; every example counted once."""
    run, want = launched["predict"], one_process_prediction(ranks=2)
    # the group's first row (2 micro-batches of EVAL_BATCH examples) is cut inside an example, not between ranks
    first = [len(row["input_ids"]) for row in rows(PREDICT_ROWS, 3)][:2 * EVAL_BATCH]
    cut = -(-sum(first) // 2)
    assert cut not in {sum(first[:i]) for i in range(len(first) + 1)}, (first, cut)
    assert_same_prediction(run, want, "predict")
    # the deliberate fault (the group's slices joined in the wrong order) is told apart, by logits and by metrics
    faulty = run["faulty"]
    assert logits_difference(faulty["predictions"], want["predictions"]) > 100 * TOLERANCE
    assert abs(faulty["metrics"]["test_nll"] - want["metrics"]["test_nll"]) > 100 * TOLERANCE
    # an output that is not per token (hidden_states: a tuple) is refused, saying what to do; predict works after it
    assert run["refused"] is not None and run["refused"].startswith("PadfreeError: sequence_parallel.size: 2: the "
                                                                    "model output 'hidden_states'")
    assert "ignore_keys=['hidden_states']" in run["refused"]
    assert abs(run["after_refusal"]["test_nll"] - want["metrics"]["test_nll"]) < TOLERANCE
    # TRL's SFTTrainer (HF Trainer's prediction_step, TRL's loss and a second forward for the logits)
    sft, want = run["sft"], sft_predicted(ranks=2)
    assert torch.equal(sft["label_ids"], want["label_ids"]) and sft["predictions"].shape == want["predictions"].shape
    real = sft["label_ids"] != -100  # (past the labelled tokens: a prompt's or padding's logits)
    sft_logits = (sft["predictions"] - want["predictions"])[real].abs().max().item()
    print(f"sft predict: max logits difference {sft_logits:.2e}")
    assert sft_logits < TOLERANCE and sft["metrics"]["test_examples"] == want["metrics"]["test_examples"] == 8
    for name in ("test_nll", "test_loss"):
        assert abs(sft["metrics"][name] - want["metrics"][name]) < TOLERANCE, (name, sft["metrics"], want["metrics"])
    assert abs(sft["evaluate"]["eval_nll"] - want["evaluate"]["eval_nll"]) < TOLERANCE


#: The tests of the 4-process launch and their cases.
FOUR_PROCESSES = {"test_predict_under_sequence_and_data_parallelism_equals_one_process": "predict-dp",
                  "test_trainer_at_sp4_on_two_kv_heads_equals_one_process": "hf-sp4-kv2"}


def four_processes(request, tmp_path_factory, case: str) -> dict:
    """``case``'s result, from one 4-process launch running every case of :data:`FOUR_PROCESSES` this session
    selected (once per session: tests/shared_launch.py)."""
    cases = selected(request, lambda item: FOUR_PROCESSES.get(item.originalname))
    assert case in cases

    def run(out, cases):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                   str(free_port()), str(ROOT / "tests" / "sequence_parallel_trainer_run.py"), str(out), *cases]
        return run_group(command, env, timeout=180 + 120 * len(cases), results=[out])

    returncode, output, runs = launch_once(request, tmp_path_factory, "four", cases, run,
                                           lambda out: torch.load(out, weights_only=False))
    assert returncode == 0 and runs is not None, output[-6000:]
    return runs[case]


def test_predict_under_sequence_and_data_parallelism_equals_one_process(request, tmp_path_factory):
    """SP = 2 x DP = 2 on 4 processes: each group joins its 2 ranks' micro-batches; the trainer's gather over all 4
    processes gets every example once, as one process evaluating the 4 ranks' micro-batches together."""
    run = four_processes(request, tmp_path_factory, "predict-dp")
    assert_same_prediction(run, one_process_prediction(ranks=4), "predict (SP 2 x DP 2)")


def test_trainer_at_sp4_on_two_kv_heads_equals_one_process(request, tmp_path_factory):
    """HF ``Trainer`` with ``sequence_parallel: {size: 4}`` on 4 processes, a Llama of 6 attention heads and 2 key /
    value heads, which Ulysses cannot split 4 ways: ``auto`` runs Ulysses within 2 blocks of 2 ranks and all-gather
    context parallelism across them (its causal work balanced by zigzag), and the logged
    losses, final weights and ``eval_loss`` equal one process on the same global batches; each rank computed a
    quarter of every row."""
    case = "hf-sp4-kv2"
    run = four_processes(request, tmp_path_factory, case)
    assert run["implementation"].endswith("_sp4_ulysses2x2_zigzag"), run["implementation"]
    trainer, _ = make_trainer(case, tempfile.mkdtemp(), TRAINER_CONFIG, ranks=4)
    trainer.train()
    want = trainer_result(trainer)
    loss, weight = differences(run, want, case)
    evaluation = abs(run["eval_loss"] - want["eval_loss"])
    print(f"{case}: max loss difference {loss:.2e}, max weight difference {weight:.2e}, eval_loss {evaluation:.2e}")
    assert loss < TOLERANCE and weight < TOLERANCE and evaluation < TOLERANCE
    embedded = [seen["embedded"] for seen in run["seen"]]
    own = list(zip(*(seen["micro_batches"] for seen in run["seen"])))
    assert all(e == embedded[0] for e in embedded) and embedded[0] == [-(-sum(sizes) // 4) for sizes in own]


# -- refusals (one process: the group of 2 faked; each refusal comes before any collective) ------------------------


@pytest.fixture
def fake_group(monkeypatch):
    """``assemble`` under ``sequence_parallel.size: N`` in one process: this rank is rank 0 of a group of N."""
    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))


def hf_trainer(args: dict | None = None, **overrides) -> Trainer:
    """An HF Trainer on the tiny Llama, with ``args`` for its TrainingArguments and ``overrides`` for itself."""
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, disable_tqdm=True,
                             **(args or {}))
    return Trainer(model=load_example().tiny_llama(), args=args, train_dataset=datasets.Dataset.from_list(rows(8, 0)),
                   eval_dataset=datasets.Dataset.from_list(rows(4, 1)), **overrides)


def assert_refused(trainer, error, match: str, config=SP_CONFIG) -> None:
    collator = trainer.data_collator
    with pytest.raises(error, match=match):
        accelerate(trainer, config)
    assert patch_of(trainer.model) is None and trainer.data_collator is collator
    assert "compute_loss" not in vars(trainer) and "prediction_step" not in vars(trainer)


@pytest.mark.parametrize("args, overrides, match", [
    ({"average_tokens_across_devices": False}, {}, r"average_tokens_across_devices=False.*Set "
                                                   r"average_tokens_across_devices=True"),
    ({"neftune_noise_alpha": 5.0}, {}, r"neftune_noise_alpha.*Train without NEFTune"),
    ({"label_smoothing_factor": 0.1}, {}, r"label smoothing or a compute_loss_func"),
])
def test_what_sequence_parallel_trainers_cannot_do_is_refused(fake_group, args, overrides, match):
    assert_refused(hf_trainer(args=args, **overrides), PadfreeError, f"sequence_parallel.size: 2.*{match}")


def test_a_sequence_classifier_under_hf_trainer_is_accepted_but_not_a_loss_from_its_logits(fake_group):
    """An HF Trainer with task: seq_cls trains under sequence parallelism (each rank scores its own examples:
    tests/test_sequence_parallel_pooled.py); label smoothing is still refused there, nothing changed."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    data = [{**row, "labels": i % 2} for i, row in enumerate(rows(8, 0))]

    def trainer(**arguments):
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, disable_tqdm=True,
                                 **arguments)
        return Trainer(model=LlamaForSequenceClassification(config), args=args,
                       train_dataset=datasets.Dataset.from_list(data))

    accepted = trainer()
    acceleration = accelerate(accepted, {**SP_CONFIG, "task": "seq_cls"})
    assert getattr(acceleration.assembly.forward, "pools_examples", False) and "compute_loss" in vars(accepted)
    acceleration.undo()
    assert_refused(trainer(label_smoothing_factor=0.1), PadfreeError,
                   r"sequence_parallel.size: 2 with label smoothing or a compute_loss_func",
                   config={**SP_CONFIG, "task": "seq_cls"})


def test_compute_metrics_is_refused_only_where_evaluation_does_not_gather_the_logits(fake_group):
    """HF ``Trainer`` (and TRL's ``SFTTrainer``, its plugin's subclass) gathers the group's logits for
    ``compute_metrics``: accepted. A trainer plugin that does not say it hands each rank its own examples' outputs
    (``gathers_logits`` off: a third party's) is refused, saying why."""
    from padfree_plugins.integrations.checks import check_sequence_parallel

    trainer = hf_trainer(compute_metrics=lambda prediction: {})
    acceleration = accelerate(trainer, SP_CONFIG)
    assert "prediction_step" in vars(trainer)
    acceleration.undo()
    with pytest.raises(ConfigError, match=r"sequence_parallel.size: 2 with compute_metrics: Trainer's trainer plugin "
                                          r"does not hand evaluation each rank's own examples' outputs.*gathers_logits "
                                          r"is off.*Evaluate the loss alone"):
        check_sequence_parallel(trainer, load_config(SP_CONFIG))
    check_sequence_parallel(trainer, load_config(SP_CONFIG), gathers_logits=True)


def test_a_trainer_without_sequence_parallel_support_is_refused(fake_group):
    """A Trainer subclass with its own compute_loss (plugin any_trainer: its padded batches) is not split."""
    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = hf_trainer()
    trainer.__class__ = OwnLoss
    with pytest.raises(ConfigError, match=r"OwnLoss is not yet supported under sequence parallelism.*any_trainer"):
        accelerate(trainer, SP_CONFIG)
    assert patch_of(trainer.model) is None and "prediction_step" not in vars(trainer)


def trl_like(name: str, module: str, methods: tuple[str, ...] = ("compute_loss", "prediction_step")) -> object:
    """An object of a class named ``name`` from a ``trl`` module with ``methods`` (what the TRL plugins claim by),
    and the trainer state the refusals read."""
    def method(self, *args, **kwargs):
        raise AssertionError("the refusal comes first")

    cls = type(name, (), {"__module__": module, **{name_: method for name_ in methods}})
    trainer = cls()
    trainer.args = types.SimpleNamespace(n_gpu=1, average_tokens_across_devices=True)
    trainer.accelerator = types.SimpleNamespace(parallelism_config=None)
    return trainer


@pytest.mark.parametrize("module, plugin", [("trl_dpo", "DPOTrainerPatch"), ("trl_kto", "KTOTrainerPatch"),
                                            ("trl_grpo", "GRPOTrainerPatch"), ("trl_rloo", "RLOOTrainerPatch")])
def test_trl_compute_metrics_passes_the_sequence_parallel_checks(module, plugin):
    """TRL's DPO and KTO hand ``compute_metrics`` the logits of their extra forward without the fused head, TRL's own
    padded forward of each rank's own batch (never split); GRPO and RLOO hand it nothing: under sequence parallelism
    each rank's evaluation is its own examples', as one process's (tests/test_sequence_parallel_trl.py and
    tests/test_sequence_parallel_rl.py compare them). The plugin gets past every sequence-parallel check to the model
    check, which this stand-in trainer (no model) fails."""
    import importlib

    cls = getattr(importlib.import_module(f"padfree_plugins.integrations.{module}"), plugin)
    trainer = trl_like(cls.trainer_class, f"trl.trainer.{cls.kind}_trainer", cls.kept_methods)
    trainer.compute_metrics, trainer.model = (lambda prediction: {}), None
    assembly = types.SimpleNamespace(config=load_config(SP_CONFIG))
    with pytest.raises(PadfreeError, match="the assembly was built for another model"):
        cls.wrap(trainer, assembly)
    assert cls.metrics_forward == (cls.kind in ("dpo", "kto"))  # said in a warning (tests/test_sequence_parallel_trl.py)


def test_reward_compute_metrics_passes_the_sequence_parallel_checks():
    """A RewardTrainer's evaluation scores each rank's own texts (tests/test_sequence_parallel_rl.py compares them with
    TRL's run): its ``compute_metrics`` passes the check of its task hook."""
    from padfree_plugins.integrations.trl_reward import trainer_config

    trainer = trl_like("RewardTrainer", "trl.trainer.reward_trainer")
    trainer.compute_metrics = lambda prediction: {}
    assert trainer_config(trainer, load_config(SP_CONFIG)).task == "seq_cls"


# TRL DPO, GRPO, RLOO, KTO and RewardTrainer train sequence-parallel: tests/test_sequence_parallel_trl.py and
# tests/test_sequence_parallel_rl.py (what they still refuse there too)


@pytest.mark.parametrize("cp, sp, match", [
    (False, True, r"sp_backend=deepspeed \(ALST\) shards \[batch, length\] tensors.*cu_seq_lens.*padfree.yaml "
                  r"sequence_parallel: \{size: N\} instead"),
    (True, False, r"cp_size > 1\): torch context parallel is broken with packed sequences upstream"),
])
def test_accelerates_sequence_and_context_parallelism_are_refused(monkeypatch, cp, sp, match):
    trainer = hf_trainer()
    split = types.SimpleNamespace(cp_enabled=cp, sp_enabled=sp)
    monkeypatch.setattr(type(trainer.accelerator), "parallelism_config", property(lambda self: split))
    assert_refused(trainer, PadfreeError, match, config=TRAINER_CONFIG)


def test_sft_with_the_router_aux_loss_is_refused(fake_group):
    """TRL adds the MoE load-balancing term itself, after the rank scaling: not yet each rank's share of the group's
    row (the model's loss carries the share: tests/test_sequence_parallel.py), so SFTTrainer refuses it, untouched."""
    from padfree_plugins.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=280)
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, bf16=False,
                         disable_tqdm=True)
    trainer = trl.SFTTrainer(model=load_example().tiny_llama(), args=args,
                             train_dataset=datasets.Dataset.from_list(rows(8, 0)), processing_class=tokenizer)
    trainer.aux_loss_enabled = True  # what TRL sets for an MoE model with output_router_logits
    assert_refused(trainer, ConfigError, r"SFTTrainer with the MoE router aux loss under sequence parallelism "
                                         r"\(sequence_parallel.size: 2\).*router_aux_loss_coef=0.0")
