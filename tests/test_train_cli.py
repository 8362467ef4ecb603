"""``padfree-plugins train`` and ``--acceleration_config``: the embedded default trains; bad input fails before
the first training step, with a message that says what to do."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import HfArgumentParser, Trainer, TrainingArguments
from typer.testing import CliRunner

from padfree_plugins import AccelerationArguments, ConfigError
from padfree_plugins.cli import app
from padfree_plugins.recipes.train import _loss_curve_callback, parse_arguments, run_train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "padfree.yaml"




@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if training starts: every error below must come before it."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("training started although the input is bad")

    monkeypatch.setattr(Trainer, "train", refuse)


def invoke(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def test_embedded_default_trains_and_prints_a_finite_falling_loss():
    result = invoke("--acceleration_config", str(CONFIG), "--max_steps", "12", "--logging_steps", "3")
    assert result.exit_code == 0, result.output
    losses = [float(x) for x in re.findall(r"step +\d+ +loss (\d+\.\d+)", result.output)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert "architecture: llama (decoder, plugin llama)" in result.output
    before, after = map(float, re.search(r"eval loss: (\S+) before training -> (\S+) after", result.output).groups())
    assert after < before
    assert re.search(r"12 steps in .* real tokens", result.output)


def test_help_lists_training_arguments_and_the_acceleration_config():
    result = invoke("--help")
    assert result.exit_code == 0
    for flag in ("--acceleration_config", "--learning_rate", "--model_name_or_path", "--dataset"):
        assert flag in result.output


def help_entries(text: str) -> dict[str, str]:
    """argparse's help, option by option: first spelling -> its help, on one line."""
    entries = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[1])
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries if entry.strip()}


