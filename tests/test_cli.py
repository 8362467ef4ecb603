"""The command line: --version, list (with a broken plugin), check, demo."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from padfree_plugins import __version__
from padfree_plugins.cli import app


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


def test_demo_outputs_equal_and_reports_speed():
    result = run("demo", "--batch-size", "3", "--median", "12", "--repeats", "1", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {row["model"] for row in rows} == {"llama", "bert"}
    for row in rows:
        assert row["max_abs_diff"] < 1e-4 and row["padfree_tokens_per_s"] > 0 and row["speedup"] > 0
