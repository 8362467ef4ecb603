"""Worker of tests/test_sequence_parallel_shared.py: TRL ``GRPOTrainer`` and ``DPOTrainer`` on a tiny Llama, on 2 CPU
processes (gloo), each trained in one launch under ``sequence_parallel: {size: 2}`` with ``prefix_sharing: on`` and
as TRL's own run (not accelerated) on the same per-rank batches.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_shared_run.py \
        RUN[,RUN...] OUT

A run is ``KIND-MODE``: ``KIND`` ``grpo``, ``dpo``, ``lfm2`` / ``qwen3_5`` (GRPO on a tiny LFM2 / Qwen3.5, its mixers
gathered but in the ``split`` modes; Qwen3.5's prompts after a long system text), ``rloo`` or ``kto``
(tests/sequence_parallel_rl_run.py's, on a tiny Qwen3); ``MODE`` ``shared`` (size 2, prompts shared), ``padded`` (TRL's
own run: the reference), ``no-exchange`` (shared, under the fault
:func:`~padfree_plugins.testing.faults.parent_keys_not_exchanged`), ``allgather`` / ``allgather-no-exchange`` (the same
with ``sequence_parallel.attention: allgather``), ``zero-state`` (LFM2, shared, under
:func:`~padfree_plugins.testing.faults.completions_start_from_zero`), ``split`` (LFM2, shared, its short convolutions
split across the ranks; Qwen3.5: its gated delta rule too) or ``split-predecessor`` (that, under
:func:`~padfree_plugins.testing.faults.child_starts_from_rank_predecessor`); ``guard-check``: the model's guard on a
split shared row (:func:`guard_check`).
Rank 0 writes ``{run: {"losses", "grads", "initial", "state", "split", "completions", "calls", "crossing",
"attention"}}`` to ``OUT``: ``split`` the sequence mixers run split across the ranks, ``grads`` every parameter's
gradient at each optimizer step, ``completions`` per rank the completion ids each reward call scored (GRPO), ``calls``
per rank per split fused call (the joined row's tokens, the slice's, its prompts shared), ``crossing`` per rank per
split call whether a completion sits in another slice than its prompt's start, ``attention`` per rank the shared prompts
each packed attention call received.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile

import torch
import torch.distributed as dist

from padfree_plugins.integrations import trl_fused
from padfree_plugins.packing.batch import SHARED_PREFIXES_KEY, packed_tokens
from tests.distributed_common import chosen_runs, finish, leave

STEPS = 2
KINDS = ("grpo", "dpo", "lfm2", "qwen3_5", "rloo", "kto", "guard")
#: GRPO on a tiny hybrid of tests/test_trl_hybrid_prefixes.py, by kind.
HYBRIDS = {"lfm2": "lfm2", "qwen3_5": "qwen3_5_text"}
MODES = ("shared", "padded", "no-exchange", "zero-state", "check", "allgather", "allgather-no-exchange", "split",
         "split-predecessor")
CONFIG = {"task": "causal_lm", "sequence_parallel": {"size": 2, "attention": "ulysses"}, "prefix_sharing": "on"}
#: LFM2 (short convolutions beside attention): its mixers run on the whole row, where the shared row's conv taps
#: reach into each completion's prompt.
HYBRID_CONFIG = {**CONFIG, "sequence_parallel": {**CONFIG["sequence_parallel"], "mixers": "gather"}}
#: LFM2 with its short convolutions split across the ranks: a completion on rank 1 starts from the taps of its prompt
#: on rank 0, handed on.
SPLIT_CONFIG = {**CONFIG, "sequence_parallel": {**CONFIG["sequence_parallel"], "mixers": "split"}}
#: All-gather attention: each rank's queries against their segments' keys of the gathered row.
ALLGATHER_CONFIG = {**CONFIG, "sequence_parallel": {"size": 2, "attention": "allgather"}}


def model_dir(kind: str, tok) -> str:
    """The tiny Llama (``lfm2``, ``qwen3_5``: the tiny hybrid of tests/test_trl_hybrid_prefixes.py, slow decays) saved
    by rank 0 (GRPO loads its reference model from ``_name_or_path``; transformers writes from the main process only),
    its EOS row scaled so that completions end after a few tokens (completions of many lengths)."""
    from tests.test_trl_preference import policy

    path = [None]
    if dist.get_rank() == 0:
        if kind in HYBRIDS:
            from tests.test_trl_hybrid_prefixes import hybrid_dir

            path = [hybrid_dir(HYBRIDS[kind])]
        else:
            model = policy()
            with torch.no_grad():
                model.lm_head.weight[tok.eos_token_id] *= 40
            path = [tempfile.mkdtemp(prefix="padfree-sp-shared-")]
            model.save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def build(kind: str, output_dir: str, scored: list):
    """GRPO (two iterations, ``beta`` 0.1, 2 prompts of 4 generations a step over the 2 ranks) or DPO (sigmoid, a
    separate reference model, 2 pairs per rank a step); SGD at a high rate, no clipping."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM

    from tests.sequence_parallel_rl_run import tokenizer
    from tests.test_trl_preference import pairs, policy

    if kind in ("rloo", "kto"):  # tests/sequence_parallel_rl_run.py's, on its tiny Qwen3
        from tests.sequence_parallel_rl_run import build as rl_build

        return rl_build(kind, output_dir, scored)
    tok = tokenizer()
    common = dict(output_dir=output_dir, max_steps=STEPS, learning_rate=0.05, optim="sgd",
                  lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, beta=0.1,
                  save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True)
    if kind == "dpo":
        from tests.test_trainer import tokenizer as right_padded

        model = policy()
        args = trl.DPOConfig(per_device_train_batch_size=2, **common)
        return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                              train_dataset=pairs(4 * STEPS), processing_class=copy.deepcopy(right_padded()))
    model = AutoModelForCausalLM.from_pretrained(model_dir(kind, tok))

    def length_reward(completions: list[str], completion_ids: list, **kwargs) -> list[float]:
        scored.append([tuple(ids) for ids in completion_ids])
        return [len(text) / 10 for text in completions]

    words = "a tiny corpus for the tokenizer".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(2 + 3 * i)) for i in range(8)]
    if kind == "qwen3_5":  # its gated delta rule pads every run to 64 tokens: a prompt is shared where that saves some
        from tests.test_trl_hybrid_prefixes import SYSTEM

        texts = [f"{SYSTEM} {text}" for text in texts]
    data = datasets.Dataset.from_list([{"prompt": text} for text in texts])
    args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                          num_iterations=2, **common)
    return trl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data,
                           processing_class=tok)


