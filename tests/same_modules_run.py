"""Worker of tests/test_same_modules.py: every rank runs the same modules, every micro-batch, under a sharded model.

    OMP_NUM_THREADS=1 [DS_ACCELERATOR=cpu] python -m torch.distributed.run --nproc_per_node 2 \
        tests/same_modules_run.py ENGINE[,ENGINE] OUT SCENARIO [SCENARIO …] [--no-idle-tower]

``ENGINE``: ``fsdp2`` (``fully_shard`` on every module of the model's ``_no_split_modules`` classes — decoder
layers, vision blocks — on the MoE experts, then on the root) or ``zero3`` (as tests/sharded_run.py). Scenarios
(:data:`SCENARIOS`), each trained in turn on a fresh model:

* ``vlm``: a tiny Qwen2-VL, rank 0's micro-batches with images, rank 1's text only (its vision tower runs on the
  idle image; ``--no-idle-tower`` removes it, the old behaviour: its collectives checked, it fails with a
  collective mismatch and each rank prints the modules it ran); ``gemma3``, ``idefics3``,
  ``smolvlm`` (tiles with their pixel masks) and ``llava_onevision`` (any-resolution patches) the same with their
  own families' tiny models and idle images (:data:`VLM_SCENARIOS`);
* ``moe``: a tiny Qwen3-MoE (8 experts, one per token), rank 1's micro-batch two tokens, so most experts receive no
  token there;
* ``split``: a tiny Llama on token budgets with over-long examples split into chunks, the rank's own
  ``token_budget_dataloader``.

Rank 0 writes ``{scenario: {"losses", "tokens", "micro_batches", "state", "sharding", "experts"}}`` to ``OUT``;
with several comma-separated engines (each trains every scenario, one launch's start-up for all)
``{engine: {scenario: …}}``.
The one-process reference of each scenario is :func:`reference` (the test computes it).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from padfree_plugins import assemble
from padfree_plugins.batching.sampler import collator_token_keys, token_budget_dataloader, token_budget_sampler
from tests.distributed_common import gloo_group, modules_run

ENGINES = ("fsdp2", "zero3")
#: The vision-language scenarios and the parameters of each one's tower and projector (names containing one of these).
VLM_SCENARIOS = {"vlm": ("visual",), "gemma3": ("vision_tower", "multi_modal_projector"),
                 "idefics3": ("vision_model", "connector"), "smolvlm": ("vision_model", "connector"),
                 "llava_onevision": ("vision_tower", "multi_modal_projector", "image_newline")}
SCENARIOS = (*VLM_SCENARIOS, "moe", "split")
STEPS = 3
#: Plain SGD: Adam would scale a gradient that is zero in exact arithmetic (a key bias's, ~1e-9 here) up to a full
#: step, turning rounding noise into weight differences the comparison would have to tolerate.
LR = 0.5


def optimizer_of(parameters):
    return torch.optim.SGD(parameters, lr=LR)
#: The split scenario: a budget of 48 tokens, examples up to 130 (split into chunks of at most 48).
SPLIT_CONFIG = {"task": "causal_lm", "batching": {"strategy": "tokens", "max_tokens_per_batch": 48, "seed": 0,
                                                  "on_overlong_example": "split"}}
SPLIT_LENGTHS = (130, 7, 30, 1, 55, 12, 3, 20, 90, 5, 17, 9)


def vlm_model_and_steps(scenario: str = "vlm"):
    """The scenario's tiny image-text model (``vlm``: Qwen2-VL) and ``steps[s][rank]``: rank 0 an image example and
    a text one, rank 1 two texts."""
    from padfree_plugins.testing.vision import (
        gemma3_example,
        gemma3_processor,
        image_text_example,
        image_text_processor,
        synthetic_image,
        tiny_gemma3_model,
        tiny_vision_language_model,
    )

    if scenario == "gemma3":
        processor = gemma3_processor()
        model, example = tiny_gemma3_model(processor), gemma3_example
    else:
        model_type = "qwen2_vl" if scenario == "vlm" else scenario
        processor = image_text_processor(model_type)
        model, example = tiny_vision_language_model(model_type, processor), image_text_example
    steps = []
    for s in range(STEPS):
        images = [example(processor, f"a picture <image> of words {'and more ' * s}",
                          [synthetic_image(56, 56 + 28 * s, s)]),
                  example(processor, "some words about it")]
        texts = [example(processor, "only words here and no image"),
                 example(processor, "x" + " more words" * s)]
        steps.append([images, texts])
    return model, {"task": "causal_lm"}, steps


def moe_model_and_steps():
    """A tiny Qwen3-MoE, 8 experts, one per token; rank 1's micro-batch two tokens (two experts at most)."""
    from padfree_plugins.testing.models import random_examples, tiny_model

    model = tiny_model("qwen3_moe", "causal_lm", num_experts=8, num_experts_per_tok=1)
    steps = [[random_examples((40, 25, 33), seed=10 + s), random_examples((2,), seed=20 + s)] for s in range(STEPS)]
    return model, {"task": "causal_lm"}, steps


def split_model_and_dataset():
    from padfree_plugins.testing.models import random_examples, tiny_model

    return tiny_model("llama", "causal_lm"), SPLIT_CONFIG, random_examples(SPLIT_LENGTHS, seed=3)


