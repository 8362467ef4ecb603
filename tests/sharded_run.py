"""Worker of tests/test_sharded.py: the plain loop of examples/accelerate_loop.py with the model sharded.

    OMP_NUM_THREADS=1 [DS_ACCELERATOR=cpu] python -m torch.distributed.run --nproc_per_node 2 \
        tests/sharded_run.py ENGINE[,ENGINE...] OUT [MODEL_DIR]

``ENGINE`` is ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per decoder layer and on the root), ``zero2`` or
``zero3`` (``deepspeed.initialize``, fp32, the reference's AdamW as a client optimizer). The model, data, token
budget and plan are those of ``reference_run`` in tests/test_distributed.py: rank ``r`` trains micro-batch
``s*N + r`` of step ``s``, and every rank's loss is its token losses summed over the *global* token count, times
``N`` (the engines average gradients over ranks; docs/scaling.md "The loss across ranks"). Rank 0 writes
``{"losses", "tokens", "state", "sharding"}`` to ``OUT`` (torch.save): the step losses summed over ranks, the token
count of every rank, the full weights gathered after training, and what proves the model was really sharded.
Several comma-separated engines train one after the other in the same launch (each its own model and optimizer,
from the same seed), saving a launch's start-up each; ``OUT`` then holds ``{engine: result}``. The case
``zero3-tiled-moe`` (:func:`train_moe`) trains a tiny Qwen3-MoE with its experts tiled instead; ``zero3-tiled``
also evaluates after training (:func:`evaluate_held`); ``zero3-hybrid`` (:func:`train_hybrid`) trains a tiny hybrid
whose ranks' rows run its sequence mixers a different number of times.
The case ``trainer-zero3`` (with ``MODEL_DIR``, a saved tiny Llama) trains an HF ``Trainer`` under ZeRO-3 after the
plain-loop cases (:func:`trainer_result`).
Every check that fails exits non-zero with a message: a run that silently trained unsharded proves nothing.
"""

from __future__ import annotations

import gc
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator

from padfree_plugins import assemble, load_config
from padfree_plugins.batching.distributed import global_token_count, num_label_tokens
from padfree_plugins.batching.sampler import token_budget_dataloader
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from tests.test_distributed import LOOP_ARGS, load_example

ENGINES = ("fsdp2", "zero2", "zero3")
#: An engine's name with this suffix trains with the MLP and the loss tiled (``memory.tile_tokens``), on batches with
#: labelled logits (the tiled loss's calls); the reference stays untiled.
TILED = "-tiled"
#: A tiled case's name with this suffix trains with a deliberate fault: every MLP tile drops its last token's output.
FAULTY = "-faulty"
TILE_TOKENS = 16
#: The case of the HF ``Trainer`` under ZeRO-3 (:func:`trainer_result`).
TRAINER = "trainer-zero3"
#: The tiled MLP under ZeRO-3 on a tiny Qwen3-MoE (the routed experts tiled): its own model, data and SGD, those of the
#: ``moe`` scenario of tests/same_modules_run.py (rank 1's micro-batch two tokens: most of its tiles empty).
MOE_CASE = "zero3-tiled-moe"
#: Evaluation steps the ZeRO-3 tiled case runs after training (no backward; see :func:`evaluate_held`).
EVAL_STEPS = 2
#: A tiny hybrid (gated-DeltaNet mixers, ``mixers: exact``) under ZeRO-3 data parallelism, its rows different per rank
#: (:func:`train_hybrid`), gradient checkpointing on.
HYBRID_CASE = "zero3-hybrid"
#: Per rank, the example lengths of every step of :data:`HYBRID_CASE`: rank 0's span 3, 2 and 1 chunks of the gated
#: delta rule's 64 tokens (3 mixer calls per layer), rank 1's one (1 call, and 2 more on zeros); and its steps.
HYBRID_LENGTHS, HYBRID_STEPS = ((150, 70, 10), (12,)), 3


