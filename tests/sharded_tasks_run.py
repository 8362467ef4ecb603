"""Worker of tests/test_sharded_tasks.py: tasks and models beyond the plain causal LM, sharded on 2 CPU processes.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        tests/sharded_tasks_run.py MODE[,MODE...] OUT
    ... tests/sharded_tasks_run.py trainers-zero3 dpo|full[,…] MODEL_DIR RUN_DIR OUT
    ... tests/sharded_tasks_run.py resume-zero3 resume MODEL_DIR RUN_DIR OUT

Plain-loop modes (:data:`LOOPS`, several in one launch): ``reranker-zero3`` / ``reranker-fsdp2`` (the generative
yes/no reranker, whose scorer reads two rows of the LM head; under FSDP2 the head is a unit of its own),
``lfm2-zero3`` (LFM2's short convolutions, whose packed forward reads the conv's weight) and ``lora-fsdp2`` (a peft
LoRA model under ``fully_shard``). Step ``s`` of a mode is a fixed global batch of two micro-batches (:func:`plan`);
rank ``r`` trains micro-batch ``r``; :func:`reference` trains both, packed into one row, in one process. Rank 0
writes ``{mode: {"losses", "state", "sharding"}}`` to ``OUT`` (torch.save), as tests/sharded_run.py.

``trainers-zero3``: the Trainer runs under ZeRO-3 of one launch, one after the other (each ``TrainingArguments``
resets accelerate's state): ``dpo``, TRL ``DPOTrainer`` with a reference model (:func:`dpo_run`), and ``full``, a
``Trainer`` run saving a checkpoint (:func:`resume_run`); rank 0 writes ``{part: result}``. ``resume-zero3
resume``: the resumption from that checkpoint, in a launch of its own.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from padfree_plugins import assemble
from padfree_plugins.batching.distributed import global_token_count, num_label_tokens
from padfree_plugins.testing.models import random_examples, tiny_model

YES, NO = 7, 9
#: Mode -> SGD learning rate. SGD, not AdamW: Adam's normalisation turns float-level differences of near-zero
#: gradients (the reduction order of 2 ranks) into weight differences up to the learning rate; SGD keeps them
#: proportional to the gradients' own.
LR = {"reranker-zero3": 0.05, "reranker-fsdp2": 0.05, "lfm2-zero3": 0.1, "lora-fsdp2": 1.0}
#: Mode -> (engine, padfree config). The reranker's loss is a mean over examples (equal counts per rank, so the
#: engines' gradient average is the global mean); the causal LMs' is the token sum over the global count.
LOOPS = {
    "reranker-zero3": ("zero3", {"task": "reranker", "task_options": {
        "scorer": "yes_no", "yes_token_id": YES, "no_token_id": NO, "pairs": False}}),
    "lfm2-zero3": ("zero3", {"task": "causal_lm"}),
    "reranker-fsdp2": ("fsdp2", {"task": "reranker", "task_options": {
        "scorer": "yes_no", "yes_token_id": YES, "no_token_id": NO, "pairs": False}}),
    "lora-fsdp2": ("fsdp2", {"task": "causal_lm"}),
}
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])


def build_model(mode: str) -> torch.nn.Module:
    """The mode's tiny model, the same weights in every process (seeded)."""
    if mode.startswith("reranker"):  # untied: the LM head's weight is read by nothing but the scorer
        return tiny_model("qwen3", "causal_lm").train()
    if mode == "lfm2-zero3":
        return tiny_model("lfm2", "causal_lm", layer_types=["conv", "full_attention", "conv"]).train()
    import peft

    model = tiny_model("llama", "causal_lm", num_key_value_heads=2)
    torch.manual_seed(1)
    lora = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    for name, param in lora.named_parameters():  # B starts at zero: move it, so that A's gradients are not zero
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return lora.train()


def plan(mode: str, steps: int = 3) -> list[list[list[dict]]]:
    """Steps of two micro-batches of three examples each, varied lengths (one-token examples included)."""
    lengths = [1, 9, 4, 13, 6, 2, 7, 3, 11, 5, 8, 1, 12, 2, 6, 10, 4, 3]
    examples = random_examples(lengths[: 6 * steps], seed=3)
    if mode.startswith("reranker"):
        examples = [{**ex, "label": float(i % 2)} for i, ex in enumerate(examples)]
    return [[examples[6 * s : 6 * s + 3], examples[6 * s + 3 : 6 * s + 6]] for s in range(steps)]