def crosses(local) -> bool:
    """Whether a completion of the sliced shared row ``local`` has its last token in another rank's slice than its
    parent's first token (its queries there need keys that slice does not hold)."""
    shared = local.get(SHARED_PREFIXES_KEY)
    if shared is None:
        return False
    cut, bounds = packed_tokens(local), local["cu_seq_lens_q"].tolist()
    return any((bounds[segment + 1] - 1) // cut != bounds[parent] // cut
               for segment, parent in enumerate(shared.parents) if parent >= 0)


def train(kind: str, mode: str, calls: list, crossing: list, attention: list) -> dict:
    from transformers import TrainerCallback

    from padfree_plugins import accelerate
    from padfree_plugins.modeling.attention import record_attention_calls
    from padfree_plugins.testing.faults import child_starts_from_rank_predecessor, completions_start_from_zero, \
        parent_keys_not_exchanged

    right = trl_fused.slice_row

    def recording_slice_row(row, rank, size, *args, **kwargs):
        local = right(row, rank, size, *args, **kwargs)
        shared = local.get(SHARED_PREFIXES_KEY)
        prompts = len({p for p in shared.parents if p >= 0}) if shared is not None else 0
        calls.append((int(row["cu_seq_lens_q"][-1]), packed_tokens(local), prompts))
        crossing.append(crosses(local))
        return local

    trl_fused.slice_row = recording_slice_row
    grads: list = []

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.append({name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()
                          if p.grad is not None})

    completions: list = []
    stack = contextlib.ExitStack()
    split = 0
    try:
        trainer = build(kind, tempfile.mkdtemp(), completions)
        if mode != "padded":
            wanted = "trl_grpo" if kind in HYBRIDS else f"trl_{kind}"
            config = SPLIT_CONFIG if mode.startswith("split") else HYBRID_CONFIG if kind == "lfm2" else \
                ALLGATHER_CONFIG if "allgather" in mode else CONFIG
            plugin = accelerate(trainer, config).trainer_plugin
            split = sum(type(module.__dict__.get("forward")).__name__ == "SplitMixer"
                        for module in trainer.model.modules())
            if plugin != wanted:
                sys.exit(f"{kind}: accelerate() took {plugin}, not {wanted}")
        if mode.endswith("no-exchange"):
            stack.enter_context(parent_keys_not_exchanged())
        elif mode == "zero-state":
            stack.enter_context(completions_start_from_zero())
        elif mode == "split-predecessor":
            stack.enter_context(child_starts_from_rank_predecessor())
        trainer.add_callback(Gradients())
        initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        with record_attention_calls() as recorded:
            trainer.train()
        attention.extend(call.shared_prompts for call in recorded)
    finally:
        stack.close()
        trl_fused.slice_row = right
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "grads": grads, "completions": completions, "initial": initial, "split": split,
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()}}