def setup(engine: str, model: torch.nn.Module, optimizer_of, world: int):
    """``(model, optimizer, backward, step)`` of ``engine`` around the assembled ``model``."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = optimizer_of(model.parameters())  # over the DTensor shards, as FSDP2 wants

        def step():
            optimizer.step()
            optimizer.zero_grad()

        return model, optimizer, lambda loss: loss.backward(), step
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,  # one packed row; bookkeeping only
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        # Persistence threshold 0: every parameter is partitioned (by default ones under 1e5 elements, all of this
        # tiny model's, stay whole on every rank and ZeRO-3 would shard nothing).
        # Reuse distance 0: ZeRO releases a gathered parameter after each module call that used it, so how often
        # the tiled MLP's parameters are gathered is counted by their releases.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
        if engine == "zero3"
        else {"stage": 2},
        "zero_allow_untested_optimizer": True,  # torch AdamW, the reference's own optimizer
        "gradient_clipping": 0.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine_, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_of(model.parameters()),
                                                    config=config)
    return engine_, optimizer, engine_.backward, engine_.step


def sharding_evidence(engine: str, model: torch.nn.Module, optimizer) -> dict:
    """What shows the model is sharded as ``engine`` shards it; exits with an error when it is not."""
    if engine == "fsdp2":
        from torch.distributed.tensor import DTensor

        plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            sys.exit(f"fsdp2: parameters are not DTensor (not sharded): {plain[:5]}")
        return {"dtensor_parameters": sum(1 for _ in model.parameters()),
                "local_numel": sum(p.to_local().numel() for p in model.parameters()),
                "numel": sum(p.numel() for p in model.parameters())}
    stage = model.zero_optimization_stage()
    if stage != (3 if engine == "zero3" else 2):
        sys.exit(f"{engine}: DeepSpeed runs ZeRO stage {stage}")
    if engine == "zero3":
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = list(model.module.parameters())
        whole = [n for n, p in model.module.named_parameters()
                 if not hasattr(p, "ds_id") or p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0]
        if whole:
            sys.exit(f"zero3: parameters not partitioned (no ds_id, or gathered outside a forward): {whole[:5]}")
        return {"partitioned_parameters": len(params), "local_numel": sum(p.ds_tensor.numel() for p in params),
                "numel": sum(p.ds_numel for p in params)}
    local = sum(t.numel() for t in optimizer.single_partition_of_fp32_groups)
    numel = sum(p.numel() for p in model.module.parameters())
    if local >= numel:
        sys.exit(f"zero2: the optimizer holds {local} of {numel} fp32 elements on one rank: not partitioned")
    return {"local_numel": local, "numel": numel}


def full_state(engine: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on every rank (collective: every rank must call it)."""
    if engine == "fsdp2":
        return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    module = model.module
    if engine == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {name: p.detach().clone() for name, p in module.named_parameters()}
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def main(engines: str, out: str, model_dir: str | None = None) -> None:
    cases = engines.split(",")
    for case in cases:
        if case in (MOE_CASE, HYBRID_CASE):
            continue
        if case == TRAINER and model_dir is None:
            sys.exit(f"{TRAINER} trains the model saved in MODEL_DIR: give it after OUT")
        if case != TRAINER and (case.removesuffix(FAULTY).removesuffix(TILED) not in ENGINES
                                or case.endswith(FAULTY) and TILED not in case):
            sys.exit(f"engine must be one of {ENGINES} (with {TILED}: memory.tile_tokens {TILE_TOKENS}), "
                     f"{MOE_CASE}, {HYBRID_CASE} or {TRAINER}, not {case!r}")
    accelerator = Accelerator(cpu=True)  # the gloo process group, and reduce() for the token count
    if accelerator.num_processes < 2:
        sys.exit("launch with torchrun --nproc_per_node 2 (or more): one process shards nothing")
    results = {}
    # the Trainer's arguments reset accelerate's state, which the plain loops' accelerator holds: it runs last
    for case in sorted(cases, key=lambda case: case == TRAINER):
        if case == TRAINER:
            results[case] = trainer_result(model_dir)
        elif case == MOE_CASE:
            results[case] = train_moe(accelerator)
        elif case == HYBRID_CASE:
            results[case] = train_hybrid(accelerator)
        else:
            results[case] = train(case.removesuffix(FAULTY).removesuffix(TILED), accelerator, TILED in case,
                                  case.endswith(FAULTY))
        gc.collect()  # the case's sharded model is gone before the next one starts
        dist.barrier()
    if accelerator.is_main_process:
        partial = Path(f"{out}.partial")
        torch.save(results if len(cases) > 1 else results[cases[0]], partial)
        os.replace(partial, out)  # the result appears whole (run_group watches for it)
    # The group is destroyed once train() has returned and the sharded model is gone: destroying it while FSDP's
    # or DeepSpeed's state still holds it aborts gloo at exit (as DDP's reducer does, examples/accelerate_loop.py).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def counted_releases(param: torch.nn.Parameter) -> list[int]:
    """ZeRO-3: a one-element counter of ``param``'s releases (``param.partition`` calls; each follows a gather)."""
    count, partition = [0], param.partition

    def counting(*args, **kwargs):
        count[0] += 1
        return partition(*args, **kwargs)

    param.partition = counting
    return count


