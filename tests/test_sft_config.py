"""TRL ``SFTConfig`` fields and ``SFTTrainer`` arguments through ``accelerate()``: each run trains the loss curve of
TRL's own padded run and logs the same metrics (``mean_token_accuracy``, ``entropy``, ``num_tokens``, MoE
``aux_loss``), step by step.

Every case builds the same tiny Llama twice (same seed, same data order): padded, as TRL trains it, and padding-free.
"""

from __future__ import annotations

import copy
import json
import tempfile
import warnings

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from padfree_plugins import accelerate
from tests.conftest import tiny_config
from tests.test_trainer import rows, tokenizer
from tests.ties import CLEAR, excess_over_flips, flip_shares, recording_token_margins, top2_gaps

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

STEPS = 4
TEXT = [{"text": f"some text number {i} " * (1 + i % 5), "source": i} for i in range(24)]
PROMPT_COMPLETION = [{"prompt": f"question {i} about tiny things", "completion": f" answer {i} " * (1 + i % 4)}
                     for i in range(24)]
TEMPLATE = ("{% if tools %}T:{{ tools | length }}{% endif %}{% for m in messages %}"
            "{% if m['role'] == 'assistant' %}A:{% generation %}{{ m['content'] }}"
            "{% if m.get('tool_calls') %}C:{{ m['tool_calls'][0]['function']['name'] }}{% endif %}{% endgeneration %}"
            "{% elif m['role'] == 'tool' %}R:{{ m['content'] }}{% else %}U:{{ m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")
TOOLS = json.dumps([{"type": "function", "function": {"name": "get", "description": "d",
                                                      "parameters": {"type": "object", "properties": {}}}}])
TOOL_CALLS = [{"messages": [{"role": "user", "content": f"q {i}"},
                            {"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{}"}}]},
                            {"role": "tool", "content": f"r {i}"},
                            {"role": "assistant", "content": f"a {i} " * (1 + i % 3)}], "tools": TOOLS}
              for i in range(24)]
CONVERSATIONAL_PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": f"question {i} about things"}],
     "completion": [{"role": "assistant", "content": f" answer {i} " * (1 + i % 4)}]} for i in range(24)]


def chat_tokenizer():
    chat = copy.deepcopy(tokenizer())
    chat.chat_template = TEMPLATE
    return chat


def llama(**overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2, vocab_size=300, **overrides),
                                            attn_implementation="sdpa")


def mixtral():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2,
                                                        vocab_size=300), attn_implementation="sdpa")


def saved_llama():
    directory = tempfile.mkdtemp()
    llama().save_pretrained(directory)
    return directory


def sft_runs(train, processing_class=None, model=llama, trainer_kwargs=None, eval_dataset=None, **sft):
    """TRL's padded run, then the padding-free one: ``{packed: trainer}`` after ``STEPS`` training steps."""
    trainers = {}
    for packed in (False, True):
        settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                        per_device_eval_batch_size=3, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                        report_to="none", seed=0, disable_tqdm=True, bf16=False, dataloader_pin_memory=False)
        trainer = trl.SFTTrainer(model=model(), args=trl.SFTConfig(**{**settings, **sft}),
                                 train_dataset=datasets.Dataset.from_list(train), eval_dataset=eval_dataset,
                                 processing_class=processing_class or tokenizer(), **(trainer_kwargs or {}))
        if packed:
            accelerate(trainer, {"task": "causal_lm"})
            trainer.train()
        else:
            with recording_token_margins(trainer.model) as margins:
                trainer.train()
            trainer.token_margins = [torch.cat(rows) for rows in margins]  # the label margins of each forward
        trainers[packed] = trainer
    return trainers


