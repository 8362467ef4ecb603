"""What a new user found accepted without a word (a token budget the default strategy ignores, a plugin given by
name, ``DataParallel``, a stray token id sizing a huge model) or answered with a raw error (untokenized text, plain
rows for the embedding task, float labels on a classifier, bad ``train`` flags, ``pooling: avg``), and a
``train --help`` of 528 lines."""

from __future__ import annotations

import json
import re
import tempfile
import types

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments
from typer.testing import CliRunner

from padfree_plugins import BatchError, ConfigError, PadfreeError, PluginError, accelerate, assemble, plan
from padfree_plugins.cli import app
from padfree_plugins.config.schema import load_config
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.recipes.train import TRAINING_ARGUMENTS_DOCS, run_train
from tests.conftest import tiny_config, tiny_model


def invoke_train(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def trainer_on(model, rows) -> Trainer:
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="padfree-errors-"), report_to="none", use_cpu=True,
                             max_steps=1, dataloader_pin_memory=False)
    return Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))


# -- silent acceptances ---------------------------------------------------------------------------------------------


def test_a_token_budget_under_the_examples_strategy_is_an_error_that_says_what_to_set():
    with pytest.raises(ConfigError) as info:
        load_config({"batching": {"max_tokens_per_batch": 4096}})
    message = str(info.value)
    assert "batching.max_tokens_per_batch: 4096 is set, but strategy is examples" in message
    assert "add strategy: tokens" in message
    assert load_config({"batching": {"strategy": "tokens", "max_tokens_per_batch": 4096}}).batching.strategy == \
        "tokens"


def test_a_plugin_given_by_its_module_name_is_refused():
    with pytest.raises(PluginError) as info:
        PluginHost({"x": "some.module"}, entry_points=False)
    message = str(info.value)
    assert "plugin 'x' is given as 'some.module', a name, not the plugin" in message
    assert "import some.module, then {'x': some.module}" in message and "entry point" in message
    host = PluginHost({"x": types.SimpleNamespace(register_tasks=lambda: [])}, entry_points=False)
    assert host.records["x"].status == "ok"  # an object with hooks still loads


@pytest.mark.parametrize("wrap", [torch.nn.DataParallel, lambda m: torch.compile(torch.nn.DataParallel(m))],
                         ids=["DataParallel", "compiled DataParallel"])
def test_data_parallel_is_refused_before_anything_is_patched(wrap):
    model = tiny_model("llama", "causal_lm")
    with pytest.raises(PadfreeError) as info:
        assemble(wrap(model))
    message = str(info.value)
    assert "torch.nn.DataParallel splits a batch by rows" in message and "model.module" in message
    assert "torchrun" in message
    assemble(model).undo()  # left unpatched: it assembles as usual


def test_a_stray_token_id_does_not_size_the_default_model(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8]} for _ in range(12)]
    rows[7] = {"input_ids": [5, 400_000, 7]}
    with pytest.raises(ConfigError) as info:
        run_train(["--dataset", write_jsonl(tmp_path / "stray.jsonl", rows)], print_fn=None)
    message = str(info.value)
    assert "example 7 of the dataset holds token id 400000" in message
    assert "400,001 tokens here, more than any common tokenizer's (262,144)" in message
    assert "--tokenizer_name_or_path" in message and "--model_config" in message


def test_ids_beyond_the_tokenizer_are_refused_and_a_data_sized_vocabulary_is_said(tmp_path):
    from padfree_plugins.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["hello world, a tokenizer of a few hundred tokens"] * 20, 300)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = [{"input_ids": [5, 6, 7, 8]} for _ in range(12)]
    rows[3] = {"input_ids": [5, 600, 7]}
    data = write_jsonl(tmp_path / "ids.jsonl", rows)
    with pytest.raises(ConfigError) as info:
        run_train(["--dataset", data, "--tokenizer_name_or_path", str(tmp_path / "tokenizer")], print_fn=None)
    assert (f"example 3 of the dataset: input_ids holds 600, outside the tokenizer's vocabulary [0, {len(tokenizer)}); "
            "were these rows tokenized with another tokenizer?") in str(info.value)
    lines = []
    report = run_train(["--dataset", data, "--max_steps", "1", "--eval_fraction", "0"], print_fn=lines.append)
    assert "vocabulary: 601 token ids, sized from the largest id in the dataset (no tokenizer)" in lines
    assert report.setup["model"].startswith("LlamaForCausalLM (0.")  # 601 x 128 embeddings: under 1M parameters


