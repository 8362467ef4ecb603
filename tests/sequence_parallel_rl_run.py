"""Worker of tests/test_sequence_parallel_rl.py: TRL ``GRPOTrainer``, ``RLOOTrainer``, ``KTOTrainer`` and
``RewardTrainer`` on a tiny Qwen3 (a sequence classifier for the RewardTrainer), on 2 CPU processes (gloo), each
trained in one launch under ``sequence_parallel: {size: 2}`` and as TRL's own run (not accelerated) on the same
per-rank batches.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_rl_run.py \
        RUN[,RUN...] OUT

On 4 processes the runs train at SP = 2 x DP = 2 (two groups of 2 ranks, each rank its own micro-batches, as TRL's own
4-process run, the reference).

A run is ``KIND-MODE``: ``KIND`` one of :data:`KINDS`, ``MODE`` ``sp`` (size 2), ``padded``
(TRL's own run, not accelerated: the reference) or a fault (size 2): ``no-gather`` (each rank reads its own slice's
per-token outputs only, zeros at the other rank's tokens; for ``reward``: each rank pools its texts from its own
slice's hidden states only), ``first-range`` (each rank keeps the joined row's first
tokens, not its own range).
Rank 0 writes ``{run: {"losses", "grads", "initial", "state", "completions", "seen", "cuts"}}`` to ``OUT`` (torch.save):
``grads`` every parameter's gradient at each optimizer step (after the data-parallel all-reduce), ``completions``
per rank the completion ids each reward call scored (GRPO / RLOO), ``seen`` per rank per split fused call (the
joined row's tokens, the slice's), ``cuts`` per rank per split call whether an example crosses the cut.
``kto-sp``, ``reward-sp`` and their ``padded`` runs then evaluate (``evaluation``: ``evaluate()`` and ``predict()``
with ``compute_metrics``, :data:`EVAL_BATCH` rows a rank; its ``cuts``: per split call of rank 0, whether a text, or a
completion's labelled tokens, cross the cut), the ``sp`` runs predicting once more under :data:`EVALUATION_FAULTS`.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile

import torch
import torch.distributed as dist

from padfree_plugins.integrations import trl_fused
from padfree_plugins.modeling import sequence_parallel
from padfree_plugins.packing.batch import packed_tokens
from padfree_plugins.testing.faults import pooling_reads_local_slice
from tests.distributed_common import chosen_runs, evaluated, finish, leave, score_metrics, token_metrics

STEPS = 2
#: The evaluation of ``kto-sp`` / ``reward-sp`` and their ``padded`` runs: one batch of 3 rows a rank.
EVAL_BATCH = 3
KINDS = ("grpo", "rloo", "kto", "reward")
MODES = ("sp", "padded", "no-gather", "first-range")


def tokenizer():
    from tests.test_trainer import tokenizer as base

    tok = copy.deepcopy(base())
    tok.padding_side = "left"
    return tok


def qwen3_dir(tok) -> str:
    """A tiny Qwen3 saved to a directory (GRPO / RLOO load their reference model from ``_name_or_path``), its EOS row
    scaled so that completions end after a few tokens (completions of many lengths). Saved by rank 0, for every
    rank (transformers writes a checkpoint from the main process only)."""
    path = [None]
    if dist.get_rank() == 0:
        model = testing_qwen3(len(tok))
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] *= 40
        path = [tempfile.mkdtemp(prefix="padfree-sp-rl-")]
        model.save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def build(kind: str, output_dir: str, scored: list):
    """The trainer of ``kind`` (SGD at a high rate, no clipping: the weights move far beyond 1e-5); GRPO's and RLOO's
    reward (longer completions are better) appends the completion ids it scores to ``scored``."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    from tests.test_trl_preference import unpaired

    tok = tokenizer()
    common = dict(output_dir=output_dir, max_steps=STEPS, learning_rate=0.05, optim="sgd",
                  lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, beta=0.1,
                  save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True)
    torch.manual_seed(0)
    if kind == "reward":
        from tests.test_reward import preference_rows

        model = testing_qwen3(len(tok), "seq_cls", num_labels=1, initializer_range=0.1,
                              pad_token_id=tok.pad_token_id)
        reward_args = {k: v for k, v in common.items() if k != "beta"}
        args = trl.RewardConfig(per_device_train_batch_size=3, dataloader_pin_memory=False,
                                per_device_eval_batch_size=EVAL_BATCH, **reward_args)
        return trl.RewardTrainer(model=model, args=args, processing_class=tok,
                                 train_dataset=datasets.Dataset.from_list(preference_rows(2 * 3 * STEPS, 0)),
                                 eval_dataset=datasets.Dataset.from_list(preference_rows(2 * EVAL_BATCH, 1)),
                                 compute_metrics=score_metrics)
    if kind == "kto":
        model = testing_qwen3(len(tok))
        args = trl.KTOConfig(per_device_train_batch_size=3, per_device_eval_batch_size=EVAL_BATCH, **common)
        rows = 4 * 3 * STEPS  # the evaluation's rows come after the training's
        evaluation = unpaired(rows + 2 * EVAL_BATCH).select(range(rows, rows + 2 * EVAL_BATCH))
        return trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                              train_dataset=unpaired(4 * 3 * STEPS), eval_dataset=evaluation, processing_class=tok,
                              compute_metrics=token_metrics)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir(tok))

    def length_reward(completions: list[str], completion_ids: list, **kwargs) -> list[float]:
        scored.append([tuple(ids) for ids in completion_ids])
        return [len(text) / 10 for text in completions]

    words = "a tiny corpus for the tokenizer".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + 3 * i)) for i in range(8)]
    data = datasets.Dataset.from_list([{"prompt": text} for text in texts])
    if kind == "grpo":
        args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                              num_iterations=2, **common)
        return trl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data,
                               processing_class=tok)
    args = trl.RLOOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, **common)
    return trl.RLOOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data,
                           processing_class=tok)


