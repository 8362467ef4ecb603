"""The host calls hooks with pluggy's own semantics: monitoring sees every call, ``specname=`` implementations
count, the plugin that answered each assembly hook is recorded and shown, and ``PADFREE_PLUGINS_TRACE=1`` logs it."""

from __future__ import annotations

import types

import pytest
from conftest import make_examples, tiny_model

from padfree_plugins import Architecture, PluginHost, Task, assemble, hookimpl, plan
from padfree_plugins.packing.collator import PackingCollator

NO_ENV: dict[str, str] = {}


def watch(host: PluginHost) -> list[str]:
    """The names of the hooks called from now on, as pluggy's monitoring sees them."""
    calls: list[str] = []
    host.pm.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *args: None)
    return calls


def test_monitoring_sees_declarations_and_assembly_hooks():
    host = PluginHost(environ=NO_ENV)
    calls = watch(host)

    @hookimpl
    def register_tasks():
        return [Task("watched")]

    host.add("late", types.SimpleNamespace(register_tasks=register_tasks))
    assert "register_tasks" in calls
    plan(tiny_model("llama", "causal_lm").config, {"task": "causal_lm"}, host=host)
    assert {"collate", "task_forward", "revert_output"} <= set(calls)


class SpecnamePlugin:
    """Implements ``collate`` and ``register_architectures`` under other function names (pluggy's ``specname``)."""

    def __init__(self):
        self.collated = 0

    @hookimpl(specname="register_architectures")
    def my_architectures(self):
        return [Architecture("renamed-llama", model_types=("llama",), kind="decoder", priority=5)]

    @hookimpl(specname="collate")
    def my_collator(self, task, architecture, model_config, config):
        self.collated += 1
        return PackingCollator()


def test_specname_implementations_are_called():
    plugin = SpecnamePlugin()
    host = PluginHost({"renamed": plugin}, environ=NO_ENV)
    assert host.records["renamed"].architectures == ("renamed-llama",)
    assert host.architecture_for("llama").name == "renamed-llama"
    resolved = plan(tiny_model("llama", "causal_lm").config, {"task": "hidden_states"}, host=host)
    assert plugin.collated == 1
    assert resolved.answers["collate"] == "renamed"


def test_the_answering_plugin_is_recorded_and_described():
    model = tiny_model("llama", "causal_lm")
    host = PluginHost(environ=NO_ENV)
    resolved = plan(model.config, {"task": "causal_lm"}, host=host)
    assert resolved.answers == {"collate": "causal_lm", "task_forward": "causal_lm", "revert_output": "core"}
    assembly = assemble(model, {"task": "hidden_states", "pooling": "mean"}, host=host)
    try:
        assert assembly.plan.answers == {"collate": "core", "pool": "core", "task_forward": "core",
                                         "revert_output": "core", "patch_model": "core"}
        described = assembly.describe()["hooks answered by"]
        assert described == "collate: core, pool: core, task_forward: core, revert_output: core, patch_model: core"
    finally:
        assembly.undo()


def test_trace_logs_every_assembly_hook_call(capsys):
    model = tiny_model("llama", "causal_lm")
    host = PluginHost(environ={"PADFREE_PLUGINS_TRACE": "1"})
    assembly = assemble(model, {"task": "causal_lm"}, host=host)
    assembly.undo()
    lines = capsys.readouterr().err.splitlines()
    assert "padfree-plugins hook collate: causal_lm -> CausalLMCollator" in lines
    assert "padfree-plugins hook patch_model: core -> ModelPatch" in lines
    assert not any("hook collate: core" in line for line in lines)  # the first answer wins: core is never asked


def test_no_trace_by_default(capsys):
    assemble(tiny_model("llama", "causal_lm"), {"task": "causal_lm"}, host=PluginHost(environ=NO_ENV)).undo()
    assert "padfree-plugins hook" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", ""])
def test_trace_off_values(value, capsys):
    host = PluginHost(environ={"PADFREE_PLUGINS_TRACE": value})
    assert host.trace is None


def test_an_answer_the_host_recorded_trains_the_same_batch():
    """The recorded answer is the one used: a batch from the specname plugin's collator runs through the model."""
    plugin = SpecnamePlugin()
    host = PluginHost({"renamed": plugin}, environ=NO_ENV)
    model = tiny_model("llama", "causal_lm")
    assembly = assemble(model, {"task": "hidden_states"}, host=host)
    try:
        batch = assembly.collator(make_examples([3, 5]))
        assert model(**batch.model_inputs()).logits.shape[1] == 8
    finally:
        assembly.undo()


def test_trace_of_a_plan_says_that_patch_model_is_not_called():
    """``check`` plans without a model: its trace still has a patch_model line, saying why the hook is not asked."""
    lines: list[str] = []
    plan(tiny_model("llama", "causal_lm").config, {"task": "causal_lm"}, host=PluginHost(environ=NO_ENV,
                                                                                        trace=lines.append))
    assert "padfree-plugins hook collate: causal_lm -> CausalLMCollator" in lines
    assert lines[-1] == "padfree-plugins hook patch_model: not called (a plan patches no model; assemble() asks it)"


def test_trace_logs_a_hook_answered_through_wrappers():
    class Wrapper:
        @hookimpl(wrapper=True)
        def patch_model(self, model, architecture, backend, fallback, config):
            return (yield)

    lines: list[str] = []
    host = PluginHost({"wrapper": Wrapper()}, environ=NO_ENV, trace=lines.append)
    assemble(tiny_model("llama", "causal_lm"), {"task": "causal_lm"}, host=host).undo()
    assert "padfree-plugins hook patch_model: (hook wrappers) -> ModelPatch" in lines


def test_the_guides_trace_sample_is_what_assembly_prints():
    """docs/writing-a-plugin.md's PADFREE_PLUGINS_TRACE sample: its lines (``…`` for lines left out) in order."""
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "writing-a-plugin.md").read_text()
    block = guide.split("`PADFREE_PLUGINS_TRACE=1` prints", 1)[1].split("```", 2)[1]
    sample = [line for line in block.splitlines() if line.strip() and line != "…"]
    assert any("hook patch_model:" in line for line in sample)
    lines: list[str] = []
    host = PluginHost(environ=NO_ENV, trace=lines.append)
    assemble(tiny_model("llama", "causal_lm"), {"task": "causal_lm"}, host=host).undo()
    positions = [lines.index(line) if line in lines else -1 for line in sample]
    assert -1 not in positions and positions == sorted(positions), (sample, lines)