# -- raw or misleading errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, message", [
    ([{"text": "hello world", "label": 0}, {"text": "foo bar", "label": 1}],
     "the train dataset has text ('text'), not input_ids: tokenize it first: dataset = dataset.map(lambda row: "
     "tokenizer(row[\"text\"]), remove_columns=[\"text\"])"),
    ([{"input_ids": "hello world"}, {"input_ids": "foo bar"}],
     "the train dataset's 'input_ids' column holds text (strings), not token ids: tokenize it first: "),
    ([{"prompt": "hi", "completion": "there"}, {"prompt": "a", "completion": "b"}],
     "or train with TRL's SFTTrainer, which tokenizes prompt + completion rows itself"),
], ids=["text column", "text in input_ids", "prompt + completion"])
def test_untokenized_text_through_accelerate_says_tokenize_it_first(rows, message):
    """Not hf_trainer's crash on an Arrow string column, nor HF's "no columns match the model" at train()."""
    trainer = trainer_on(tiny_model("llama", "causal_lm"), rows)
    with pytest.raises(BatchError) as info:
        accelerate(trainer)
    assert message in str(info.value)
    assert "hf_trainer" not in str(info.value) and "Arrow" not in str(info.value)


def test_untokenized_text_for_the_embedding_task_names_its_columns():
    trainer = trainer_on(tiny_model("bert"), [{"anchor": "a b", "positive": "c d"}, {"anchor": "e", "positive": "f"}])
    with pytest.raises(BatchError) as info:
        accelerate(trainer, {"task": "embedding", "task_options": {"loss": "MultipleNegativesRankingLoss"}})
    assert ('dataset = dataset.map(lambda row: {f"{c}_input_ids": tokenizer(row[c])["input_ids"] for c in '
            '("anchor", "positive")}, remove_columns=["anchor", "positive"])') in str(info.value)


@pytest.mark.parametrize("loss", ["MultipleNegativesRankingLoss", "CoSENTLoss", "TripletLoss"])
def test_the_embedding_task_on_plain_input_ids_rows_says_which_columns_it_needs(loss):
    assembly = assemble(tiny_model("bert"), {"task": "embedding", "task_options": {"loss": loss}})
    batch = assembly.collator([{"input_ids": [1, 5, 6, 2], "label": 1.0}, {"input_ids": [1, 7, 8, 9, 2], "label": 0.0}])
    with pytest.raises(BatchError) as info:
        assembly.forward(assembly.model, batch)
    message = str(info.value)
    assert f"{loss} compares the texts of a row" in message and "plain 'input_ids' is one column" in message
    assert "anchor_input_ids, positive_input_ids" in message
    assert "Expected at least 2 embeddings" not in message


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_float_labels_on_a_two_class_model_explain_classes_and_regression(model_type):
    assembly = assemble(tiny_model(model_type, "seq_cls", num_labels=2), {"task": "seq_cls"})
    rows = [{"input_ids": [1, 5, 6, 2], "label": 0.0}, {"input_ids": [1, 7, 8, 9, 2], "label": 1.0}]
    with pytest.raises(BatchError) as info:
        assembly.forward(assembly.model, assembly.collator(rows))
    message = str(info.value)
    assert "the labels are floats, one per example, but the model has num_labels=2" in message
    assert "integer class labels (0 to 1" in message and "num_labels=1" in message
    assert "Target size" not in message
    rows = [{**row, "label": int(row["label"])} for row in rows]  # integer classes train
    assert torch.isfinite(assembly.forward(assembly.model, assembly.collator(rows)).loss)


def test_pooling_avg_suggests_mean_and_lists_the_modes():
    with pytest.raises(ConfigError) as info:
        plan(tiny_config("bert"), {"task": "embedding", "pooling": "avg"}, device_type="cpu")
    message = str(info.value)
    assert "pooling mode 'avg'" in message and "Did you mean 'mean'?" in message
    assert "Builtin modes: first, cls, last, mean, max, weighted_mean, mean_sqrt_len" in message


