"""Worker of tests/test_dpo_vision_sharded.py: TRL ``DPOTrainer`` on image-text pairs, its policy and reference model
sharded, rank 1's micro-batches text only.

    OMP_NUM_THREADS=1 [DS_ACCELERATOR=cpu] python -m torch.distributed.run --nproc_per_node 2 \
        tests/dpo_vision_sharded_run.py ENGINE[,ENGINE] OUT [--no-idle-tower]

Each rank builds the same ``DPOTrainer`` (tiny Qwen2.5-VL, a reference model) and ``accelerate(trainer)`` makes it
padding-free; then ``ENGINE`` shards both models as TRL does under it: ``fsdp2`` (``fully_shard`` on every module of
a ``_no_split_modules`` class, then on the root) or ``zero3`` (``deepspeed.initialize``, every parameter
partitioned; the reference model an engine without optimizer, as ``trl.models.prepare_deepspeed`` makes it). The
steps are driven here: for each of :data:`STEPS` steps the rank collates its own pairs (:func:`steps`: rank 0's with
images, rank 1's text only) with the trainer's collator, ``trainer.compute_loss``, backward, plain SGD. ``--no-idle-
tower`` takes the idle tower off both models (the behaviour before it): its collectives checked
(``tests.distributed_common.DIVERGING_ENV``), it fails with a collective mismatch and each rank prints the modules it
ran.

Rank 0 writes to ``OUT`` (torch.save): ``losses`` (per step, each rank's), ``packed`` (per rank, what every
``pack_media_call`` returned), ``towers`` / ``idle`` (per rank and step, the vision towers' forwards and the idle
tower's uses, policy and reference together), ``media`` (per rank and step, whether its batch had pixels), the full
final ``state``, the ``sharding`` evidence and ``ref_sharded`` (whether each reference parameter is sharded, taken
before its first forward); with several comma-separated engines (trained one after the other, one launch's
start-up for all) ``{engine: result}``. The one-process reference is :func:`reference`.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed_common import gloo_group, modules_run

ENGINES = ("fsdp2", "zero3")
STEPS = 3
#: Pairs per rank and step.
PAIRS = 2
#: Plain SGD (Adam would blow rounding-level gradient differences up to a full step).
LR = 0.5


def steps() -> list[list[list[dict]]]:
    """``steps[s][rank]``: rank 0's pairs hold one or two images of different sizes, rank 1's none."""
    from padfree_plugins.testing.vision import synthetic_image
    from tests.test_trl_dpo_vision import pair

    plan = []
    for s in range(STEPS):
        images = [pair(4 * s + k, [synthetic_image(28 + 14 * ((s + k + j) % 3), 56 - 14 * j, seed=10 * s + 3 * k + j)
                                   for j in range(1 + (s + k) % 2)]) for k in range(PAIRS)]
        texts = [pair(4 * s + PAIRS + k, []) for k in range(PAIRS)]
        plan.append([images, texts])
    return plan


def dpo_trainer(output_dir: str):
    """The DPO trainer every rank (and the reference) builds: the tiny Qwen2.5-VL policy (seeded), a copy of it as
    the reference model, every step's pairs as its dataset (indexed ``(s * 2 + rank) * PAIRS + k``)."""
    import datasets
    import trl

    from tests.test_vision_trainers import model, processor

    policy = model()
    rows = [example for step in steps() for examples in step for example in examples]
    args = trl.DPOConfig(output_dir=output_dir, per_device_train_batch_size=PAIRS, report_to=[], seed=0, beta=0.1,
                         save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, dataloader_pin_memory=False)
    return trl.DPOTrainer(model=policy, ref_model=copy.deepcopy(policy).eval(), args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=processor())


def batch_of(trainer, step: int, rank: int) -> dict:
    """Rank ``rank``'s micro-batch of step ``step``, made by TRL's vision collator."""
    start = (step * 2 + rank) * PAIRS
    return trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(start, start + PAIRS)])


def reference() -> dict:
    """One process on the same global batches: each step both ranks' micro-batches through ``compute_loss``, their
    mean backward (data parallelism averages the ranks' gradients), the same SGD; losses and final weights."""
    from padfree_plugins import accelerate

    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(out)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    model = trainer.model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    losses = []
    for step in range(STEPS):
        pair = [trainer.compute_loss(model, batch_of(trainer, step, rank)) for rank in (0, 1)]
        (sum(pair) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in pair])
    acceleration.undo()
    return {"losses": losses, "state": {name: p.detach().clone() for name, p in model.named_parameters()}}


def counted(trainer) -> tuple[list, dict]:
    """Record every ``pack_media_call`` result (``True``: packed), every vision tower forward (policy and reference)
    and every use of the idle tower; ``(packed, counts)``."""
    from padfree_plugins.integrations import trl_fused
    from padfree_plugins.modeling import vision

    packed, counts = [], {"towers": 0, "idle": 0}
    pack, idle = trl_fused.pack_media_call, vision.IdleTower.with_idle_tower

    def packing(*args):
        result = pack(*args)
        packed.append(result is not None)
        return result

    def idling(self, kwargs):
        counts["idle"] += 1
        return idle(self, kwargs)

    trl_fused.pack_media_call, vision.IdleTower.with_idle_tower = packing, idling
    for model in (trainer.model, trainer.ref_model):
        model.model.visual.register_forward_hook(lambda *_: counts.__setitem__("towers", counts["towers"] + 1))
    return packed, counts


