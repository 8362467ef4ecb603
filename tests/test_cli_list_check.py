"""``list`` shows the model types each plugin covers (``--model-type`` answers for one), ``check`` shows every
setting, and the PADFREE_PLUGINS_ALLOW / BLOCK switches are named wherever they kept a needed plugin out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from padfree_plugins import assemble
from padfree_plugins.cli import app
from padfree_plugins.config.schema import describe_fields
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.errors import ConfigError, PluginError, UnsupportedArchitectureError
from padfree_plugins.testing.models import tiny_model

DOCS = Path(__file__).resolve().parents[1] / "docs"
NO_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def no_switches(monkeypatch):
    """The developer's PADFREE_PLUGINS_BLOCK / ALLOW must not decide these tests."""
    monkeypatch.delenv("PADFREE_PLUGINS_BLOCK", raising=False)
    monkeypatch.delenv("PADFREE_PLUGINS_ALLOW", raising=False)


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def one_line(text: str) -> str:
    return " ".join(text.split())


# -- list: model types ----------------------------------------------------------------------------------------------

COVERED = {"xlm-roberta": "roberta", "camembert": "roberta", "gemma3_text": "gemma3", "llama": "llama"}


def test_list_json_shows_the_model_types_of_each_plugin():
    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    plugins = {p["name"]: p for p in data["plugins"]}
    for model_type, plugin in COVERED.items():
        assert model_type in plugins[plugin]["model_types"], plugins[plugin]
        assert data["model_types"][model_type]["plugin"] == plugin
    assert plugins["roberta"]["architectures"] == ["roberta"]
    assert plugins["causal_lm"]["model_types"] == []  # a task plugin covers no model type
    assert data["filtered"] == {}


def table_cells(output: str) -> dict[str, dict[str, list[str]]]:
    """Plugin name -> column -> the lines of its cell, read back from a rich table."""
    lines = output.splitlines()
    header = next(line for line in lines if "┃" in line and "name" in line)
    columns = [cell.strip() for cell in header.strip("┃").split("┃")]
    rows: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in lines:
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[0]:
            current = rows.setdefault(cells[0], {column: [] for column in columns})
        for column, cell in zip(columns, cells):
            if cell:
                current[column].append(cell)
    return rows