def train(engine: str, accelerator: Accelerator, tiled: bool = False, faulty: bool = False) -> dict:
    """Train under ``engine`` (``tiled``: with :data:`TILE_TOKENS`; ``faulty``: every MLP tile drops its last token);
    the losses, token counts, full weights and sharding evidence (every rank); under ZeRO-3 also how many times the
    first layer's ``gate_proj.weight`` was released (gathered) in training, and, tiled, an evaluation after training
    (:func:`evaluate_held`)."""
    from padfree_plugins.testing.faults import tile_drops_last_token

    world, rank = accelerator.num_processes, accelerator.process_index
    loop = load_example()
    args = loop.parse_args(LOOP_ARGS)
    config = load_config(args.config)
    config.batching.max_tokens_per_batch = args.max_tokens
    if tiled:
        config.memory.tile_tokens = TILE_TOKENS
    model = loop.tiny_llama()  # same seed as the reference
    assembly = assemble(model, config)  # patch first, then shard
    tiled_modules = sum(type(m.__dict__.get("forward")).__name__ in ("_TiledForward", "TiledLossForward")
                        for m in model.modules()) + (type(assembly.forward).__name__ == "TiledLossForward")
    dataset = loop.synthetic_dataset(args.examples, args.median_length, model.config.vocab_size)
    loader = token_budget_dataloader(dataset, assembly.collator, config, num_replicas=world, rank=rank)
    model, optimizer, backward, step = setup(engine, model, lambda p: torch.optim.AdamW(p, lr=args.lr), world)

    releases = counted_releases(model.module.model.layers[0].mlp.gate_proj.weight) if engine == "zero3" else [None]
    losses, tokens = [], []
    model.train()
    with tile_drops_last_token() if faulty else nullcontext():
        train_epochs(args, loader, accelerator, assembly, model, backward, step, tiled, world, losses, tokens)
    evidence = sharding_evidence(engine, model, optimizer)
    result = {"engine": engine, "processes": world, "losses": losses, "tokens": tokens, "releases": releases[0],
              "state": full_state(engine, model), "sharding": evidence, "tiled": tiled_modules}
    if engine == "zero3" and tiled and not faulty:
        result["eval"] = evaluate_held(loader, accelerator, assembly, model, backward, step, world)
    return result


