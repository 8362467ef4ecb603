"""torchrun worker of tests/test_sequence_parallel_sharded.py: a tiny Qwen3.5-shaped hybrid (gated-DeltaNet mixers)
trained under ``sequence_parallel: {size: 2}`` with its model sharded, on 2 CPU processes (gloo).

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        tests/sequence_parallel_sharded_run.py OUT CASE [CASE ...]

``CASE``: ``zero3`` (HF ``Trainer`` with ``TrainingArguments(deepspeed=ZeRO-3)``, made padding-free by
``accelerate(trainer, cfg)``: the case ``hf-hybrid-zero3`` of tests/sequence_parallel_trainer_run.py; mixers
gathered, as split mixers are refused under ZeRO-3), ``fsdp2`` (mixers split across the ranks, the state passed
across the cut; a plain loop, ``fully_shard`` on every decoder layer and on the root: HF ``Trainer`` cannot run FSDP2 on CPU,
docs/scaling.md), ``fsdp2-wrong-rank`` (the same with the deliberate fault
:func:`~padfree_plugins.testing.faults.state_from_wrong_rank`). ``zero3`` must come last (DeepSpeed leaves
``torch.nn.functional.linear`` patched for ZeRO-3 in the process). Rank 0 writes ``{case: result}`` to ``OUT``
(torch.save).
Every check that the model was really sharded exits non-zero when it fails: a run that silently trained unsharded
proves nothing.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile

import torch
import torch.distributed as dist

from tests.distributed_common import finish, leave

#: The plain loop's steps, examples per rank and micro-batch, and SGD rate.
STEPS, PER_RANK, LR = 3, 3, 0.1
CASES = ("zero3", "fsdp2", "fsdp2-wrong-rank")


def loop_examples(step: int, rank: int) -> list[dict]:
    """Rank ``rank``'s examples of ``step`` (2 to 39 tokens each, a prompt unlabelled)."""
    from tests.sequence_parallel_trainer_run import rows

    return rows(PER_RANK, 100 * step + rank)


def loop_model(checkpointing: bool = False):
    """The tiny hybrid of the trainer case ``hf-hybrid`` (slow decays), in train mode, ``checkpointing`` per layer."""
    from tests.sequence_parallel_trainer_run import tiny_hybrid

    model = tiny_hybrid()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def split_mixers(model, kind: str = "SplitMixer") -> int:
    """How many of the model's sequence mixers run as ``kind`` (``SplitMixer``, ``WholeRowMixer``)."""
    return sum(type(module.__dict__.get("forward")).__name__ == kind for module in model.modules())