@pytest.mark.parametrize("columns", [200, 130])
def test_list_table_has_a_model_types_column(columns):
    result = run("list", env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    rows = table_cells(result.output)
    for model_type, plugin in COVERED.items():
        assert model_type in rows[plugin]["model types"], (plugin, rows[plugin])
    assert rows["causal_lm"]["model types"] == ["-"]


def test_list_too_narrow_for_model_types_says_where_they_are():
    result = run("list", env={"COLUMNS": "110"})
    assert result.exit_code == 0, result.output
    assert "model types" not in result.output.splitlines()[2]  # the header: the narrowest table
    assert "list --model-type NAME says which plugin covers one" in one_line(result.output)
    blocks = run("list", env={"COLUMNS": "64"}).output  # one block per plugin: a model types line
    roberta = blocks[blocks.index("\nroberta "):]
    assert "camembert" in one_line(roberta[:roberta.index("\n", roberta.index("model types:"))])


@pytest.mark.parametrize("model_type, plugin", sorted(COVERED.items()))
def test_list_model_type_names_the_plugin_that_covers_it(model_type, plugin):
    result = run("list", "--model-type", model_type)
    assert result.exit_code == 0, result.output
    assert f"model type {model_type!r} is covered by plugin {plugin!r}" in one_line(result.output)
    answer = json.loads(run("list", "--model-type", model_type, "--json").output)
    assert answer["plugin"] == plugin and answer["model_type"] == model_type


def test_list_model_type_covered_by_none_says_how_to_add_one():
    result = run("list", "--model-type", "gpt2")
    assert result.exit_code == 2
    message = one_line(result.output)
    assert "no loaded plugin covers model type 'gpt2'" in message
    assert "architecture: probe" in message and "docs/writing-a-plugin.md" in message
    result = run("list", "--model-type", "xlm_roberta", "--json")
    assert result.exit_code == 2
    answer = json.loads(result.output)
    assert answer["plugin"] is None and "Did you mean 'xlm-roberta'?" in answer["message"]
    assert "transformers does not know it either" in answer["message"]


def test_list_model_type_of_a_blocked_plugin_names_the_switch():
    result = run("list", "--model-type", "camembert", env={"PADFREE_PLUGINS_BLOCK": "roberta"})
    assert result.exit_code == 2
    assert "PADFREE_PLUGINS_BLOCK=roberta keeps 1 installed plugin from loading: roberta" in one_line(result.output)


# -- check: every setting -------------------------------------------------------------------------------------------

CONFIG = """\
task: embedding
pooling: mean
max_length: 256
unpad: always
batching:
  strategy: tokens
  max_tokens_per_batch: 4096
"""


def flattened(settings: dict, prefix: str = "") -> dict:
    rows = {}
    for key, value in settings.items():
        if isinstance(value, dict) and key != "task_options":
            rows.update(flattened(value, f"{prefix}{key}."))
        else:
            rows[prefix + key] = value
    return rows


def test_check_json_shows_every_setting(tmp_path):
    config = tmp_path / "padfree.yaml"
    config.write_text(CONFIG)
    result = run("check", str(config), "--model-type", "bert", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    settings = flattened(data["settings"])
    assert set(settings) == {key for key, _, _ in describe_fields()}
    assert settings["batching.strategy"] == "tokens" and settings["batching.max_tokens_per_batch"] == 4096
    assert settings["batching.window"] == 1024 and settings["max_length"] == 256
    assert settings["unpad"] == "always" and settings["pooling"] == "mean" and settings["attention"] == "auto"
    assert settings["task_options"]["normalize"] is False  # the task's defaults, as the task reads them
    assert data["architecture"].startswith("bert (encoder, plugin bert)")
    assert data["task"] == "embedding (plugin embedding)" and data["attention backend"] == "exact"


def test_check_table_shows_every_setting_and_which_are_defaults(tmp_path):
    config = tmp_path / "padfree.yaml"
    config.write_text(CONFIG)
    result = run("check", str(config), "--model-type", "bert", "--device", "cpu", env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.output.splitlines():
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if line.startswith("│") and len(cells) == 2 and cells[0]:
            rows[cells[0]] = cells[1]
    for key, _, _ in describe_fields():
        assert key in rows or any(row.startswith(f"{key}.") for row in rows), (key, result.output)
    assert rows["batching.strategy"] == "tokens" and rows["batching.window"] == "1024 (default)"
    assert rows["max_length"] == "256" and rows["unpad"] == "always" and rows["pooling"] == "mean"
    assert rows["task_options.normalize"] == "false (default)" and rows["plugins.block"] == "[] (default)"


def test_check_shows_the_pooling_the_model_decides(tmp_path):
    config = tmp_path / "padfree.yaml"
    config.write_text("task: embedding\n")
    data = json.loads(run("check", str(config), "--model-type", "roberta", "--device", "cpu", "--json").output)
    assert data["settings"]["pooling"] == "first"  # pooling: null leaves it to the architecture


def test_check_shows_how_sequence_parallelism_runs_attention_and_balances_it(tmp_path):
    """Llama's default 32 heads at size 3: all-gather attention, its causal work balanced by zigzag (auto) or not."""
    config = tmp_path / "padfree.yaml"
    for balance, shown in (("auto", "balance: zigzag over the 3 all-gather ranks"), ("off", "balance: off")):
        config.write_text(f"sequence_parallel:\n  size: 3\n  balance: {balance}\n")
        data = json.loads(run("check", str(config), "--model-type", "llama", "--device", "cpu", "--json").output)
        assert "attention: all-gather" in data["sequence parallel"] and shown in data["sequence parallel"], data


# -- the ALLOW / BLOCK switches ---------------------------------------------------------------------------------------


def test_check_names_the_allow_variable_when_the_task_is_filtered_out():
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu",
                 env={"PADFREE_PLUGINS_ALLOW": "core,backends,llama"})
    assert result.exit_code == 2, result.output
    message = one_line(result.output)
    assert "task 'causal_lm' is not provided by any plugin. Available: none." in message
    assert "PADFREE_PLUGINS_ALLOW=backends,core,llama keeps" in message
    assert "from loading: causal_lm," in message  # the plugin named like the missing task comes first


def test_check_fails_when_no_plugin_can_patch_because_of_allow():
    """The plan needs no patch_model answer (there is no model), so without a check ``check`` said valid."""
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu",
                 env={"PADFREE_PLUGINS_ALLOW": "backends,causal_lm,llama"})
    assert result.exit_code == 2, result.output
    message = one_line(result.output)
    assert "no loaded plugin implements patch_model" in message and "no plugin could patch" in message
    assert "PADFREE_PLUGINS_ALLOW=backends,causal_lm,llama keeps" in message and "from loading: core," in message


def test_no_plugin_could_patch_names_the_allow_variable():
    host = PluginHost(environ={"PADFREE_PLUGINS_ALLOW": "backends,causal_lm,llama"})
    with pytest.raises(PluginError, match="no plugin could patch LlamaForCausalLM") as info:
        assemble(tiny_model("llama", "causal_lm"), {"attention": "exact"}, host=host)
    assert "PADFREE_PLUGINS_ALLOW=backends,causal_lm,llama keeps" in str(info.value)
    assert "from loading: core," in str(info.value)


def test_check_names_the_block_variable_and_what_it_blocked():
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu",
                 env={"PADFREE_PLUGINS_BLOCK": "causal_lm"})
    assert result.exit_code == 2, result.output
    message = one_line(result.output)
    assert "Available: embedding, hidden_states, reranker, seq_cls." in message
    assert "PADFREE_PLUGINS_BLOCK=causal_lm keeps 1 installed plugin from loading: causal_lm" in message
    assert "remove the plugin you need from it" in message


