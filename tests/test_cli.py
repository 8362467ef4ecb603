"""The command line: --version, list (with a broken plugin), check, demo, bad arguments."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from padfree_plugins import __version__
from padfree_plugins.cli.app import app


def run(*args: str):
    return CliRunner().invoke(app, list(args))


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


def test_demo_outputs_equal_and_reports_speed():
    result = run("demo", "--batch-size", "3", "--median", "12", "--repeats", "1", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {row["model"] for row in rows} == {"llama", "bert"}
    for row in rows:
        assert row["max_abs_diff"] < 1e-4 and row["padfree_tokens_per_s"] > 0 and row["speedup"] > 0


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