def token_shares(trainer) -> list[float]:
    """Per logged step of a padded run of :func:`sft_runs`, the share of its counted tokens whose
    ``mean_token_accuracy`` rounding could flip (:func:`tests.ties.flip_shares`)."""
    return flip_shares(trainer.token_margins, len(trainer.token_margins) // len(train_logs(trainer)))


METRICS = ("loss", "mean_token_accuracy", "entropy", "num_tokens", "aux_loss")


def assert_same_logs(want: list[dict], got: list[dict], shares: list[float]) -> None:
    """Same logged keys (no metric missing), loss within 1e-4, metrics within 1e-4 (num_tokens exact),
    ``mean_token_accuracy`` exactly but for the tokens whose label margin is within rounding (``shares``:
    :func:`token_shares`)."""
    assert len(got) == len(want) > 0
    for step, (a, b) in enumerate(zip(want, got)):
        assert set(b) == set(a), f"step {step}: logged {sorted(b)}, TRL logs {sorted(a)}"
        for name in METRICS:
            if name in a and name != "mean_token_accuracy":
                assert b[name] == pytest.approx(a[name], abs=0 if name == "num_tokens" else 1e-4), (step, name)
    accuracies = [[entry["mean_token_accuracy"] for entry in run] for run in (got, want)]
    assert excess_over_flips(*accuracies, shares, "mean_token_accuracy") <= 1e-6, (*accuracies, shares)


def train_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def compute_loss_func(outputs, labels, num_items_in_batch=None):
    """Cross-entropy from the logits, summed over the accumulated batch's labelled tokens."""
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


CASES = {
    "label-smoothing": dict(label_smoothing_factor=0.1),
    "compute-loss-func": dict(trainer_kwargs={"compute_loss_func": compute_loss_func}),
    "moe-label-smoothing": dict(model=mixtral, label_smoothing_factor=0.1),
    "moe-router-aux-loss-coef": dict(model=mixtral, router_aux_loss_coef=0.5),
    "max-length-keep-start": dict(max_length=12),
    "max-length-keep-end": dict(max_length=12, truncation_mode="keep_end"),
    "packing-bfd": dict(packing=True, max_length=40),
    "packing-bfd-split": dict(packing=True, max_length=20, packing_strategy="bfd_split"),
    "packing-wrapped": dict(packing=True, max_length=32, packing_strategy="wrapped"),
    "pad-to-multiple-of": dict(pad_to_multiple_of=16),
    "packing-bfd-pad-to-multiple-of": dict(packing=True, max_length=40, pad_to_multiple_of=16),
    "padding-free-pad-to-multiple-of": dict(padding_free=True, max_length=None, pad_to_multiple_of=16),
    "dataset-text-field": dict(train=[{"body": row["text"]} for row in TEXT], dataset_text_field="body"),
    "prompt-completion": dict(train=PROMPT_COMPLETION),
    "prompt-completion-full-loss": dict(train=PROMPT_COMPLETION, completion_only_loss=False),
    "conversational-prompt-completion": dict(train=CONVERSATIONAL_PROMPT_COMPLETION,
                                             processing_class=chat_tokenizer()),
    "tool-calls-assistant-only": dict(train=TOOL_CALLS, processing_class=chat_tokenizer(), assistant_only_loss=True),
    "skip-prepare-dataset": dict(train=[{k: r[k] for k in ("input_ids", "labels")} for r in rows(24)],
                                 dataset_kwargs={"skip_prepare_dataset": True}),
    "peft-config": dict(trainer_kwargs={"peft_config": peft.LoraConfig(r=4, lora_alpha=8,
                                                                       target_modules=["q_proj", "v_proj"])}),
    "model-path-with-init-kwargs": dict(model=saved_llama,
                                        model_init_kwargs={"dtype": "float32", "attn_implementation": "eager"}),
    "eos-token-and-shuffle": dict(eos_token="a", shuffle_dataset=True),
    "chunked-nll-alias": dict(loss_type="chunked_nll"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sft_config_trains_trls_padded_curve_with_its_metrics(case):
    case = dict(case)
    trainers = sft_runs(case.pop("train", TEXT), **case)
    want = train_logs(trainers[False])
    assert_same_logs(want, train_logs(trainers[True]), token_shares(trainers[False]))
    assert {"mean_token_accuracy", "entropy", "num_tokens"} <= set(want[0])
    assert ("aux_loss" in want[0]) == (case.get("model") is mixtral)


def test_evaluation_metrics_with_label_smoothing_and_an_eval_dataset_dict():
    """``eval_dataset`` as a dict: each set's loss, and TRL's eval metrics, as padded TRL (label smoothing on)."""
    evals = {"a": datasets.Dataset.from_list(TEXT[:7]), "b": datasets.Dataset.from_list(TEXT[10:15])}
    trainers = sft_runs(TEXT, eval_dataset=evals, label_smoothing_factor=0.1)
    with recording_token_margins(trainers[False].model) as margins:
        want = trainers[False].evaluate()
    got = trainers[True].evaluate()
    assert {"eval_a_loss", "eval_b_loss", "eval_mean_token_accuracy", "eval_entropy", "eval_num_tokens"} <= set(want)
    assert set(got) == set(want)
    for name in ("eval_a_loss", "eval_b_loss", "eval_entropy", "eval_num_tokens"):
        assert got[name] == pytest.approx(want[name], abs=1e-5), name
    # a mean of the evaluation batches' accuracies: it moves at most by the largest batch's share of near-ties
    share = max(flip_shares([torch.cat(rows) for rows in margins], 1))
    assert excess_over_flips([got["eval_mean_token_accuracy"]], [want["eval_mean_token_accuracy"]], [share],
                             "eval_mean_token_accuracy") <= 1e-6


def test_chat_template_path_with_assistant_only_loss(tmp_path):
    """``chat_template_path`` (a .jinja file) on multi-turn conversations: TRL's assistant masks survive packing."""
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    conversations = [{"messages": [{"role": "user", "content": f"q {i}"},
                                   {"role": "assistant", "content": f"a {i} " * (1 + i % 3)},
                                   {"role": "user", "content": f"more {i}"},
                                   {"role": "assistant", "content": f"b {i} " * (1 + i % 2)}]} for i in range(24)]
    trainers = sft_runs(conversations, chat_template_path=str(path), assistant_only_loss=True)
    assert_same_logs(train_logs(trainers[False]), train_logs(trainers[True]), token_shares(trainers[False]))
    labels = trainers[True].train_dataset[0]["labels"]
    assert -100 in labels and any(label != -100 for label in labels)


def test_eval_packing_without_packing_is_said_at_accelerate():
    """``eval_packing=True, packing=False``: TRL's padded collator lets a packed eval row's examples attend to each
    other; padding-free evaluation keeps them apart, so eval_loss differs from TRL's — said by a warning."""
    def trainer(**sft):
        args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), report_to="none", bf16=False, max_length=40, **sft)
        return trl.SFTTrainer(model=llama(), args=args, train_dataset=datasets.Dataset.from_list(TEXT),
                              eval_dataset=datasets.Dataset.from_list(TEXT[:7]), processing_class=tokenizer())

    with pytest.warns(UserWarning, match="eval_packing=True with packing=False"):
        accelerate(trainer(eval_packing=True), {"task": "causal_lm"})
    for quiet in (dict(eval_packing=True, packing=True), dict(eval_packing=True, packing=True, padding_free=True),
                  dict(eval_packing=False)):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="eval_packing")
            accelerate(trainer(**quiet), {"task": "causal_lm"})