def test_missing_architecture_and_backend_name_the_switch():
    host = PluginHost(environ={"PADFREE_PLUGINS_BLOCK": "backends"})
    with pytest.raises(ConfigError, match="PADFREE_PLUGINS_BLOCK=backends keeps 1 installed plugin"):
        assemble(tiny_model("llama", "causal_lm"), {"attention": "exact"}, host=host)
    host = PluginHost(environ={"PADFREE_PLUGINS_BLOCK": "llama"})
    with pytest.raises(UnsupportedArchitectureError, match="PADFREE_PLUGINS_BLOCK=llama keeps 1 installed plugin"):
        assemble(tiny_model("llama", "causal_lm"), {"attention": "exact"}, host=host)


def test_records_say_which_switch_blocked_them():
    host = PluginHost(block=["bert"], environ={"PADFREE_PLUGINS_BLOCK": "roberta"})
    assert host.records["roberta"].error == "blocked by PADFREE_PLUGINS_BLOCK"
    assert host.records["bert"].error == "blocked by plugins.block"
    assert host.filtered() == {"PADFREE_PLUGINS_BLOCK": ["roberta"], "plugins.block": ["bert"]}
    host = PluginHost(environ={"PADFREE_PLUGINS_ALLOW": "core,causal-lm"})
    assert host.records["llama"].error == "not named in PADFREE_PLUGINS_ALLOW"
    assert "PADFREE_PLUGINS_ALLOW names 'causal-lm', which is not installed. Did you mean 'causal_lm'?" in \
        host.filter_note()
    assert PluginHost(environ=NO_ENV).filter_note() == ""


def test_a_valid_check_shows_what_the_switches_filtered_out():
    env = {"PADFREE_PLUGINS_BLOCK": "bert"}
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu", "--json", env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["filtered plugins"] == {"PADFREE_PLUGINS_BLOCK": ["bert"]}
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu",
                 env={**env, "COLUMNS": "200"})
    assert result.exit_code == 0 and "PADFREE_PLUGINS_BLOCK=bert keeps 1 installed plugin" in one_line(result.output)


def allow_examples() -> list[str]:
    """Every ``PADFREE_PLUGINS_ALLOW=…`` value the guides show."""
    found = [value for page in sorted(DOCS.glob("*.md"))
             for value in re.findall(r"PADFREE_PLUGINS_ALLOW=([\w,.-]+)", page.read_text(encoding="utf-8"))]
    assert found, "no PADFREE_PLUGINS_ALLOW example in docs/"
    return found


@pytest.mark.parametrize("value", allow_examples())
def test_the_docs_allow_examples_name_real_plugins_and_work(value):
    records = PluginHost(environ=NO_ENV).records
    for name in value.split(","):
        assert name in records and records[name].status == "ok", (name, sorted(records))
    result = run("check", "configs/padfree.yaml", "--model-type", "llama", "--device", "cpu",
                 env={"PADFREE_PLUGINS_ALLOW": value})
    assert result.exit_code == 0, result.output


def test_the_docs_name_the_builtin_plugins_an_allow_list_needs():
    """The ALLOW item's words on which builtin plugin provides what name real plugins (there is no 'tasks')."""
    page = (DOCS / "writing-a-plugin.md").read_text(encoding="utf-8")
    start = page.index("* `PADFREE_PLUGINS_ALLOW=")
    item = page[start:page.index("\n\n", start)]
    named = set(re.findall(r"`([a-z_0-9]+)`", item))
    assert {"core", "backends", "causal_lm", "roberta"} <= named and "tasks" not in named
    records = PluginHost(environ=NO_ENV).records
    assert named <= set(records), sorted(named - set(records))