@pytest.mark.parametrize("args, message", [
    (["--per_device_train_batch_size", "0"], "error: --per_device_train_batch_size must be at least 1, got 0"),
    (["--gradient_accumulation_steps", "0"], "error: --gradient_accumulation_steps must be at least 1, got 0"),
    (["--truncate_to", "0"], "error: --truncate_to must be at least 1 (tokens kept per example), got 0"),
    (["--acceleration_config", "configs/embedding.yaml"],
     "sets task: embedding, but padfree-plugins train fine-tunes causal LMs only (task: causal_lm)"),
])
def test_bad_train_flags_are_named(args, message):
    result = invoke_train(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_train_for_another_task_points_to_the_python_api():
    result = invoke_train("--acceleration_config", "configs/seq_cls.yaml")
    assert "padfree_plugins.accelerate(trainer, 'configs/seq_cls.yaml')" in " ".join(result.output.split())


def test_train_help_is_short_and_lists_the_padfree_options_first(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke_train("--help")
    assert result.exit_code == 0, result.output
    text = result.output
    assert len(text.splitlines()) < 120
    own, common = text.index("\noptions:\n"), text.index("\ncommon transformers.TrainingArguments options:\n")
    assert own < common
    for flag in ("--model_name_or_path", "--dataset", "--truncate_to", "--acceleration_config", "--help-all"):
        assert own < text.index(f"  {flag} ") < common, flag
    for flag in ("--learning_rate", "--per_device_train_batch_size", "--max_steps"):
        assert text.index(f"  {flag} ") > common, flag
    assert "--adam_beta1" not in text and "--help-all lists them" in text
    assert re.search(rf"^  {re.escape(TRAINING_ARGUMENTS_DOCS)}$", text, re.MULTILINE)  # the link on one line
    everything = invoke_train("--help-all")
    assert everything.exit_code == 0 and "--adam_beta1" in everything.output
    assert len(everything.output.splitlines()) > 3 * len(text.splitlines())


def meta_llama():
    with torch.device("meta"):
        return tiny_model("llama", "causal_lm")


META = "weights are on the meta device .*load them before assemble\\(\\) / accelerate\\(\\).*to_empty"


def test_weights_on_the_meta_device_are_refused_with_how_to_load_them():
    """A model built on the meta device (never loaded) is refused at assemble(), unpatched, saying what to do, not
    reported as on cpu and then failing inside the forward; materialised and loaded, it assembles and says where its
    weights are."""
    model = meta_llama()
    with pytest.raises(PadfreeError, match=META):
        assemble(model, {"task": "causal_lm"})
    assert model.config._attn_implementation == "sdpa" and not any("forward" in vars(m) for m in model.modules())
    model.to_empty(device="cpu").load_state_dict(tiny_model("llama", "causal_lm").state_dict())
    rotary = tiny_model("llama").rotary_emb  # non-persistent buffers are not in a state dict: computed again
    model.model.rotary_emb.inv_freq, model.model.rotary_emb.original_inv_freq = rotary.inv_freq, rotary.inv_freq
    assembly = assemble(model, {"task": "causal_lm"})
    assert assembly.describe()["model device"] == "cpu"
    batch = assembly.collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert torch.isfinite(assembly.forward(model, batch).logits).all()


def test_a_trainers_model_moved_to_the_meta_device_is_refused_at_accelerate():
    trainer = trainer_on(tiny_model("llama", "causal_lm"), [{"input_ids": [5, 6, 7]}])
    trainer.model.to("meta")
    collator = trainer.data_collator
    with pytest.raises(PadfreeError, match=META):
        accelerate(trainer, {"task": "causal_lm"})
    assert trainer.data_collator is collator and "compute_loss" not in vars(trainer)


def test_weights_an_offload_hook_loads_at_each_call_are_not_refused():
    """accelerate's offloading keeps weights on meta between calls, its hook loading them for each forward."""
    from accelerate import cpu_offload

    model = tiny_model("llama", "causal_lm")
    want = model(torch.tensor([[5, 6, 7]])).logits
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert any(p.is_meta for p in model.parameters())
    assembly = assemble(model, {"task": "causal_lm"})
    got = assembly.forward(model, assembly.collator([{"input_ids": [5, 6, 7]}])).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