def reference(mode: str) -> dict:
    """One process: each step's two micro-batches packed into one row, the plain loss, the same SGD."""
    engine, config = LOOPS[mode]
    model = build_model(mode)
    assembly = assemble(model, config)
    initial = trainable_state(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR[mode])
    losses = []
    for micro in plan(mode):
        loss = assembly.forward(model, assembly.collator(micro[0] + micro[1])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assembly.undo()
    return {"losses": losses, "state": trainable_state(model), "initial": initial}


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def setup_fsdp2(mode: str, model: torch.nn.Module):
    """``fully_shard`` per decoder layer (and on the LM head of the reranker: a unit of its own, whose weight is a
    sharded ``DTensor`` outside the head's forward), then on the root; SGD over the trainable shards."""
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if mode == "lora-fsdp2" else model
    for layer in inner.model.layers:
        fully_shard(layer)
    if mode == "reranker-fsdp2":
        fully_shard(inner.lm_head)
    fully_shard(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR[mode])

    def step():
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, lambda loss: loss.backward(), step


def train_loop(mode: str, accelerator) -> dict:
    """Rank ``r`` trains micro-batch ``r`` of every step of ``mode``; the result of :func:`loops_main` (every rank)."""
    from tests.sharded_run import full_state, setup, sharding_evidence

    engine, config = LOOPS[mode]
    world, rank = accelerator.num_processes, accelerator.process_index
    model = build_model(mode)
    assembly = assemble(model, config)  # patch first, then shard
    names = set(trainable_state(model))
    if engine == "fsdp2":
        model, optimizer, backward, step = setup_fsdp2(mode, model)
    else:
        model, optimizer, backward, step = setup(engine, model, lambda p: torch.optim.SGD(p, lr=LR[mode]), world)
    losses = []
    for micro in plan(mode):
        batch = assembly.collator(micro[rank])
        if config["task"] == "reranker":  # a mean over examples: the engine's gradient average is the global mean
            loss = assembly.forward(model, batch).loss
            backward(loss)
            logged = accelerator.reduce(loss.detach(), reduction="mean")
        else:  # token losses over the global count, times world (the engines average gradients)
            total = global_token_count(accelerator, num_label_tokens(batch))
            loss = assembly.forward(model, batch, num_items_in_batch=total).loss
            backward(loss * world)
            logged = accelerator.reduce(loss.detach(), reduction="sum")
        step()
        losses.append(logged.item())
    evidence = sharding_evidence(engine, model, optimizer)
    state = {name: value for name, value in full_state(engine, model).items() if name in names}
    return {"mode": mode, "processes": world, "losses": losses, "state": state, "sharding": evidence}


def without_external_parameter_discovery() -> None:
    """Turn off DeepSpeed's discovery of parameters read outside their module's forward.

    Inside the engine's forward, DeepSpeed gathers a ZeRO-3 parameter read by another module's code (``_in_forward``:
    it registers it as an external parameter of the running module). Outside it — a forward not run by the engine,
    a compiled one — the read gives the placeholder (shape ``[0]``). Off here, so that code which would read a
    placeholder fails: what the padding-free forwards read, they read inside the module's own forward."""
    from collections import OrderedDict

    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    ZeROOrderedDict.__getitem__ = OrderedDict.__getitem__  # this process only: it ends with the launch


def loops_main(modes: list[str], out: str) -> None:
    """Every mode of ``modes`` in turn, in one launch; rank 0 writes ``{mode: result}``."""
    from accelerate import Accelerator

    if any(LOOPS[mode][0] == "zero3" for mode in modes):
        without_external_parameter_discovery()

    accelerator = Accelerator(cpu=True)  # the gloo process group, and reduce() for the token count
    if accelerator.num_processes != 2:
        sys.exit("launch with torchrun --nproc_per_node 2: the plan has two micro-batches per step")
    results = {mode: train_loop(mode, accelerator) for mode in modes}
    if accelerator.is_main_process:
        partial = Path(f"{out}.partial")
        torch.save(results, partial)
        os.replace(partial, out)  # the result appears whole (run_group watches for it)
    gc.collect()  # the sharded models are gone before the group (tests/sharded_run.py)
    dist.barrier()
    dist.destroy_process_group()


# -- TRL DPOTrainer with a reference model under ZeRO-3 ----------------------------------------------------------

#: DeepSpeed config of the Trainer runs (every parameter partitioned: threshold 0, see tests/sharded_run.py).
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto", "fp16": {"enabled": False}, "bf16": {"enabled": False}}
DPO_STEPS = 3


def dpo_trainer(output_dir: str, *, deepspeed: dict | None, batch_size: int):
    """TRL ``DPOTrainer`` (sigmoid loss, a separate reference model) on the tiny Llama of tests/test_trl_preference.py,
    made padding-free by ``accelerate(trainer, {"task": "causal_lm"})``. SGD: see :data:`LR`. The model is built
    whole and partitioned by ``deepspeed.initialize`` (the Trainer's prepare), the reference model by TRL's
    ``prepare_deepspeed``."""
    import copy

    import trl

    from padfree_plugins import accelerate
    from tests.test_trainer import tokenizer
    from tests.test_trl_preference import pairs, policy

    model = policy()
    args = trl.DPOConfig(output_dir=output_dir, per_device_train_batch_size=batch_size, max_steps=DPO_STEPS,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                         report_to=[], seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False,
                         disable_tqdm=True, deepspeed=deepspeed)
    trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                             train_dataset=pairs(4 * DPO_STEPS), processing_class=copy.deepcopy(tokenizer()))
    if accelerate(trainer, {"task": "causal_lm"}).trainer_plugin != "trl_dpo":
        sys.exit("dpo: accelerate() did not take the trl_dpo plugin")
    return trainer