def split_steps(dataset, collator, world: int) -> list[list[list[dict]]]:
    """The one-process view of the split scenario: ``steps[s][rank]`` of the token-budget plan of ``world`` ranks
    (epoch 0), the chunks served as the rank's dataloader serves them."""
    sampler = token_budget_sampler(dataset, SPLIT_CONFIG, num_replicas=world)
    view = sampler.dataset_view(dataset, collator_token_keys(collator))
    plan = sampler.plan(0)
    return [[[view[i] for i in plan[s * world + r]] for r in range(world)] for s in range(len(plan) // world)]


def expert_hits(model) -> tuple[list, list]:
    """Forward hooks on every MoE router recording which experts each forward routes to; ``(hits, handles)``."""
    hits, handles = [], []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            handles.append(module.register_forward_hook(
                lambda m, args, out: hits.append(sorted(set(out[-1].flatten().tolist())))))
    return hits, handles


def reference(scenario: str, world: int = 2) -> dict:
    """One process on the same global batches: each step's micro-batches of all ranks packed into one row, the mean
    token loss, the same SGD; losses and final weights."""
    model, config, steps = build(scenario, world)
    assembly = assemble(model, config)
    if scenario == "split":
        steps = split_steps(steps, assembly.collator, world)
    optimizer = optimizer_of(model.parameters())
    model.train()
    losses = []
    for step in steps:
        batch = assembly.collator([example for examples in step for example in examples])
        loss = assembly.forward(model, batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assembly.undo()
    return {"losses": losses, "micro_batches": len(steps),
            "state": {name: p.detach().clone() for name, p in model.named_parameters()}}


def build(scenario: str, world: int):
    if scenario in VLM_SCENARIOS:
        return vlm_model_and_steps(scenario)
    if scenario == "moe":
        return moe_model_and_steps()
    if scenario == "split":
        return split_model_and_dataset()
    sys.exit(f"scenario must be one of {SCENARIOS}, not {scenario!r}")


def fully_shard_blocks(model) -> None:
    """FSDP2 as an auto-wrap policy applies it: every module of a ``_no_split_modules`` class (and every MoE
    experts module) its own unit, inner units first, then the root."""
    from torch.distributed.fsdp import fully_shard

    classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in reversed(list(model.modules())):
        if type(module).__name__ in classes or type(module).__name__.endswith("Experts"):
            fully_shard(module)
    fully_shard(model)


def remove_idle_tower(assembly) -> bool:
    """Take the idle tower off (the behaviour before it); whether there was one."""
    guards = [handle for handle in assembly.patch.handles if getattr(handle, "idle", None) is not None]
    for guard in guards:
        guard.remove_idle_tower()
    return bool(guards)


def train(scenario: str, engine: str, accelerator, idle_tower: bool) -> dict:
    model, config, steps = build(scenario, accelerator.num_processes)
    assembly = assemble(model, config)  # patch first, then shard
    if not idle_tower and not remove_idle_tower(assembly):
        sys.exit(f"{scenario}: --no-idle-tower, but the model has no idle tower to remove")
    if not idle_tower:  # the fault: record the modules this rank runs (printed when a collective mismatch raises)
        with modules_run(model=model):
            return sharded_training(scenario, engine, accelerator, model, config, steps, assembly)
    return sharded_training(scenario, engine, accelerator, model, config, steps, assembly)


def sharded_training(scenario: str, engine: str, accelerator, model, config, steps, assembly) -> dict:
    """:func:`train` once the model is assembled: shard it, train, return the record."""
    from tests.sharded_run import full_state, setup, sharding_evidence, train_steps

    world, rank = accelerator.num_processes, accelerator.process_index
    if scenario == "split":
        loader = token_budget_dataloader(steps, assembly.collator, config, num_replicas=world, rank=rank)
        batches = list(loader)
    else:
        batches = [assembly.collator(step[rank]) for step in steps]
    hits, _ = expert_hits(model)
    if engine == "fsdp2":
        fully_shard_blocks(model)
        optimizer = optimizer_of(model.parameters())

        def backward(loss):
            loss.backward()

        def step():
            optimizer.step()
            optimizer.zero_grad()
    else:
        model, optimizer, backward, step = setup(engine, model, optimizer_of, world)
    model.train()
    counts = accelerator.gather(torch.tensor([len(batches)])).tolist()
    # as many steps as the fewest batches: a mismatch is reported, not hung on
    losses, tokens = train_steps(accelerator, assembly, model, batches[:min(counts)], backward, step, world)
    experts = [None] * world
    dist.all_gather_object(experts, hits)
    return {"losses": losses, "tokens": tokens, "micro_batches": counts, "experts": experts,
            "sharding": sharding_evidence(engine, model, optimizer), "state": full_state(engine, model)}


def main(engines: str, out: str, scenarios: list[str], idle_tower: bool) -> None:
    from accelerate import Accelerator

    if any(engine not in ENGINES for engine in engines.split(",")):
        sys.exit(f"engine must be one of {ENGINES}, not {engines!r}")
    if not idle_tower:  # the fault: its collectives' timeout short (tests.distributed_common.DIVERGING_ENV)
        gloo_group()
    accelerator = Accelerator(cpu=True)
    if accelerator.num_processes < 2:
        sys.exit("launch with torchrun --nproc_per_node 2: one process shards nothing")
    results = {}
    for engine in engines.split(","):
        results[engine] = {}
        for scenario in scenarios:
            results[engine][scenario] = train(scenario, engine, accelerator, idle_tower)
            gc.collect()
    if accelerator.is_main_process:
        partial = Path(f"{out}.partial")
        torch.save(results if "," in engines else results[engines], partial)
        os.replace(partial, out)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    flags = [arg for arg in sys.argv[1:] if arg.startswith("--")]
    positional = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    main(positional[0], positional[1], positional[2:], "--no-idle-tower" not in flags)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results on disk, every rank past its last collective: skip the gloo teardown (tests/sharded_run.py)