def run_fsdp2(fault: bool) -> dict:
    """The plain loop under FSDP2 (gradient checkpointing, except with the ``fault``): rank ``r`` loads its own
    examples, the group trains their joined row; every rank's loss is its slice's token losses over the global label
    count, times the number of processes (FSDP averages)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from padfree_plugins import assemble
    from padfree_plugins.batching.distributed import num_label_tokens
    from padfree_plugins.testing.faults import state_from_wrong_rank

    world, rank = dist.get_world_size(), dist.get_rank()
    model = loop_model(checkpointing=not fault)  # the fault's own state is not the one a recompute reuses
    assembly = assemble(model, {"task": "causal_lm", "sequence_parallel": {"size": 2}})  # patch first, then shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        sys.exit(f"fsdp2: parameters are not DTensor (not sharded): {plain[:5]}")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, seen = [], [], []
    for step in range(STEPS):
        batch = assembly.collator(loop_examples(step, rank))
        total = torch.tensor(float(num_label_tokens(batch)))
        dist.all_reduce(total)
        with state_from_wrong_rank() if fault else contextlib.nullcontext():
            loss = assembly.forward(model, batch, num_items_in_batch=total).loss
        (loss * world).backward()
        grads.append({name: p.grad.full_tensor().detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(summed.item())
        seen.append(batch["input_ids"].shape[-1])
    state = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"losses": losses, "grads": grads, "state": state, "split_mixers": split_mixers(model),
            "sharding": {"local_numel": local, "numel": sum(p.numel() for p in model.parameters())},
            "micro_batches": _gathered(seen)}


def run_zero3() -> dict:
    """HF ``Trainer`` under DeepSpeed ZeRO-3 with ``sequence_parallel.size: 2`` (the trainer case
    ``hf-hybrid-zero3``): the logged losses, the full weights after every optimizer step and what shows the
    parameters were partitioned and the mixers split."""
    import deepspeed
    from accelerate.utils import DistributedType
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from tests.sequence_parallel_trainer_run import SP_CONFIG, make_trainer, trainer_result

    config = {**SP_CONFIG, "sequence_parallel": {"size": 2, "mixers": "gather"}}  # split: refused under ZeRO-3
    trainer, acceleration = make_trainer("hf-hybrid-zero3", tempfile.mkdtemp(), config)
    steps = StepWeights.attach(trainer)
    trainer.train()
    if trainer.accelerator.distributed_type != DistributedType.DEEPSPEED:
        sys.exit(f"zero3: accelerate runs {trainer.accelerator.distributed_type}, not DeepSpeed")
    if not isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine):
        sys.exit(f"zero3: model_wrapped is {type(trainer.model_wrapped).__name__}, not a DeepSpeedEngine")
    if trainer.model_wrapped.zero_optimization_stage() != 3:
        sys.exit(f"zero3: DeepSpeed runs ZeRO stage {trainer.model_wrapped.zero_optimization_stage()}")
    params = list(trainer.model.parameters())
    whole = [n for n, p in trainer.model.named_parameters()
             if not hasattr(p, "ds_id") or p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0]
    if whole:
        sys.exit(f"zero3: parameters not partitioned by ZeRO-3: {whole[:5]}")
    sharding = {"local_numel": sum(p.ds_tensor.numel() for p in params), "numel": sum(p.ds_numel for p in params)}
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        result = trainer_result(trainer)  # evaluate() inside gathers again, as any ZeRO-3 forward does
    result.update(steps=steps.weights, sharding=sharding, split_mixers=split_mixers(acceleration.assembly.model),
                  whole_row_mixers=split_mixers(acceleration.assembly.model, "WholeRowMixer"))
    # the models built after this one are plain: no zero.Init from the Trainer's DeepSpeed config
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    del trainer, acceleration, steps
    gc.collect()
    unset_hf_deepspeed_config()
    return result


class StepWeights:
    """A ``TrainerCallback``-like recorder of the full weights after every optimizer step (gathered under ZeRO-3, on
    every rank): with SGD and no clipping, ``(w_s - w_s+1) / lr`` is step ``s``'s gradient."""

    def __init__(self, model) -> None:
        self.model = model
        self.weights = [self.full()]

    @classmethod
    def attach(cls, trainer) -> StepWeights:
        from transformers import TrainerCallback

        recorder = cls(trainer.model)

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                recorder.weights.append(recorder.full())

        trainer.add_callback(Callback())
        return recorder

    def full(self) -> dict[str, torch.Tensor]:
        params = list(self.model.parameters())
        if not any(hasattr(p, "ds_id") for p in params):
            return {name: p.detach().clone() for name, p in self.model.named_parameters()}
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def _gathered(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def main(out: str, cases: list[str]) -> None:
    unknown = [case for case in cases if case not in CASES]
    if unknown or ("zero3" in cases and cases[-1] != "zero3"):
        sys.exit(f"cases among {CASES}, zero3 last: not {cases}")
    results = {}
    for case in cases:
        if case == "zero3":
            results[case] = run_zero3()
        else:
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            results[case] = run_fsdp2(fault=case == "fsdp2-wrong-rank")
    if dist.get_world_size() != 2:
        sys.exit("launch with torchrun --nproc_per_node 2: one sequence-parallel group of 2")
    finish(results, out, destroy=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    leave()