def still_gathered(model: torch.nn.Module) -> list[str]:
    """ZeRO-3: the parameters not back to their partitioned placeholder."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [name for name, p in model.module.named_parameters()
            if p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0]


def held_marks(model: torch.nn.Module) -> list[str]:
    """ZeRO-3: the parameters a tiled call still holds (its mark in ``ds_active_sub_modules``)."""
    return [name for name, p in model.module.named_parameters()
            if any(str(mark).startswith("padfree-plugins:") for mark in p.ds_active_sub_modules)]


def evaluate_held(loader, accelerator, assembly, model, backward, step, world: int) -> dict:
    """ZeRO-3, tiled MLP and loss, after training: :data:`EVAL_STEPS` evaluation steps (``model.eval()``,
    ``no_grad``, as ``Trainer.evaluate``: no backward releases the held gather) on epoch 0's first micro-batches,
    then one more training step; then both again under the deliberate fault
    :func:`~padfree_plugins.testing.faults.held_gather_never_let_go`. For each: the evaluation losses (summed over
    ranks), the parameters a tiled call still holds after the evaluation, and those not partitioned after the
    training step. (DeepSpeed itself leaves every parameter gathered after a forward without backward, tiled or not,
    once its trace holds a backward; its optimizer step partitions them all and clears every hold.)"""
    from padfree_plugins.testing.faults import held_gather_never_let_go

    loader.batch_sampler.set_epoch(0)
    batches = [keep_labelled_logits(batch) for batch, _ in zip(loader, range(EVAL_STEPS))]
    totals = [global_token_count(accelerator, num_label_tokens(batch)) for batch in batches]
    out = {}
    for name, fault in (("clean", False), ("faulty", True)):
        losses = []
        with held_gather_never_let_go() if fault else nullcontext():
            model.eval()
            with torch.no_grad():
                for batch, total in zip(batches, totals):
                    loss = assembly.forward(model, batch, num_items_in_batch=total).loss
                    losses.append(accelerator.reduce(loss.detach(), reduction="sum").item())
            held = held_marks(model)
            model.train()
            backward(assembly.forward(model, batches[0], num_items_in_batch=totals[0]).loss * world)
            step()
        out[name] = {"losses": losses, "held": held, "gathered_after_step": still_gathered(model)}
    return out


def train_moe(accelerator: Accelerator) -> dict:
    """The tiled MLP under ZeRO-3 on the tiny Qwen3-MoE of :data:`MOE_CASE` (tiles of :data:`TILE_TOKENS`, the loss
    untiled): losses, tokens, full weights, sharding evidence, the tiled modules, and how often the first layer's
    ``experts.gate_up_proj`` was released (gathered) in training."""
    from tests.same_modules_run import moe_model_and_steps, optimizer_of

    world, rank = accelerator.num_processes, accelerator.process_index
    model, config, steps = moe_model_and_steps()
    assembly = assemble(model, {**config, "memory": {"tile_tokens": TILE_TOKENS, "tile_loss": False}})
    tiled_modules = [type(m).__name__ for m in model.modules()
                     if type(m.__dict__.get("forward")).__name__ == "_TiledForward"]
    batches = [assembly.collator(step[rank]) for step in steps]
    model, optimizer, backward, step = setup("zero3", model, optimizer_of, world)
    releases = counted_releases(model.module.model.layers[0].mlp.experts.gate_up_proj)
    model.train()
    losses, tokens = train_steps(accelerator, assembly, model, batches, backward, step, world)
    return {"engine": "zero3", "processes": world, "losses": losses, "tokens": tokens, "releases": releases[0],
            "state": full_state("zero3", model), "sharding": sharding_evidence("zero3", model, optimizer),
            "tiled": tiled_modules}


def hybrid_examples(step: int, rank: int) -> list[dict]:
    """Rank ``rank``'s examples of :data:`HYBRID_CASE`'s step ``step`` (labels: the input ids)."""
    from padfree_plugins.testing.models import random_examples

    return random_examples(HYBRID_LENGTHS[rank], vocab_size=256, seed=step + 10 * rank)


def mixer_calls(model: torch.nn.Module) -> tuple[list[int], object]:
    """``([forward, backward], handle)``: how often the first gated-DeltaNet mixer's ``in_proj_qkv`` (a module ZeRO-3
    gathers at each call) runs and has its backward run, counted until ``handle.remove()``."""
    count = [0, 0]

    def counted(module, args, output):
        count[0] += 1
        if output.requires_grad:
            output.register_hook(lambda grad: count.__setitem__(1, count[1] + 1))

    return count, model.model.layers[0].linear_attn.in_proj_qkv.register_forward_hook(counted)


def train_hybrid(accelerator: Accelerator) -> dict:
    """:data:`HYBRID_CASE`: the tiny hybrid of tests/sequence_parallel_sharded_run.py under ZeRO-3, every mixer run on
    each example alone (``mixers: exact``), gradient checkpointing per layer, SGD; rank ``r`` trains
    :func:`hybrid_examples` ``(step, r)``, its loss its token losses over the global count, times the ranks. Returns
    the step losses (summed over ranks), the first step's full gradients, the final weights, the sharding evidence,
    per rank and step the ``[forward, backward]`` calls of the first mixer's input projection (:func:`mixer_calls`),
    and the all-reduces the ranks used to agree on them (:func:`~padfree_plugins.modeling.mixers.agreed_calls`)."""
    from deepspeed.utils import safe_get_full_grad

    from padfree_plugins.modeling import mixers
    from tests.sequence_parallel_sharded_run import loop_model

    world, rank = accelerator.num_processes, accelerator.process_index
    model = loop_model(checkpointing=True)
    assembly = assemble(model, {"task": "causal_lm", "mixers": "exact"})
    batches = [assembly.collator(hybrid_examples(step, rank)) for step in range(HYBRID_STEPS)]
    model, optimizer, backward, step = setup("zero3", model, lambda p: torch.optim.SGD(p, lr=0.1), world)
    agreements, agree = [0], mixers.agreed_calls

    def counted_agree(row, chunk, *args):
        agreements[0] += ("zero3 calls", chunk) not in row._groups
        return agree(row, chunk, *args)

    mixers.agreed_calls = counted_agree
    try:
        losses, calls, grads = [], [], {}
        for index, batch in enumerate(batches):
            count, handle = mixer_calls(model.module)
            total = global_token_count(accelerator, num_label_tokens(batch))
            loss = assembly.forward(model, batch, num_items_in_batch=total).loss
            backward(loss * world)
            if index == 0:
                grads = {name: safe_get_full_grad(p).detach().clone() for name, p in model.module.named_parameters()}
            step()
            losses.append(accelerator.reduce(loss.detach(), reduction="sum").item())
            handle.remove()
            calls.append(accelerator.gather(torch.tensor([count])).tolist())
    finally:
        mixers.agreed_calls = agree
    return {"losses": losses, "grads": grads, "state": full_state("zero3", model), "calls": calls,
            "agreements": accelerator.gather(torch.tensor([agreements[0]])).tolist(),
            "sharding": sharding_evidence("zero3", model, optimizer)}


def train_epochs(args, loader, accelerator, assembly, model, backward, step, tiled, world, losses, tokens) -> None:
    """The training loop of :func:`train`: appends each step's loss (summed over ranks) and token counts."""
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)  # a plain DataLoader: the sampler reshuffles
        epoch_losses, epoch_tokens = train_steps(accelerator, assembly, model, loader, backward, step, world, tiled)
        losses += epoch_losses
        tokens += epoch_tokens