def deepspeed_config(world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "fp16": {"enabled": False},
            "bf16": {"enabled": False}, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def shard(engine: str, trainer, world: int):
    """Shard the policy and the reference model as TRL does under ``engine``; ``(policy, optimizer, backward,
    step)``, the trainer's ``ref_model`` replaced by its engine under ZeRO-3."""
    if engine == "fsdp2":
        from tests.same_modules_run import fully_shard_blocks

        fully_shard_blocks(trainer.model)
        fully_shard_blocks(trainer.ref_model)
        optimizer = torch.optim.SGD(trainer.model.parameters(), lr=LR)

        def step():
            optimizer.step()
            optimizer.zero_grad()

        return trainer.model, optimizer, lambda loss: loss.backward(), step
    import deepspeed

    config = deepspeed_config(world)
    policy, optimizer, _, _ = deepspeed.initialize(
        model=trainer.model, optimizer=torch.optim.SGD(trainer.model.parameters(), lr=LR), config=config)
    trainer.ref_model, *_ = deepspeed.initialize(model=trainer.ref_model, config=config)
    trainer.ref_model.eval()
    return policy, optimizer, policy.backward, policy.step


def train(engine: str, idle_tower: bool) -> dict:
    from padfree_plugins import accelerate
    from tests.same_modules_run import remove_idle_tower

    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(out)
    if dist.get_world_size() != 2:
        sys.exit("launch with torchrun --nproc_per_node 2")
    acceleration = accelerate(trainer, {"task": "causal_lm"})  # patch first, then shard
    if not idle_tower:
        assemblies = (acceleration.assembly, acceleration.trainer_patch.ref_assembly)
        if not all(remove_idle_tower(assembly) for assembly in assemblies):
            sys.exit("--no-idle-tower, but a model has no idle tower to remove")
        # the fault: record the modules this rank runs (printed when a collective mismatch raises)
        with modules_run(policy=trainer.model, ref=trainer.ref_model):
            return sharded_training(engine, trainer, acceleration)
    return sharded_training(engine, trainer, acceleration)


def sharded_training(engine: str, trainer, acceleration) -> dict:
    """:func:`train` once the trainer is padding-free: shard both models, train, return the record."""
    from tests.sharded_run import full_state, sharding_evidence

    world, rank = dist.get_world_size(), dist.get_rank()
    packed, counts = counted(trainer)
    model, optimizer, backward, step = shard(engine, trainer, world)
    sharded_ref = ref_sharded(trainer.ref_model)  # before its forwards (FSDP2 may keep a root gathered after one)
    model.train()
    losses, towers, idle, media = [], [], [], []
    for s in range(STEPS):
        batch = batch_of(trainer, s, rank)
        before = dict(counts)
        loss = trainer.compute_loss(model, batch)
        backward(loss)
        step()
        losses.append(gathered(loss.item()))
        towers.append(counts["towers"] - before["towers"])
        idle.append(counts["idle"] - before["idle"])
        media.append("pixel_values" in batch)
    return {"losses": losses, "packed": gathered(packed), "towers": gathered(towers), "idle": gathered(idle),
            "media": gathered(media), "sharding": sharding_evidence(engine, model, optimizer),
            "ref_sharded": sharded_ref, "state": full_state(engine, model)}


def ref_sharded(ref_model) -> list[bool]:
    """Whether each parameter of the reference model is sharded (an FSDP2 ``DTensor``, a ZeRO-3 partition)."""
    from torch.distributed.tensor import DTensor

    return [isinstance(p, DTensor) or hasattr(p, "ds_id") for p in ref_model.parameters()]


def gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main(engines: str, out: str, idle_tower: bool) -> None:
    from padfree_plugins.integrations import trl_fused
    from padfree_plugins.modeling import vision

    if any(engine not in ENGINES for engine in engines.split(",")):
        sys.exit(f"engine must be one of {ENGINES}, not {engines!r}")
    if not idle_tower:  # the fault: its collectives' timeout short (tests.distributed_common.DIVERGING_ENV)
        gloo_group()
    results = {}
    for engine in engines.split(","):
        originals = trl_fused.pack_media_call, vision.IdleTower.with_idle_tower
        results[engine] = train(engine, idle_tower)
        trl_fused.pack_media_call, vision.IdleTower.with_idle_tower = originals  # counted() afresh for the next
        gc.collect()
        dist.barrier()
    if dist.get_rank() == 0:
        partial = Path(f"{out}.partial")
        torch.save(results if "," in engines else results[engines], partial)
        os.replace(partial, out)  # the result appears whole (run_group watches for it)
    gc.collect()
    dist.barrier()


if __name__ == "__main__":
    flags = [arg for arg in sys.argv[1:] if arg.startswith("--")]
    positional = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    main(positional[0], positional[1], "--no-idle-tower" not in flags)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results on disk, every rank past its last collective: skip the gloo teardown (tests/sharded_run.py)