def guard_check() -> dict:
    """The model's guard on a shared row split over the 2 ranks (a prompt of 6 tokens, two completions of 5 and 7;
    the cut at 9 puts the second completion on rank 1, its prompt on rank 0): the right row passes; positions of the
    completion restarting in rank 1's slice, or a structure naming the wrong parent, are refused on both ranks."""
    from padfree_plugins import BoundaryError, assemble
    from padfree_plugins.packing.prefixes import SharedPrefixes
    from padfree_plugins.packing.sequence_parallel import segment_parents, slice_row
    from tests.test_trl_preference import policy

    model = policy()
    assembly = assemble(model, {"task": "causal_lm", "sequence_parallel": {"size": 2, "attention": "ulysses"}})
    rank = dist.get_rank()
    torch.manual_seed(0)
    sizes = [6, 5, 7]
    bounds = torch.tensor([0, 6, 11, 18], dtype=torch.int32)
    right = torch.cat([torch.arange(6), torch.arange(6, 11), torch.arange(6, 13)])

    def run(positions: torch.Tensor, parents: list[int]) -> str:
        row = {"input_ids": torch.randint(3, 60, (1, 18)), "position_ids": positions[None],
               "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 7, "max_length_k": 7,
               SHARED_PREFIXES_KEY: SharedPrefixes.build(sizes, parents)}
        row["segment_parents"] = segment_parents(row)
        local = slice_row(row, rank, 2)
        try:
            with torch.no_grad():
                model(**{key: local[key] for key in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                     "max_length_q", "max_length_k", SHARED_PREFIXES_KEY)},
                      use_cache=False)
        except BoundaryError as error:
            return str(error)
        return "passed"

    restarted = right.clone()
    restarted[11:] = torch.arange(7)  # the second completion's positions restart (in rank 1's slice only)
    results = {"right": run(right, [-1, 0, 0]), "restarted": run(restarted, [-1, 0, 0]),
               "wrong parent": run(right, [-1, 0, 1])}
    assembly.undo()
    return results


def main(runs: list[str], out: str) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    if state.num_processes != 2:
        sys.exit("launch with torchrun --nproc_per_node 2: one sequence-parallel group of 2")
    results = {}
    for run in runs:
        kind, mode = run.split("-", 1)
        if kind == "guard":
            everyone: list = [None] * 2
            dist.all_gather_object(everyone, guard_check())
            results[run] = everyone
            continue
        calls: list = []
        crossing: list = []
        attention: list = []
        got = train(kind, mode, calls, crossing, attention)
        everyone: list = [None] * 2
        dist.all_gather_object(everyone, (calls, crossing, attention, got.pop("completions")))
        results[run] = {**got, **{name: [e[index] for e in everyone] for index, name in
                                  enumerate(("calls", "crossing", "attention", "completions"))}}
    finish(results, out)


if __name__ == "__main__":
    main(chosen_runs(sys.argv[1], KINDS, MODES), sys.argv[2])
    leave()