def train_steps(accelerator, assembly, model, batches, backward, step, world: int,
                tiled: bool = False) -> tuple[list[float], list[list[int]]]:
    """One optimizer step per batch (the label count summed over ranks, the loss scaled by ``world``; ``tiled``: only
    the labelled positions' logits kept): each step's loss summed over ranks, and every rank's token count."""
    losses, tokens = [], []
    for batch in batches:
        total = global_token_count(accelerator, num_label_tokens(batch))
        if tiled:
            batch = keep_labelled_logits(batch)
        loss = assembly.forward(model, batch, num_items_in_batch=total).loss
        backward(loss * world)
        step()
        losses.append(accelerator.reduce(loss.detach(), reduction="sum").item())
        tokens.append(accelerator.gather(torch.tensor([batch.num_tokens])).tolist())
    return losses, tokens


# -- HF Trainer under DeepSpeed ZeRO-3 -----------------------------------------------------------------------------

#: padfree.yaml of the Trainer runs: the plan of the plain loop (budget 192, shuffle seed 0).
TRAINER_CONFIG = {"batching": {"strategy": "tokens", "max_tokens_per_batch": 192, "seed": 0}}
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto", "fp16": {"enabled": False}, "bf16": {"enabled": False}}


def trainer_run(model_dir: str, output_dir: str, *, deepspeed: dict | None = None, gradient_accumulation_steps: int = 1,
                ranks: int | None = None, **arguments):
    """An HF ``Trainer`` on the tiny Llama saved in ``model_dir``, made padding-free by ``accelerate(trainer, …)``;
    returns ``(trainer, partitioned_at_assembly)``. The arguments come first, so that under ZeRO-3 the model loads
    partitioned (``zero.Init``), as a user's would. ``ranks``: in one process, train on the global batches of that
    many ranks (the reference: the plan of ``ranks`` replicas, ``ranks`` micro-batches accumulated per step).
    ``arguments``: ``TrainingArguments`` overriding these defaults."""
    import datasets
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from padfree_plugins import accelerate

    defaults = dict(num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
                    save_strategy="no", report_to="none", seed=0, disable_tqdm=True, use_cpu=True)
    args = TrainingArguments(output_dir=output_dir, gradient_accumulation_steps=gradient_accumulation_steps,
                             deepspeed=deepspeed, **{**defaults, **arguments})
    if deepspeed is not None:
        # zero.Init in from_pretrained sizes its batch check by DeepSpeed's own view of the group, which accelerate
        # leaves unset on CPU (MULTI_CPU until the Trainer prepares): set up the group and hand it to DeepSpeed.
        import deepspeed as ds

        args.world_size  # noqa: B018 (the process group is set up when first needed)
        ds.init_distributed(dist_backend="gloo")
    model = LlamaForCausalLM.from_pretrained(model_dir)
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    loop = load_example()
    loop_args = loop.parse_args(LOOP_ARGS)
    rows = loop.synthetic_dataset(loop_args.examples, loop_args.median_length, model.config.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
    accelerate(trainer, TRAINER_CONFIG)
    if ranks is not None:  # the plan of `ranks` replicas in one process (accelerate's own would plan for 1)
        loader = token_budget_dataloader(trainer.train_dataset, trainer.data_collator, TRAINER_CONFIG,
                                         num_replicas=ranks)
        trainer.get_train_dataloader = lambda: trainer.accelerator.prepare(loader)
    return trainer, partitioned


def trainer_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def trainer_result(model_dir: str) -> dict:
    """``Trainer`` with ``TrainingArguments(deepspeed=ZeRO-3)`` on 2 processes: its losses, full final weights and
    what proves the model was partitioned (``model_dir``: where the model came from)."""
    import tempfile

    import deepspeed
    from accelerate.utils import DistributedType
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    trainer, partitioned = trainer_run(model_dir, tempfile.mkdtemp(), deepspeed=ZERO3)
    trainer.train()
    if trainer.accelerator.distributed_type != DistributedType.DEEPSPEED:
        sys.exit(f"trainer: accelerate runs {trainer.accelerator.distributed_type}, not DeepSpeed")
    if not isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine):
        sys.exit(f"trainer: model_wrapped is {type(trainer.model_wrapped).__name__}, not a DeepSpeedEngine")
    params = list(trainer.model.parameters())
    whole = [n for n, p in trainer.model.named_parameters()
             if not hasattr(p, "ds_id") or p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0]
    if whole:
        sys.exit(f"trainer: parameters not partitioned by ZeRO-3: {whole[:5]}")
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.accelerator.wait_for_everyone()  # no rank goes on while the other still talks to it
    return {"engine": TRAINER, "processes": trainer.accelerator.num_processes, "model_dir": model_dir,
            "losses": trainer_losses(trainer), "state": state, "partitioned_at_assembly": partitioned,
            "sharding": {"local_numel": sum(p.ds_tensor.numel() for p in params),
                         "numel": sum(p.ds_numel for p in params)}}


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # The results are on disk and every rank is past its last collective: leave without the interpreter's teardown,
    # where a thread of the process group can abort the process (as tests/ddp_per_example_run.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
