"""The command line: --version, list (with a broken plugin), check, demo, bad arguments, help texts."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from padfree_plugins import __version__
from padfree_plugins.cli import app


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_list_shows_builtins_and_a_broken_plugin(fake_distribution):
    fake_distribution("broken", "raise ImportError('no module named nowhere')")
    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    plugins = {p["name"]: p for p in json.loads(result.output)["plugins"]}
    assert plugins["broken"]["status"] == "error" and "nowhere" in plugins["broken"]["error"]
    assert plugins["core"]["status"] == "ok" and "collate" in plugins["core"]["hooks"]
    assert plugins["llama"]["source"] == "builtin" and plugins["llama"]["architectures"] == ["llama"]
    table = run("list")
    assert table.exit_code == 0 and "broken" in table.output and "error" in table.output and "llama" in table.output


def plugin_names(plugins: list[dict]) -> set[str]:
    """Every name ``list`` shows: plugins, hooks, architectures, tasks, backends."""
    return {name for p in plugins for name in (p["name"], *p["hooks"], *p["architectures"], *p["tasks"],
                                                 *p["backends"])}


@pytest.mark.parametrize("columns, layout", [(200, "architectures"), (110, "provides"), (64, "hooks: ")])
def test_list_fits_the_terminal_and_never_splits_a_name(fake_distribution, columns, layout):
    """The widest table that fits COLUMNS (one name per line in a cell), else one block per plugin: no line wider
    than the terminal, every name whole, the broken plugin's reason shown."""
    fake_distribution("broken", "raise ImportError('no module named nowhere')")
    plugins = json.loads(run("list", "--json").output)["plugins"]
    result = run("list", env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= columns, result.output
    for name in plugin_names(plugins):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), (name, result.output)
    assert layout in result.output and "no module named nowhere" in result.output


HELPS = [[], ["list"], ["check"], ["demo"], ["train"], ["bench"], ["bench", "sft"], ["bench", "embedding"],
         ["bench", "collator"], ["bench", "batching"]]


@pytest.mark.parametrize("command", HELPS, ids=lambda c: " ".join(c) or "top")
def test_help_shows_no_type_for_flags(command):
    """A flag takes no value: no ``<bool>`` after --json, --help or --version (typer's rich help printed one)."""
    result = run(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "--help" in result.output and "<bool>" not in result.output and "BOOL" not in result.output


def test_check_says_that_a_model_is_required():
    help_text = " ".join(run("check", "--help").output.split())
    assert "one of --model-type (e.g. llama) or --model (a local directory): one of them is required" in help_text
    result = run("check", "configs/padfree.yaml")
    assert result.exit_code == 2
    assert "error: check needs a model: give --model-type (e.g. --model-type llama) or --model (a local model " \
           "directory); one of them is required" in " ".join(result.output.split())
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--model", "somewhere")
    assert result.exit_code == 2 and "give either --model-type or --model, not both" in result.output


def test_check_valid_config_shows_the_plan():
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["attention backend"] == "exact" and plan["architecture"].startswith("llama (decoder")
    assert plan["task"].startswith("causal_lm")


def test_check_reports_errors_with_exit_code_2(tmp_path):
    bad = tmp_path / "padfree.yaml"
    bad.write_text("atention: exact\n")
    result = run("check", str(bad), "--model-type", "llama")
    assert result.exit_code == 2 and "Did you mean 'attention'" in result.output
    result = run("check", "configs/padfree.yaml", "--model-type", "gpt2")
    assert result.exit_code == 2 and "not supported" in result.output
    result = run("check", "configs/padfree.yaml")
    assert result.exit_code == 2 and "--model-type" in result.output
    result = run("check", "configs/padfree.yaml", "--model-type", "lama")
    assert result.exit_code == 2 and "Did you mean 'llama'" in result.output and "qwen" not in result.output
    result = run("check", "configs/padfree.yaml", "--model", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_demo_outputs_equal_and_reports_speed_and_its_progress():
    result = run("demo", "--batch-size", "3", "--median", "12", "--repeats", "2", "--json")
    assert result.exit_code == 0, result.output
    progress = result.stderr.splitlines()  # a line per stage, on stderr: stdout holds the JSON only
    assert progress[0] == "building a tiny Llama and a tiny BERT (random weights)..."
    rows = json.loads(result.stdout)
    assert {row["model"] for row in rows} == {"llama", "bert"}
    for row in rows:
        assert any(line.startswith(f"{row['model']}: 3 examples, {row['real_tokens']} real tokens, "
                                   f"{row['padding_fraction']:.0%} of the padded batch is padding (ideal speed-up "
                                   f"{row['ideal']:.2f}x)") for line in progress), progress
        assert f"{row['model']}: warming up, then 2 interleaved rounds of padding-free and padded (forward + " \
               "backward, 1 thread(s))..." in progress
        assert row["max_abs_diff"] < 1e-4 and row["padfree_tokens_per_s"] > 0 and row["threads"] == 1
        # the ratio with its spread over the rounds, and the ideal of the batch (no timing is asserted)
        assert row["rounds"] == 2 and 0 < row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
        assert row["ideal"] == pytest.approx(1 / (1 - row["padding_fraction"])) and row["ideal"] >= 1


def test_demo_table_states_the_ideal_and_the_ratio_with_its_spread():
    result = run("demo", "--batch-size", "3", "--median", "12", "--repeats", "2", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = [re.split(r"[│┃]", line)[1:-1] for line in result.stdout.splitlines() if line.count("│") > 5
             or line.count("┃") > 5]  # the header's rule is heavy, the rows' light
    columns = [cell.strip() for cell in lines[0]]
    rows = {cells[0].strip(): dict(zip(columns, (cell.strip() for cell in cells))) for cells in lines[1:]}
    assert set(rows) == {"llama", "bert"}, result.stdout
    for row in rows.values():
        assert re.fullmatch(r"\d+\.\d\dx", row["ideal"]), row
        assert re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", row["speed-up (range)"]), row
    text = " ".join(result.stdout.split())
    assert "within each of 2 interleaved rounds: the median and (lowest-highest); 1 thread(s)" in text
    assert "ideal: the padded batch's tokens over its real tokens" in text


@pytest.mark.parametrize("args, message", [
    (["bench", "sft", "--batch-sizes", "4,x"], "'--batch-sizes': '4,x' is not a comma-separated list of positive "
                                               "integers"),
    (["bench", "collator", "--batch-sizes", "0"], "'--batch-sizes': '0' is not a comma-separated list"),
    (["bench", "batching", "--ranks", "x"], "'--ranks': 'x' is not a comma-separated list"),
    (["bench", "sft", "--batches", "0"], "'--batches': 0 is not a positive number"),
    (["bench", "collator", "--batches", "0"], "'--batches': 0 is not a positive number"),
    (["bench", "embedding", "--batches", "0"], "'--batches': 0 is not a positive number"),
    (["bench", "sft", "--device", "tpu"], "--device must be cpu, cuda or cuda:N, not 'tpu'"),
    (["bench", "embedding", "--dtype", "float33"], "--dtype must be a floating-point torch dtype"),
    (["bench", "embedding", "--workload", "embedding:tiny:0:20"], "batch_size must be a positive integer"),
    (["demo", "--batch-size", "0"], "'--batch-size': 0 is not a positive number"),
    (["demo", "--median", "-5"], "'--median': -5 is not a positive number"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    """Exit code 2 and a message naming the option, its value and what it takes, before any model is built."""
    result = run(*args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert message in re.sub(r"[\s│]+", " ", result.output), result.output  # rich boxes wrap long messages
