"""torchrun worker of tests/test_sequence_parallel_pooled.py: the tasks that pool whole examples — ``seq_cls`` on a
tiny BERT (CLS -> pooler), a tiny ModernBERT (mean pooling, local / global attention windows) and a tiny Llama
(GQA; last token -> score), ``embedding``
(MultipleNegativesRankingLoss, mean pooling) and ``reranker`` (a BERT cross-encoder on sentence pairs) — trained
by HF ``Trainer`` with ``sequence_parallel: {size: 2}`` on 2 CPU processes (gloo), or on 4 (SP = 2 x DP = 2: two
groups, each rank its own micro-batches).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_pooled_run.py \
        OUT CASE [CASE ...]

``CASE`` is a key of :data:`CASES`, or one with ``+fault`` appended: the same run inside
:func:`padfree_plugins.testing.faults.pooling_reads_local_slice`. Rank 0 writes ``{case: result}`` to ``OUT``
(torch.save): the logged losses, every parameter's gradient at every optimizer step, the final weights,
``predict``'s predictions, and what shows each rank computed half of the group's row with examples across the cut.
The one-process reference (the same trainer, both ranks' micro-batches of a step accumulated) is the test's.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from tests.distributed_common import finish, leave

#: The cases: the model (``tests.tasks_common.model_for`` name, head and overrides), the padfree config, the rows,
#: the SGD learning rate (the weights move far more than the tolerance, the losses stay finite).
CASES = {
    "bert-seq_cls": {"model": ("bert", "seq_cls", {"num_labels": 3}), "config": {"task": "seq_cls"},
                     "rows": "classes", "lr": 0.05},
    "modernbert-seq_cls": {"model": ("modernbert", "seq_cls", {"num_labels": 3, "classifier_pooling": "mean"}),
                           "config": {"task": "seq_cls"}, "rows": "classes", "lr": 0.01},
    "llama-seq_cls": {"model": ("llama", "seq_cls", {"num_labels": 3, "num_key_value_heads": 2}),
                      "config": {"task": "seq_cls"}, "rows": "classes", "lr": 0.05},
    "bert-embedding": {"model": ("bert", "base", {}),
                       "config": {"task": "embedding", "pooling": "mean",
                                  "task_options": {"loss": "MultipleNegativesRankingLoss"}},
                       "rows": "pairs", "lr": 0.2},
    "bert-reranker": {"model": ("bert", "seq_cls", {"num_labels": 1}), "config": {"task": "reranker"},
                      "rows": "scored_pairs", "lr": 0.5},
}
FAULT = "+fault"
BATCH = 2  # examples per rank and micro-batch
STEPS = 4
#: Every row once: BATCH x the ranks (the reference: their micro-batches accumulated) x STEPS.
def train_rows(ranks: int) -> int:
    return BATCH * ranks * STEPS
EVAL_ROWS = 8
NO_DROPOUT = {"bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, "modernbert": {},
              "llama": {}}


def rows(kind: str, n: int, seed: int) -> list[dict]:
    """``n`` rows of 2..40 tokens: a class label (``classes``), anchor / positive texts (``pairs``), or a sentence
    pair with token types and a 0 / 1 relevance label (``scored_pairs``)."""
    from tests.tasks_common import pair_examples
    from tests.conftest import make_examples

    generator = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(2, 41, (2 * n,), generator=generator)]
    if kind == "pairs":
        texts = make_examples(lengths, seed=seed)
        return [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"]}
                for a, b in zip(texts[::2], texts[1::2])]
    if kind == "scored_pairs":
        return [{**example, "label": float(i % 2)} for i, example in enumerate(pair_examples(lengths[:n], seed))]
    return [{**example, "label": i % 3} for i, example in enumerate(make_examples(lengths[:n], seed=seed))]


def make_model(case: str):
    from tests.tasks_common import model_for

    name, head, overrides = CASES[case]["model"]
    return model_for(name, head=head, **overrides, **NO_DROPOUT[name])


def make_trainer(case: str, output_dir: str, *, ranks: int | None = None):
    """The HF ``Trainer`` of ``case`` (SGD, no clipping, :data:`STEPS` steps of :data:`BATCH` examples per rank),
    accelerated with its config (plus ``sequence_parallel.size: 2`` unless ``ranks``: the one-process reference,
    which accumulates ``ranks`` micro-batches per step)."""
    import datasets
    from transformers import Trainer, TrainingArguments

    from padfree_plugins import accelerate

    spec = CASES[case]
    config = {**spec["config"], "attention": "exact"}
    if ranks is None:
        config["sequence_parallel"] = {"size": 2}
    args = TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ranks or 1, optim="sgd", learning_rate=spec["lr"], lr_scheduler_type="constant",
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
        use_cpu=True, dataloader_pin_memory=False)
    trainer = Trainer(model=make_model(case), args=args,
                      train_dataset=datasets.Dataset.from_list(rows(spec["rows"],
                                                                    train_rows(ranks or dist.get_world_size()), 0)),
                      eval_dataset=datasets.Dataset.from_list(rows(spec["rows"], EVAL_ROWS, 1)))
    trainer.add_callback(GradientRecorder())
    return trainer, accelerate(trainer, config)


class GradientRecorder(TrainerCallback):
    """Every parameter's gradient before each optimizer step (after DDP's all-reduce)."""

    def __init__(self) -> None:
        self.grads: list[dict] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()
                           if p.grad is not None})


def recorder(trainer) -> GradientRecorder:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, GradientRecorder))


def result_of(trainer) -> dict:
    """What the test compares: logged losses, gradients per step, final weights, ``predict``'s predictions."""
    history = trainer.state.log_history
    predictions = trainer.predict(trainer.eval_dataset).predictions
    return {"losses": [entry["loss"] for entry in history if "loss" in entry],
            "grads": recorder(trainer).grads,
            "state": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
            "predictions": predictions}


def run_case(case: str) -> dict:
    from padfree_plugins.testing.faults import pooling_reads_local_slice

    name = case.removesuffix(FAULT)
    trainer, acceleration = make_trainer(name, tempfile.mkdtemp())
    embedded, own = [], []
    hook = acceleration.assembly.model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: embedded.append(args[0].shape[-1]) if module.training else None)
    forward = acceleration.assembly.forward
    acceleration.assembly.forward = (
        lambda model, batch, **kwargs: own.append(batch["cu_seq_lens_q"].tolist()) or forward(model, batch, **kwargs))
    with pooling_reads_local_slice() if case.endswith(FAULT) else contextlib.nullcontext():
        trainer.train()
        hook.remove()
        acceleration.assembly.forward = forward
        result = result_of(trainer)
    acceleration.undo()
    result["embedded"], result["own"] = gathered(embedded), gathered(own)
    return result


def gathered(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def main(out: str, cases: list[str]) -> None:
    from accelerate import PartialState

    PartialState(cpu=True)  # the gloo process group
    if dist.get_world_size() not in (2, 4):
        sys.exit("launch with torchrun --nproc_per_node 2 (one group) or 4 (SP = 2 x DP = 2)")
    unknown = [case for case in cases if case.removesuffix(FAULT) not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}: choose from {list(CASES)} (+fault)")
    results = {case: run_case(case) for case in cases}
    finish(results, out, destroy=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    leave()
