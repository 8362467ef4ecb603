"""torchrun worker of tests/test_sequence_parallel_trainers.py: HF ``Trainer``, TRL ``SFTTrainer`` and the plain loop
trained with ``sequence_parallel: {size: 2}`` on 2 CPU processes (gloo).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_trainer_run.py \
        OUT CASE [CASE ...]

``CASE`` is a key of :data:`CASES` (a trainer made padding-free by ``accelerate(trainer, cfg)``, trained on
token-budget micro-batches, each rank its own, then evaluated), ``loop`` (``train`` of examples/accelerate_loop.py
with its config plus ``sequence_parallel.size: 2``) or ``predict`` (HF ``Trainer.predict`` and ``evaluate`` with
``compute_metrics``: :func:`run_predict`). On 4 processes only ``predict-dp`` (2 groups of 2: SP x DP; HF
``predict`` / ``evaluate`` alone, :func:`predicted`) and the SP4 cases run, in one launch if the test selects both.
Rank 0 writes ``{case: result}`` to ``OUT`` (torch.save): the logged losses, the final weights, ``eval_loss``, and
what shows each rank computed a slice of the group's row (the token counts the embeddings and the LM head saw on
every rank). The one-process references are computed by the test.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed_common import finish, leave

#: padfree.yaml of the trainer runs, without sequence parallelism (the reference's); the runs add size 2.
TRAINER_CONFIG = {"task": "causal_lm", "batching": {"strategy": "tokens", "max_tokens_per_batch": 128, "seed": 0}}
SP_CONFIG = {**TRAINER_CONFIG, "sequence_parallel": {"size": 2}}
#: padfree.yaml of the ``predict`` cases (evaluation alone: no token budget).
SP_CONFIG_EVAL = {"task": "causal_lm", "sequence_parallel": {"size": 2}}
#: The trainer cases: the trainer, gradient accumulation, gradient checkpointing, the batching strategy (token
#: budgets balance the ranks' micro-batches, often to the token: ``examples`` puts the cut inside examples), and
#: accelerate's ``split_batches`` (each global batch of :data:`SPLIT_BATCH` examples split across the ranks).
CASES = {
    "hf-checkpointing": {"kind": "hf", "accumulation": 1, "checkpointing": True, "strategy": "examples"},
    "hf-split-batches": {"kind": "hf", "accumulation": 1, "checkpointing": False, "strategy": "examples",
                         "split_batches": True},
    "hf-accumulation": {"kind": "hf", "accumulation": 2, "checkpointing": False, "strategy": "tokens"},
    "sft": {"kind": "sft", "accumulation": 2, "checkpointing": True, "strategy": "tokens"},
    # the MoE load-balancing loss is the row's: each global batch is the group's row, as one process trains it
    "hf-moe-aux": {"kind": "hf", "accumulation": 1, "checkpointing": False, "strategy": "examples",
                   "split_batches": True, "model": "moe"},
    # a gated-DeltaNet hybrid: its mixers split across the ranks, the state passed across the cut (recomputed under
    # checkpointing without a second exchange)
    "hf-hybrid": {"kind": "hf", "accumulation": 1, "checkpointing": True, "strategy": "examples",
                  "model": "hybrid"},
}
#: Cases on 4 processes, one group of 4 (not in :data:`CASES`, which run on 2): HF Trainer on a Llama of 6 attention
#: heads and 2 key / value heads, which SP4 cannot split by heads alone (auto: Ulysses within blocks of 2 ranks,
#: all-gather across the blocks).
SP4_CASES = {"hf-sp4-kv2": {"kind": "hf", "accumulation": 1, "checkpointing": True, "strategy": "tokens",
                            "model": "kv2", "sp": 4}}
#: Cases under a sharding engine, launched by tests/sequence_parallel_sharded_run.py (the reference, in one process,
#: unsharded): the hybrid of ``hf-hybrid`` under DeepSpeed ZeRO-3, trained with SGD (no clipping), so that every
#: step's gradient is its weight update over the rate.
SHARDED_CASES = {"hf-hybrid-zero3": {"kind": "hf", "accumulation": 1, "checkpointing": True, "strategy": "examples",
                                     "model": "hybrid", "deepspeed": True, "optim": "sgd", "lr": 0.1}}
#: DeepSpeed ZeRO-3 of the sharded cases: every parameter partitioned (threshold 0), fp32.
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "fp16": {"enabled": False},
         "bf16": {"enabled": False}}
ALL_CASES = {**CASES, **SP4_CASES, **SHARDED_CASES}
EVAL_BATCH = 2  # per rank; the reference evaluates the group's 2 x 2 examples as one batch
SPLIT_BATCH = 4  # split_batches=True: the examples of a global batch, 2 per rank (training and evaluation)
#: The ``predict`` case's evaluation rows: whole global batches (an odd count would have accelerate repeat an example
#: to fill the last one: its metrics drop it, but its tokens count in that batch's loss, as under any data parallelism).
PREDICT_ROWS = 8


def label_metrics(prediction) -> dict:
    """``compute_metrics`` of the ``predict`` case: the labelled tokens' mean negative log-likelihood (each position's
    logits predict the next label), their count and the examples counted (continuous or exact: no argmax)."""
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    logits, labels = logits[:, :-1].double(), labels[:, 1:]
    counted = labels != -100
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"nll": -(picked * counted).sum().item() / counted.sum().item(), "labelled": int(counted.sum()),
            "examples": int(labels.shape[0])}


def predict_trainer(ranks: int = 1):
    """An HF ``Trainer`` (untrained tiny Llama) evaluating :data:`PREDICT_ROWS` rows with :func:`label_metrics`,
    :data:`EVAL_BATCH` examples per rank and batch (``ranks``: the one-process reference's batch holds every rank's)."""
    import datasets
    from transformers import Trainer, TrainingArguments

    from tests.test_distributed import load_example

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=EVAL_BATCH * ranks,
                             report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    return Trainer(model=load_example().tiny_llama(), args=args, compute_metrics=label_metrics,
                   eval_dataset=datasets.Dataset.from_list(rows(PREDICT_ROWS, 3)))


def predicted(trainer) -> dict:
    """What the ``predict`` case compares: ``predict``'s padded logits, labels and metrics, ``evaluate``'s metrics."""
    output = trainer.predict(trainer.eval_dataset)
    return {"predictions": torch.as_tensor(output.predictions), "label_ids": torch.as_tensor(output.label_ids),
            "metrics": output.metrics, "evaluate": trainer.evaluate()}


def run_predict_dp() -> dict:
    """``predict`` / ``evaluate`` with ``compute_metrics`` on 2 groups of 2 ranks (SP = 2 x DP = 2)."""
    from padfree_plugins import accelerate

    trainer = predict_trainer()
    acceleration = accelerate(trainer, SP_CONFIG_EVAL)
    result = predicted(trainer)
    acceleration.undo()
    return result


def run_predict() -> dict:
    """``predict`` / ``evaluate`` with ``compute_metrics`` under ``sequence_parallel.size: 2``; then once more with
    a deliberate fault (the group's slices joined in the wrong order), which the test must tell apart; then with an
    output that is not per token (``output_hidden_states``: a tuple), refused, and ``predict`` again after it."""
    from padfree_plugins import accelerate
    from padfree_plugins.modeling import sequence_parallel

    trainer = predict_trainer()
    acceleration = accelerate(trainer, SP_CONFIG_EVAL)
    result = predicted(trainer)
    join_slices = sequence_parallel.join_slices
    sequence_parallel.join_slices = lambda pieces: join_slices(pieces[::-1])  # the fault: the row's order lost
    try:
        output = trainer.predict(trainer.eval_dataset)
        result["faulty"] = {"predictions": torch.as_tensor(output.predictions), "metrics": output.metrics}
    finally:
        sequence_parallel.join_slices = join_slices
    config = trainer.model.config
    config.output_hidden_states = True
    try:
        trainer.predict(trainer.eval_dataset)
        result["refused"] = None
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        result["refused"] = f"{type(error).__name__}: {error}"
    config.output_hidden_states = False
    result["after_refusal"] = trainer.predict(trainer.eval_dataset).metrics
    acceleration.undo()
    result["sft"] = sft_predicted()
    return result


def sft_predicted(ranks: int | None = None) -> dict:
    """TRL ``SFTTrainer``'s ``predict`` / ``evaluate`` with :func:`label_metrics` (the untrained model of the
    ``sft`` case, on its evaluation rows; ``ranks``: the one-process reference), as :func:`predicted`."""
    trainer, acceleration = make_trainer("sft", tempfile.mkdtemp(), TRAINER_CONFIG if ranks else SP_CONFIG,
                                         ranks=ranks)
    trainer.compute_metrics = label_metrics
    result = predicted(trainer)
    acceleration.undo()
    return result


def rows(n: int, seed: int, longest: int = 40) -> list[dict]:
    """Random examples of 2..longest tokens; a random prefix of each is a prompt (labels -100)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, longest, (1,), generator=generator))
        ids = torch.randint(3, 256, (length,), generator=generator).tolist()
        prompt = int(torch.randint(0, length // 2 + 1, (1,), generator=generator))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def tiny_moe():
    """A tiny Qwen3-MoE (4 experts, top-2) trained with its load-balancing loss; routers of weights ~1 (not 0.02),
    so that no token's top-k pick is near a tie (the test asserts the gaps)."""
    from padfree_plugins.testing.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", "causal_lm", vocab_size=256, output_router_logits=True, router_aux_loss_coef=0.5)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0.0, 1.0)
    return model


def tiny_kv2():
    """The example's tiny Llama with 6 attention heads and 2 key / value heads (head dim 8)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024))


def make_model(case: str):
    from tests.test_distributed import load_example

    model = ALL_CASES[case].get("model")
    return tiny_moe() if model == "moe" else tiny_kv2() if model == "kv2" else tiny_hybrid() if model == "hybrid" \
        else load_example().tiny_llama()
def tiny_hybrid():
    """A tiny Qwen3.5-shaped hybrid (gated delta rule layers around a full-attention one), its mixers forgetting
    slowly (``A_log`` at log(0.01), ``dt_bias`` at -4), so that the state passed across a cut matters."""
    from padfree_plugins.testing.models import tiny_model
    from tests.hybrids_common import slow

    torch.manual_seed(0)
    return slow(tiny_model("qwen3_5_text", "causal_lm", vocab_size=256))


def make_trainer(case: str, output_dir: str, config: dict, *, ranks: int | None = None):
    """The trainer of ``case``, accelerated with ``config``. ``ranks``: the one-process reference, trained on the
    global batches of that many ranks (their plan, every rank's micro-batches of a step accumulated; under
    ``split_batches``, the global batch itself)."""
    import datasets
    import trl
    from transformers import Trainer, TrainingArguments

    from padfree_plugins import accelerate
    from padfree_plugins.batching.sampler import token_budget_dataloader
    from padfree_plugins.data.tokenizer import train_tokenizer
    spec = ALL_CASES[case]
    split = spec.get("split_batches", False)
    accumulation = spec["accumulation"] * (1 if split else ranks or 1)
    settings = dict(output_dir=output_dir, num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="constant",
                    gradient_accumulation_steps=accumulation, gradient_checkpointing=spec["checkpointing"],
                    per_device_train_batch_size=SPLIT_BATCH if split else 2,
                    per_device_eval_batch_size=SPLIT_BATCH if split else EVAL_BATCH * (ranks or 1),
                    logging_steps=1, save_strategy="no",
                    report_to="none", seed=0, disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    if split and ranks is None:  # the run on 2 processes: accelerate splits every global batch across the ranks
        settings["accelerator_config"] = {"split_batches": True}
    if "optim" in spec:
        settings.update(optim=spec["optim"], learning_rate=spec["lr"], max_grad_norm=0.0)
    if spec.get("deepspeed") and ranks is None:  # the sharded run; the one-process reference is plain
        settings["deepspeed"] = ZERO3
    if spec["strategy"] == "examples":  # per_device_train_batch_size examples per micro-batch, 4 steps
        config = {key: value for key, value in config.items() if key != "batching"}
        settings["max_steps"] = 4
    model = make_model(case)
    train, evaluation = datasets.Dataset.from_list(rows(64, 0)), datasets.Dataset.from_list(rows(8, 1))
    if spec["kind"] == "sft":
        tokenizer = train_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=280)
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(bf16=False, **settings), train_dataset=train,
                                 eval_dataset=evaluation, processing_class=tokenizer)
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=train,
                          eval_dataset=evaluation)
    acceleration = accelerate(trainer, config)
    if ranks is not None and spec["strategy"] == "tokens":  # the plan of `ranks` replicas in one process
        loader = token_budget_dataloader(trainer.train_dataset, trainer.data_collator, config, num_replicas=ranks)
        trainer.get_train_dataloader = lambda: trainer.accelerator.prepare(loader)
    return trainer, acceleration


def trainer_result(trainer) -> dict:
    """What the test compares: logged losses, num_tokens (SFT), final weights, eval_loss."""
    history = trainer.state.log_history
    return {"losses": [entry["loss"] for entry in history if "loss" in entry],
            "num_tokens": [entry["num_tokens"] for entry in history if "num_tokens" in entry and "loss" in entry],
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
            "eval_loss": trainer.evaluate()["eval_loss"]}


class TokenCounts:
    """The tokens each call of the embeddings and of the LM head saw on this rank, in training, and the tokens and
    examples of the rank's own micro-batches (:meth:`own`)."""

    def __init__(self, model) -> None:
        self.embedded, self.projected, self.micro_batches, self.examples = [], [], [], []
        self.handles = [
            model.get_input_embeddings().register_forward_hook(
                lambda module, args, output: self.embedded.append(args[0].shape[-1]) if module.training else None),
            model.lm_head.register_forward_hook(
                lambda module, args, output: self.projected.append(args[0].shape[-2]) if module.training else None),
        ]

    def own(self, batch) -> None:
        self.micro_batches.append(batch["input_ids"].shape[-1])
        self.examples.append(batch["cu_seq_lens_q"].numel() - 1)

    def remove(self) -> dict:
        for handle in self.handles:
            handle.remove()
        return {"embedded": self.embedded, "projected": self.projected, "micro_batches": self.micro_batches,
                "examples": self.examples}


def run_trainer(case: str) -> dict:
    config = {**TRAINER_CONFIG, "sequence_parallel": {"size": ALL_CASES[case].get("sp", 2)}}
    trainer, acceleration = make_trainer(case, tempfile.mkdtemp(), config)
    counts = TokenCounts(acceleration.assembly.model)
    forward = acceleration.assembly.forward
    acceleration.assembly.forward = lambda model, batch, **kwargs: counts.own(batch) or forward(model, batch, **kwargs)
    trainer.train()
    acceleration.assembly.forward = forward
    seen = counts.remove()
    result = trainer_result(trainer)
    result["labelled_logits"] = bool(getattr(trainer.data_collator, "labelled_logits", False))
    result["split_batches"] = trainer.accelerator.split_batches
    result["implementation"] = acceleration.assembly.model.config._attn_implementation
    result["split_mixers"] = sum(type(module.__dict__.get("forward")).__name__ == "SplitMixer"
                                 for module in acceleration.assembly.model.modules())
    if ALL_CASES[case]["kind"] == "sft":
        result["uncounted"] = uncounted_sft_loss(trainer)
    result["seen"] = gathered(seen)
    acceleration.undo()
    return result


def uncounted_sft_loss(trainer) -> dict:
    """SFTTrainer's loss of one micro-batch per rank without ``num_items_in_batch`` (a model that takes no loss
    kwargs): the mean over ranks (as the trainer logs it), and the rows the ranks held (for the reference: the
    joined row's mean)."""
    examples = rows(6, 2)
    rank = dist.get_rank()
    mine = examples[:4] if rank == 0 else examples[4:]
    batch = trainer._prepare_inputs(trainer.data_collator(mine))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).detach()
    dist.all_reduce(loss)
    return {"loss": loss.item() / dist.get_world_size(), "examples": examples}


def gathered(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def run_loop() -> dict:
    """examples/accelerate_loop.py's ``train`` with its config plus ``sequence_parallel.size: 2``."""
    from accelerate import Accelerator

    from tests.test_distributed import LOOP_ARGS, load_example

    loop = load_example()
    out = Path(tempfile.mkdtemp()) / "loop.json"
    args = loop.parse_args([*LOOP_ARGS, "--out", str(out)])
    args.config = {**_yaml(args.config), "sequence_parallel": {"size": 2}}
    made = []
    tiny_llama = loop.tiny_llama
    loop.tiny_llama = lambda: made.append(tiny_llama()) or made[-1]
    losses = loop.train(Accelerator(cpu=True), args)
    return {"losses": losses, "state": {name: p.detach().clone() for name, p in made[0].named_parameters()},
            "tokens": json.loads(out.read_text())["tokens"] if out.exists() else None}


def _yaml(path: str) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def main(out: str, cases: list[str]) -> None:
    from accelerate import PartialState

    PartialState(cpu=True)  # the gloo process group
    runs = {"loop": run_loop, "predict": run_predict, "predict-dp": run_predict_dp}
    four = bool(cases) and all(case in (*SP4_CASES, "predict-dp") for case in cases)
    if dist.get_world_size() != (4 if four else 2):
        sys.exit("launch with torchrun --nproc_per_node 2 (predict-dp and the SP4 cases, without others: 4)")
    unknown = [case for case in cases if case not in (*ALL_CASES, *runs)]
    if unknown:
        sys.exit(f"unknown cases {unknown}: choose from {[*ALL_CASES, *runs]}")
    results = {case: runs[case]() if case in runs else run_trainer(case) for case in cases}
    finish(results, out, destroy=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    leave()