def logged(trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def dpo_run() -> dict:
    """DPO under ZeRO-3, 2 processes of 2 pairs a step: losses, margins, the full final weights."""
    import tempfile

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    trainer = dpo_trainer(tempfile.mkdtemp(), deepspeed=ZERO3, batch_size=2)
    trainer.train()
    if not isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine):
        sys.exit(f"dpo: model_wrapped is {type(trainer.model_wrapped).__name__}, not a DeepSpeedEngine")
    models = {"policy": trainer.model, "reference": trainer.ref_model.module}
    for role, module in models.items():
        whole = [n for n, p in module.named_parameters()
                 if not hasattr(p, "ds_id") or p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0]
        if whole:
            sys.exit(f"dpo: {role} parameters not partitioned by ZeRO-3: {whole[:5]}")
    params = list(trainer.model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.accelerator.wait_for_everyone()
    return {"processes": trainer.accelerator.num_processes, "losses": logged(trainer),
            "margins": logged(trainer, "rewards/margins"), "state": state,
            "sharding": {"local_numel": sum(p.ds_tensor.numel() for p in params),
                         "numel": sum(p.ds_numel for p in params)}}


# -- resume_from_checkpoint of a ZeRO-3 Trainer run ---------------------------------------------------------------

RESUME_STEPS, SAVE_AT = 4, 2


class StepsRun(TrainerCallback):
    """The global steps a launch trained (``steps``)."""

    def __init__(self):
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def resume_run(phase: str, model_dir: str, run_dir: str) -> dict:
    """The Trainer run of tests/sharded_run.py under ZeRO-3 (AdamW, linear decay: optimizer and scheduler state to
    restore), :data:`RESUME_STEPS` steps: ``phase`` ``full`` trains them all, saving a checkpoint at :data:`SAVE_AT`
    in ``run_dir``; ``resume`` (a new launch) resumes from that checkpoint. ``{"losses": {step: loss}, "state",
    "steps_run"}``."""
    import deepspeed

    from tests.sharded_run import ZERO3 as TRAINER_ZERO3
    from tests.sharded_run import trainer_run

    trainer, _ = trainer_run(model_dir, run_dir, deepspeed=TRAINER_ZERO3, max_steps=RESUME_STEPS,
                             lr_scheduler_type="linear", save_strategy="steps", save_steps=SAVE_AT)
    steps = StepsRun()  # the steps this launch trained: a resume that started over would train all of them
    trainer.add_callback(steps)
    if phase == "full":
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=str(Path(run_dir) / f"checkpoint-{SAVE_AT}"))
    if not isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine):
        sys.exit(f"resume: model_wrapped is {type(trainer.model_wrapped).__name__}, not a DeepSpeedEngine")
    with deepspeed.zero.GatheredParameters(list(trainer.model.parameters()), modifier_rank=None):
        state = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    trainer.accelerator.wait_for_everyone()
    return {"processes": trainer.accelerator.num_processes, "losses": losses, "state": state,
            "global_step": trainer.state.global_step, "steps_run": steps.steps}


def trainers_main(parts: list[str], model_dir: str, run_dir: str, out: str) -> None:
    """Every Trainer run of ``parts`` (``dpo``, ``full``, ``resume``) in turn, in this launch; rank 0 writes
    ``{part: result}`` (with one part: its result)."""
    unknown = [part for part in parts if part not in ("dpo", "full", "resume")]
    if unknown:
        sys.exit(f"Trainer runs are among dpo, full, resume, not {unknown}")
    results = {}
    for part in parts:
        results[part] = dpo_run() if part == "dpo" else resume_run(part, model_dir, run_dir)
        gc.collect()  # this run's engine and sharded models are gone before the next
    if dist.get_rank() == 0:
        partial = Path(f"{out}.partial")
        torch.save(results if len(parts) > 1 else results[parts[0]], partial)
        os.replace(partial, out)  # the result appears whole (run_group watches for it)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] in ("trainers-zero3", "resume-zero3"):
        trainers_main(sys.argv[2].split(","), *sys.argv[3:6])
        sys.stdout.flush()  # leave without the interpreter's teardown (tests/sharded_run.py)
        sys.stderr.flush()
        os._exit(0)
    modes = sys.argv[1].split(",")
    unknown = [mode for mode in modes if mode not in LOOPS]
    if unknown:
        sys.exit(f"modes must be among {', '.join(LOOPS)}, not {unknown}")
    loops_main(modes, sys.argv[2])