def testing_qwen3(vocab_size: int, task: str = "causal_lm", **overrides):
    from padfree_plugins import testing

    return testing.tiny_model("qwen3", task, num_key_value_heads=2, vocab_size=vocab_size, **overrides).train()


def no_gather(x: torch.Tensor, group) -> torch.Tensor:
    """The fault ``no-gather``: this rank's slice in its place of the whole row, zeros at the other ranks'."""
    return torch.cat([x if rank == group.rank else torch.zeros_like(x) for rank in range(group.size)], dim=1)


def first_range(whole: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """The fault ``first-range``: the joined row's first tokens, whichever rank's they are."""
    return whole[:, :sizes[rank]]


@contextlib.contextmanager
def keeping_first_range():
    """The fault ``first-range`` within the block (each rank keeps the joined row's first tokens)."""
    saved = trl_fused.own_tokens
    trl_fused.own_tokens = first_range
    try:
        yield
    finally:
        trl_fused.own_tokens = saved


#: The fault each kind's ``sp`` run predicts under once more after evaluating: KTO keeping the joined row's first
#: tokens, the RewardTrainer scoring its texts from its own slice's hidden states alone.
EVALUATION_FAULTS = {"kto": keeping_first_range, "reward": pooling_reads_local_slice}


def train(kind: str, mode: str, seen: list, cuts: list) -> dict:
    from transformers import TrainerCallback

    from padfree_plugins import accelerate

    saved = trl_fused.gather_sequence, trl_fused.slice_row, trl_fused.own_tokens
    pooled = sequence_parallel.gather_sequence, sequence_parallel.slice_row
    faults = contextlib.ExitStack()
    if mode == "no-gather":
        trl_fused.gather_sequence = sequence_parallel.gather_sequence = no_gather
        faults.enter_context(pooling_reads_local_slice())  # the reward model's texts: pooled from the slice alone
    elif mode == "first-range":
        trl_fused.own_tokens = first_range

    def recording_slice_row(row, rank, size, *args, **kwargs):
        local = saved[1](row, rank, size, *args, **kwargs)
        cu, joined = row["cu_seq_lens_q"].tolist(), int(row["cu_seq_lens_q"][-1])
        cut = packed_tokens(local)
        seen.append((joined, cut))
        cuts.append(any(start < cut < end for start, end in zip(cu, cu[1:])))
        labelled = (row["shift_labels"][0] != -100).tolist() if "shift_labels" in row else [True] * joined
        crossings.append(any(start < cut < end and any(labelled[start:cut]) and any(labelled[cut:end])
                             for start, end in zip(cu, cu[1:])))
        return local

    crossings: list = []  # per split call, whether a text, or a completion's labelled tokens, crosses the cut
    trl_fused.slice_row = sequence_parallel.slice_row = recording_slice_row
    grads: list = []

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.append({name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()
                          if p.grad is not None})

    completions: list = []
    try:
        trainer = build(kind, tempfile.mkdtemp(), completions)
        if mode != "padded":
            # every example whole (the shared rows: tests/sequence_parallel_shared_run.py)
            config = {"task": "causal_lm", "sequence_parallel": {"size": 2}, "prefix_sharing": "off"}
            plugin = accelerate(trainer, config).trainer_plugin
            if plugin != f"trl_{kind}":
                sys.exit(f"{kind}: accelerate() took {plugin}, not trl_{kind}")
        trainer.add_callback(Gradients())
        initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.train()
        evaluation = None
        if kind in ("kto", "reward") and mode in ("sp", "padded"):  # evaluate, then predict under the run's fault
            trained = len(seen)
            evaluation = evaluated(trainer, EVALUATION_FAULTS[kind]() if mode == "sp" else None)
            evaluation["cuts"] = crossings[trained:]
            del seen[trained:], cuts[trained:]
    finally:
        faults.close()
        trl_fused.gather_sequence, trl_fused.slice_row, trl_fused.own_tokens = saved
        sequence_parallel.gather_sequence, sequence_parallel.slice_row = pooled
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "grads": grads, "completions": completions, "initial": initial, "evaluation": evaluation,
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()}}


def main(runs: list[str], out: str) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    if state.num_processes not in (2, 4):
        sys.exit("launch with torchrun --nproc_per_node 2 (one sequence-parallel group of 2) or 4 (SP = 2 x DP = 2)")
    results = {}
    for run in runs:
        kind, mode = run.split("-", 1)
        seen: list = []
        cuts: list = []
        got = train(kind, mode, seen, cuts)
        everyone: list = [None] * state.num_processes
        dist.all_gather_object(everyone, (seen, cuts, got.pop("completions")))
        results[run] = {**got, "seen": [e[0] for e in everyone], "cuts": [e[1] for e in everyone],
                        "completions": [e[2] for e in everyone]}
    finish(results, out)


if __name__ == "__main__":
    main(chosen_runs(sys.argv[1], KINDS, MODES), sys.argv[2])
    leave()