def test_predict_and_metrics_on_preprocessed_logits_equal_padded():
    """``preprocess_logits_for_metrics`` (argmax) and ``compute_metrics`` see TRL's shapes; ``predict`` returns the
    padded run's predictions (where a label counts) and loss."""
    def accuracy(prediction):
        labels = prediction.label_ids[:, 1:]
        counted = labels != -100
        return {"accuracy": float((prediction.predictions[:, :-1] == labels)[counted].mean())}

    kwargs = {"compute_metrics": accuracy, "preprocess_logits_for_metrics": lambda logits, labels: logits.argmax(-1)}
    trainers = sft_runs(TEXT, eval_dataset=datasets.Dataset.from_list(TEXT[:7]), trainer_kwargs=kwargs)
    gaps = []  # of each padded batch: where its argmax could flip (top2_gaps), padded with +inf as Trainer pads
    def record(module, args, output):
        if getattr(output, "logits", None) is not None:  # not TRL's fused forwards (its metrics)
            gaps.append(top2_gaps(output.logits))

    handle = trainers[False].model.register_forward_hook(record)
    try:
        want = trainers[False].predict(trainers[False].eval_dataset)
    finally:
        handle.remove()
    got = trainers[True].predict(trainers[True].eval_dataset)
    assert got.predictions.shape == want.predictions.shape and got.label_ids.shape == want.label_ids.shape
    width = want.predictions.shape[1]
    gaps = torch.cat([torch.nn.functional.pad(g, (0, width - g.shape[1]), value=float("inf")) for g in gaps]).numpy()
    counted = want.label_ids[:, 1:] != -100
    near = counted & (gaps[:, :-1] < CLEAR)  # the only argmaxes, and so accuracies, rounding could flip
    assert counted.sum() > 50 and near.sum() <= counted.sum() / 4
    differ = counted & (got.predictions[:, :-1] != want.predictions[:, :-1])
    assert not (differ & ~near).any(), "a prediction clear of any tie differs from the padded one"
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], abs=1e-5)
    assert abs(got.metrics["test_accuracy"] - want.metrics["test_accuracy"]) <= near.sum() / counted.sum() + 1e-6


#: Examples of 20 to 130 tokens: TRL packs them into rows longer than the tiny Llama takes (256 positions).
LONG_TEXT = [{"text": f"text {i} " * (8 + i % 12)} for i in range(24)]


def test_packed_rows_longer_than_the_model_takes_train_by_their_examples():
    """TRL ``packing=True`` rows of several examples, each under ``max_position_embeddings`` (256), the rows over it:
    accepted (each example is counted by its own ``seq_lengths``) and trained as TRL's padded run trains them."""
    trainers = sft_runs(LONG_TEXT, packing=True, max_length=400)
    rows = trainers[True].train_dataset
    assert max(map(len, rows["input_ids"])) > 256 >= max(map(max, rows["seq_lengths"]))
    assert_same_logs(train_logs(trainers[False]), train_logs(trainers[True]), token_shares(trainers[False]))


def test_a_packed_example_longer_than_the_model_takes_is_refused():
    """One example over the model's 256 positions inside a TRL packed row: refused before training, naming it."""
    from padfree_plugins import BatchError

    long = [*LONG_TEXT[:5], {"text": "word " * 300}, *LONG_TEXT[5:]]
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), report_to="none", bf16=False, packing=True, max_length=400)
    trainer = trl.SFTTrainer(model=llama(), args=args, train_dataset=datasets.Dataset.from_list(long),
                             processing_class=tokenizer())
    collator = trainer.data_collator
    with pytest.raises(BatchError, match=r"example \d+ of row \d+ of the train dataset \(its rows hold several "
                                         r"examples: seq_lengths\) has \d+ tokens but the model takes at most 256"):
        accelerate(trainer, {"task": "causal_lm"})
    assert trainer.data_collator is collator