def test_help_names_the_command_states_each_default_once_and_describes_the_negations(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps to the terminal: no word cut by a narrow one
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("usage: padfree-plugins train [OPTIONS]\n")
    entries = help_entries(result.output)
    assert "--learning_rate" in entries and "--acceleration_config" in entries
    for flag, entry in entries.items():
        assert "(default: None)" not in entry, entry
        if "(default: " in entry:
            assert entry.lower().count("default") == 1, entry  # not "Default: x ... (default: y)"
    assert "Default: the instruction dataset shipped with padfree-plugins" in entries["--dataset"]
    assert "train on the completion only" in entries["--completion_only_loss"]
    assert "train on the completion only" not in entries["--no_completion_only_loss"]
    assert "turn --completion_only_loss off (the same as --completion_only_loss false)" in \
        entries["--no_completion_only_loss"]
    assert "--report_to none --disable_tqdm true" in " ".join(result.output.split())  # the command's own defaults


def test_a_short_run_logs_every_step_unless_told_otherwise():
    result = invoke("--max_steps", "5", "--max_examples", "64", "--eval_fraction", "0")
    assert result.exit_code == 0, result.output
    assert [int(step) for step in re.findall(r"step +(\d+) +loss", result.output)] == [1, 2, 3, 4, 5]
    result = invoke("--max_steps", "5", "--max_examples", "64", "--eval_fraction", "0", "--logging_steps", "2")
    assert [int(step) for step in re.findall(r"step +(\d+) +loss", result.output)] == [2, 4]


def test_a_long_run_logs_about_fifty_times():
    report = run_train(["--max_steps", "120", "--max_examples", "32", "--per_device_train_batch_size", "4",
                        "--eval_fraction", "0"], print_fn=None)
    assert [step for step, _ in report.losses] == list(range(3, 121, 3))  # ceil(120 / 50) = every 3 steps


def test_the_help_states_the_logging_cadence_the_run_has(monkeypatch):
    """HF Trainer logs at every multiple of logging_steps: a run of N steps logs N // logging_steps times."""
    monkeypatch.setenv("COLUMNS", "200")
    text = " ".join(invoke("--help").output.split())
    assert "every step up to 50 steps; a longer one every ceil(steps / 50) steps, at most 500 apart: 25 to 50 times " \
           "up to 25,000 steps (108 steps: every 3rd, 36 times)" in text
    curve = _loss_curve_callback(None, log_often=True)
    logged = {}
    for steps in [*range(1, 25_001), 30_000]:
        state = SimpleNamespace(max_steps=steps, logging_steps=500)  # TrainingArguments' default logging_steps
        curve.on_train_begin(None, state, None)
        logged[steps] = steps // state.logging_steps
    assert all(logged[steps] == steps for steps in range(1, 51))
    assert min(logged[steps] for steps in range(51, 25_001)) == 25 and max(logged.values()) == 60
    assert logged[108] == 36  # every 3rd step


def test_no_progress_bar_in_a_pipe_and_the_loss_curve_still_prints(tmp_path):
    """Not a terminal: no progress bar (tqdm's carriage returns glue a bar onto one line of a CI log); the loss
    curve is printed all the same, and the bars are as they were afterwards."""
    import datasets
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    result = invoke("--max_steps", "2", "--max_examples", "32", "--eval_fraction", "0",
                    "--output_dir", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert "\r" not in result.output and "it/s" not in result.output, result.output
    assert "training loss (padding-free)" in result.output and re.search(r"step +2 +loss", result.output)
    assert (tmp_path / "out" / "config.json").exists()
    assert (logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()) == shown


def test_acceleration_arguments_parse_with_hf_argument_parser(tmp_path):
    parser = HfArgumentParser((TrainingArguments, AccelerationArguments))
    _, acceleration = parser.parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--acceleration_config", str(CONFIG)])
    assert acceleration.config.task == "causal_lm" and acceleration.config.attention == "auto"
    _, inline = parser.parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--acceleration_config", '{"attention": "exact", "max_length": 64}'])
    assert (inline.config.attention, inline.config.max_length) == ("exact", 64)
    _, absent = parser.parse_args_into_dataclasses(args=["--output_dir", str(tmp_path)])
    assert absent.config is None and absent.accelerate(object()) is None  # no flag: nothing happens
    with pytest.raises(ConfigError, match="does not exist"):
        parser.parse_args_into_dataclasses(args=["--output_dir", str(tmp_path), "--acceleration_config", "nope.yaml"])
    with pytest.raises(ConfigError, match="Did you mean 'attention'"):
        parser.parse_args_into_dataclasses(
            args=["--output_dir", str(tmp_path), "--acceleration_config", '{"attenton": "exact"}'])


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_config(path: Path, **values) -> str:
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64)
    path.write_text(json.dumps({**base, **values}))
    return str(path)


@pytest.mark.parametrize("spelling", [["--model_config", "cfg"], ["--model-config", "cfg"], ["--model-config=cfg"]])
def test_dashed_flags_count_as_given(tmp_path, spelling):
    """argparse takes ``--model-config`` for ``--model_config``: the embedded defaults must then stay off."""
    script, training, _, embedded = parse_arguments([*spelling, "--output-dir", str(tmp_path)])
    assert script.model_config == "cfg" and not embedded
    assert training.learning_rate == TrainingArguments.learning_rate  # not the embedded default's 3e-3
    assert training.output_dir == str(tmp_path) and training.save_strategy != "no"


def test_custom_model_config_and_saved_dataset(tmp_path):
    import datasets

    texts = [{"text": f"row {i}: " + " ".join(["word"] * (i % 7 + 1))} for i in range(24)]
    datasets.Dataset.from_list(texts).save_to_disk(str(tmp_path / "saved"))
    report = run_train(["--model_config", write_config(tmp_path / "qwen2.json", model_type="qwen2", vocab_size=300),
                        "--dataset", str(tmp_path / "saved"), "--vocab_size", "300", "--max_steps", "3",
                        "--per_device_train_batch_size", "4", "--logging_steps", "1",
                        "--acceleration_config", str(CONFIG)], print_fn=None)
    assert report.steps == 3 and len(report.losses) == 3 and report.setup["architecture"].startswith("qwen2")
    assert report.tokens > 0 and all(math.isfinite(loss) for _, loss in report.losses)


@pytest.mark.usefixtures("no_training")
def test_examples_longer_than_the_model_are_an_error_before_training(tmp_path):
    rows = [{"input_ids": list(range(5, 25))}] * 3 + [{"input_ids": [7] * 80}]
    result = invoke("--dataset", write_jsonl(tmp_path / "long.jsonl", rows),
                    "--model_config", write_config(tmp_path / "llama.json", model_type="llama"))
    assert result.exit_code == 2, result.output
    assert "example 3 of the train dataset has 80 tokens but the model takes at most 64" in result.output
    assert "max_position_embeddings=64" in result.output and "on_overlong: truncate" in result.output


@pytest.mark.usefixtures("no_training")
def test_labels_shorter_than_input_ids_are_an_error_before_training(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}] * 3 + [{"input_ids": [5, 6, 7], "labels": [5, 6]}]
    result = invoke("--dataset", write_jsonl(tmp_path / "labels.jsonl", rows), "--eval_fraction", "0")
    assert result.exit_code == 2, result.output
    assert "example 3 of the train dataset: 'labels' has 2 values but input_ids has 3 tokens" in result.output


@pytest.mark.usefixtures("no_training")
def test_unsupported_architecture_is_an_error_before_training(tmp_path):
    result = invoke("--model_config", write_config(tmp_path / "gpt2.json", model_type="gpt2", n_embd=32, n_layer=1,
                                                   n_head=2))
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())  # the terminal wraps long messages
    assert "model type 'gpt2' is not supported" in output and "architecture: probe" in output


@pytest.mark.usefixtures("no_training")
@pytest.mark.parametrize("config,message", [
    ('{"attention": "flash_attn"}', "attention backend 'flash_attn' was requested but cannot be used"),
    ('{"attention": "flsh_attn"}', "Did you mean 'flash_attn'"),
    ('{"max_length": 4096}', "max_length: 4096 is more than the model takes (512 tokens"),
])
def test_bad_acceleration_config_is_an_error_before_training(config, message):
    result = invoke("--acceleration_config", config)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.usefixtures("no_training")
def test_invalid_training_arguments_are_a_clear_error():
    result = invoke("--load_best_model_at_end", "true", "--eval_strategy", "no", "--save_strategy", "steps")
    assert result.exit_code == 2, result.output
    assert "error: invalid training arguments" in result.output and "Traceback" not in result.output


def test_a_run_shorter_than_the_logging_interval_says_so():
    result = invoke("--max_steps", "2", "--logging_steps", "5")
    assert result.exit_code == 0, result.output
    assert "no training loss was logged" in result.output and "2 steps in" in result.output


@pytest.mark.usefixtures("no_training")
@pytest.mark.parametrize("text,message", [
    ('{"input_ids": [1, 2]}\n{"input_ids": [1,\n', "cannot be read as json: JSON parse error"),
    ("", "cannot be read as json: it has no rows"),
    ('{"input_ids": ["a", "b"]}\n', "'input_ids' column holds list<item: string> values; it must hold lists of "
                                    "integer token ids"),
    ('{"input_ids": [5, 6], "labels": ["a", "b"]}\n', "'labels' column holds list<item: string> values"),
    ('{"prompt": "hi", "completion": 3}\n', "'completion' column holds int64 values; it must hold text"),
    ('{"input_ids": [5, 6]}\n{"input_ids": [7, -5, 8]}\n', "example 1 of the dataset: input_ids holds -5, outside "
                                                           "the model's vocabulary [0, 9)"),
    ('{"foo": "x", "bar": 1}\n', "the dataset has columns foo, bar; give input_ids (and labels), or prompt + "
                                 "completion, or text"),
])
def test_bad_datasets_are_a_clear_error_before_training(tmp_path, text, message):
    (tmp_path / "data.jsonl").write_text(text)
    result = invoke("--dataset", str(tmp_path / "data.jsonl"))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.usefixtures("no_training")
def test_token_ids_beyond_the_vocabulary_and_an_emptied_dataset_are_errors(tmp_path):
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, 6, 700]}])
    result = invoke("--dataset", data, "--model_config", write_config(tmp_path / "llama.json", model_type="llama"))
    assert "example 0 of the dataset: labels holds 700, outside the model's vocabulary [0, 128) (or -100)" \
        in result.output
    result = invoke("--dataset", data, "--max_examples", "0")
    assert "error: the dataset has no rows (--max_examples 0)" in result.output


@pytest.mark.usefixtures("no_training")
def test_an_argument_the_optimizer_refuses_is_named(tmp_path):
    result = invoke("--dataset", write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}]),
                    "--learning_rate", "-1")
    assert result.exit_code == 2, result.output
    assert "error: invalid training arguments: --learning_rate -1.0: Invalid learning rate" in result.output


@pytest.mark.usefixtures("no_training")
def test_model_sources_are_local_and_model_types_are_suggested(tmp_path):
    result = invoke("--model_name_or_path", "/nonexistent_dir")
    assert result.exit_code == 2, result.output
    assert "'/nonexistent_dir': no such directory (give a local directory; nothing is downloaded)" in result.output
    (tmp_path / "model").mkdir()
    for args in (["--model_config", write_config(tmp_path / "lama.json", model_type="lama")],
                 ["--model_name_or_path", write_config(tmp_path / "model" / "config.json", model_type="lama")[:-12]]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert "unknown model_type 'lama'. Did you mean 'llama'?" in result.output and "zamba" not in result.output


@pytest.mark.usefixtures("no_training")
def test_dataset_split_of_a_single_file_is_refused(tmp_path):
    result = invoke("--dataset", write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}]),
                    "--dataset_split", "validation")
    assert result.exit_code == 2, result.output
    assert "--dataset_split 'validation': dataset" in result.output and "single (train) split" in result.output


def test_output_dir_gets_the_trained_model_and_a_run_resumes_from_its_checkpoint(tmp_path):
    """``--output_dir``: the trained model and its tokenizer are saved there and load in plain transformers;
    ``--resume_from_checkpoint`` continues from the checkpoint with the uninterrupted run's losses and result."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = ["--max_steps", "4", "--logging_steps", "1", "--max_examples", "48", "--eval_fraction", "0",
              "--per_device_train_batch_size", "8"]
    full = run_train(["--output_dir", str(tmp_path / "full"), "--save_strategy", "steps", "--save_steps", "2",
                      *common], print_fn=None)
    resumed = run_train(["--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint",
                         str(tmp_path / "full" / "checkpoint-2"), *common], print_fn=None)
    assert [step for step, _ in resumed.losses] == [3, 4]  # steps 1 and 2 came from the checkpoint
    torch.testing.assert_close(torch.tensor([loss for _, loss in resumed.losses]),
                               torch.tensor([loss for _, loss in full.losses[2:]]), atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "full")
    ids = torch.tensor([tokenizer("### Instruction:\nsay hi\n### Response:\nhi")["input_ids"]])
    logits = [AutoModelForCausalLM.from_pretrained(tmp_path / run).eval()(input_ids=ids).logits
              for run in ("full", "resumed")]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "full").config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
