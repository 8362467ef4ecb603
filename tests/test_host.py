"""PluginHost: builtins through entry points, isolation of broken plugins, deterministic precedence, env switches."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
import torch
from conftest import make_examples, per_example, tiny_model

import padfree_plugins
from padfree_plugins import Architecture, AttentionBackend, PluginHost, Task, assemble, hookimpl, plan
from padfree_plugins.errors import PluginError
from padfree_plugins.modeling.attention.backends import exact_varlen

BUILTIN_PLUGINS = {"core", "backends", "hidden_states", "causal_lm", "llama", "bert"}
NO_ENV: dict[str, str] = {}

BROKEN_IMPORT = """
    raise RuntimeError("boom at import")
"""

BAD_SIGNATURE = """
    from padfree_plugins import hookimpl

    @hookimpl
    def collate(task, architecture, model_config, config, tokenizer):
        return None
"""

RAISING_DECLARATION = """
    from padfree_plugins import hookimpl

    @hookimpl
    def register_architectures():
        raise KeyError("no such config")

    @hookimpl
    def revert_output(task, architecture, config):
        return "SENTINEL"
"""

WRONG_DECLARATION = """
    from padfree_plugins import hookimpl

    @hookimpl
    def register_architectures():
        return ["llama"]

    @hookimpl
    def revert_output(task, architecture, config):
        return "SENTINEL"
"""


def claiming(name: str, model_type: str = "llama", priority: int = 0) -> str:
    """Source of a plugin module declaring architecture ``name`` for ``model_type``."""
    return f"""
        from padfree_plugins import Architecture, hookimpl

        @hookimpl
        def register_architectures():
            return [Architecture({name!r}, model_types=({model_type!r},), kind="decoder", priority={priority})]
    """


def arch_plugin(name: str, model_types=("llama",), priority: int = 0, **hooks) -> types.SimpleNamespace:
    """An in-memory plugin object declaring one architecture."""

    @hookimpl
    def register_architectures():
        return [Architecture(name, model_types=tuple(model_types), kind="decoder", priority=priority)]

    return types.SimpleNamespace(register_architectures=register_architectures, **hooks)


def assert_llama_assembles(host: PluginHost) -> None:
    """A tiny llama assembles with ``host`` and its packed forward equals each example run alone."""
    model = tiny_model("llama", "causal_lm")
    assembly = assemble(model, {"attention": "exact"}, host=host)
    try:
        examples = make_examples([3, 1, 6])
        batch = assembly.collator(examples)
        with torch.no_grad():
            packed = model(**batch.model_inputs()).logits
            reference = torch.cat([out.logits[0] for out in per_example(model, examples, use_cache=False)])
        torch.testing.assert_close(packed[0], reference, atol=1e-5, rtol=1e-5)
    finally:
        assembly.undo()


# -- builtins -------------------------------------------------------------------------------------------------------


def test_builtins_load_from_entry_points():
    host = PluginHost(environ=NO_ENV)
    version = importlib.metadata.version("padfree-plugins")
    assert version == padfree_plugins.__version__
    for name in BUILTIN_PLUGINS:
        record = host.records[name]
        assert record.status == "ok", record
        assert record.source == "builtin" and record.version == version
        assert record.module.startswith("padfree_plugins.builtin")
        assert record.error is None
    assert set(host.records["core"].hooks) >= {"collate", "patch_model", "pool", "revert_output"}
    assert host.records["llama"].hooks == ("register_architectures",)
    assert {r.name for r in host.loaded()} >= BUILTIN_PLUGINS


def test_builtin_declarations():
    host = PluginHost(environ=NO_ENV)
    architectures = host.architectures()
    assert architectures["llama"][1] == "llama" and architectures["llama"][0].kind == "decoder"
    assert architectures["bert"][1] == "bert" and architectures["bert"][0].kind == "encoder"
    assert host.architecture_for("llama").name == "llama"
    assert host.architecture_for("no-such-model") is None
    tasks = host.tasks()
    assert tasks["causal_lm"][1] == "causal_lm" and tasks["hidden_states"][1] == "hidden_states"
    assert "labels" in tasks["causal_lm"][0].token_keys
    backends = host.backends()
    assert {"exact", "varlen", "flash_attn"} <= set(backends)
    assert all(backends[name][1] == "backends" for name in ("exact", "varlen", "flash_attn"))
    assert host.records["llama"].architectures == ("llama",)
    assert host.records["causal_lm"].tasks == ("causal_lm",)
    assert host.records["hidden_states"].tasks == ("hidden_states",)
    assert set(host.records["backends"].backends) >= {"exact", "varlen", "flash_attn"}
    assert host.notes == []  # builtins do not conflict with each other


def test_record_as_dict():
    record = PluginHost(environ=NO_ENV).records["llama"]
    data = record.as_dict()
    assert data["name"] == "llama" and data["architectures"] == ["llama"]
    assert data["hooks"] == ["register_architectures"]
    assert data["status"] == "ok" and data["source"] == "builtin"


def test_without_entry_points_nothing_is_loaded():
    host = PluginHost(entry_points=False, environ=NO_ENV)
    assert host.records == {} and host.architectures() == {} and host.tasks() == {}


# -- programmatic registration -------------------------------------------------------------------------------------


def test_registered_plugin_is_visible():
    plugin = arch_plugin("mine", model_types=("my_model",))
    host = PluginHost({"mine": plugin}, environ=NO_ENV)
    record = host.records["mine"]
    assert record.source == "registered" and record.status == "ok"
    assert record.architectures == ("mine",) and record.hooks == ("register_architectures",)
    assert host.architecture_for("my_model").name == "mine"
    assert host.architectures()["my_model"][1] == "mine"


def test_add_invalidates_cached_declarations():
    host = PluginHost(environ=NO_ENV)
    assert host.architecture_for("my_model") is None
    host.add("late", arch_plugin("late", model_types=("my_model",)))
    assert host.architecture_for("my_model").name == "late"


def test_adding_the_same_name_twice_is_an_error():
    host = PluginHost({"mine": arch_plugin("a")}, environ=NO_ENV)
    with pytest.raises(PluginError, match="'mine' is already registered"):
        host.add("mine", arch_plugin("b"))
    with pytest.raises(PluginError, match="'llama' is already registered"):
        host.add("llama", arch_plugin("c"))


def test_registered_plugin_hooks_answer_first():
    """Assembly hooks of a third-party plugin are asked before the builtin (trylast) ones."""

    @hookimpl
    def revert_output(task, architecture, config):
        return "MINE"

    host = PluginHost({"mine": types.SimpleNamespace(revert_output=revert_output)}, environ=NO_ENV)
    assert host.hook.revert_output(task=None, architecture=None, config=None) == "MINE"
    assert host.call_first("revert_output", task=None, architecture=None, config=None) == "MINE"
    plain = PluginHost(environ=NO_ENV)
    assert plain.hook.revert_output(task=None, architecture=None, config=None) != "MINE"
    assert plain.call_first("revert_output", task=None, architecture=None, config=None) != "MINE"


def test_a_plugin_failing_at_assembly_is_named():
    """A bug in a third-party hook stops assembly with the plugin's name and how to block it; the library's own
    errors pass through as they are."""
    from padfree_plugins import BatchError, PluginError, assemble
    from tests.conftest import tiny_model

    @hookimpl
    def collate(task, architecture, model_config, config):
        return {}["oops"]

    @hookimpl
    def revert_output(task, architecture, config):
        raise BatchError("deliberate")

    model = tiny_model("llama", head="causal_lm")
    for plugin, error, message in ((collate, PluginError, "plugin 'buggy' failed in its collate hook: KeyError"),
                                   (revert_output, BatchError, "^deliberate$")):
        host = PluginHost({"buggy": types.SimpleNamespace(**{plugin.__name__: plugin})}, environ=NO_ENV)
        with pytest.raises(error, match=message):
            assemble(model, {"task": "causal_lm"}, host=host)
    with pytest.raises(PluginError, match=r"PADFREE_PLUGINS_BLOCK=buggy"):
        host = PluginHost({"buggy": types.SimpleNamespace(collate=collate)}, environ=NO_ENV)
        assemble(model, {"task": "causal_lm"}, host=host)
    assert model.config._attn_implementation == "sdpa"  # nothing was patched


# -- broken plugins -------------------------------------------------------------------------------------------------


def test_plugin_whose_import_raises(fake_distribution):
    fake_distribution("broken", BROKEN_IMPORT)
    host = PluginHost(environ=NO_ENV)
    record = host.records["broken"]
    assert record.status == "error" and record.source == "entry point" and record.version == "0.0.1"
    assert record.error == "import failed: RuntimeError: boom at import"
    assert record.hooks == () and record.architectures == ()
    assert "broken" not in {r.name for r in host.loaded()}
    for name in BUILTIN_PLUGINS:
        assert host.records[name].status == "ok"
    assert_llama_assembles(host)


def test_plugin_with_bad_hook_signature(fake_distribution):
    fake_distribution("badsig", BAD_SIGNATURE)
    host = PluginHost(environ=NO_ENV)
    record = host.records["badsig"]
    assert record.status == "error"
    assert record.error.startswith("invalid plugin: PluginValidationError")
    assert "tokenizer" in record.error and "collate" in record.error
    assert record.hooks == ()
    # not registered: the hook relay does not know it
    assert "badsig" not in {name for name, _ in host.pm.list_name_plugin()}
    assert_llama_assembles(host)


@pytest.mark.parametrize(
    ("source", "fragments"),
    [
        (RAISING_DECLARATION, ["register_architectures failed: KeyError", "no such config"]),
        (WRONG_DECLARATION, ["register_architectures failed: TypeError",
                             "must return Architecture objects, got 'llama'"]),
    ],
)
def test_plugin_with_failing_declaration(fake_distribution, source, fragments):
    fake_distribution("baddecl", source)
    host = PluginHost(environ=NO_ENV)
    record = host.records["baddecl"]
    assert record.status == "error"
    for fragment in fragments:
        assert fragment in record.error
    assert record.hooks == () and record.architectures == ()
    # the half-registered plugin is gone: its other hooks never answer
    assert host.hook.revert_output(task=None, architecture=None, config=None) != "SENTINEL"
    assert host.architectures()["llama"][1] == "llama"
    assert_llama_assembles(host)


@pytest.mark.parametrize(
    ("hook_name", "returned"),
    [
        ("register_tasks", [Architecture("x", model_types=("x",), kind="decoder")]),
        ("register_attention_backends", [Task("t")]),
        ("register_architectures", Architecture("x", model_types=("x",), kind="decoder")),  # not a list
    ],
)
def test_registered_plugin_with_wrong_declaration_types(hook_name, returned):
    function = hookimpl(lambda: returned)
    function.__name__ = hook_name
    host = PluginHost({"odd": types.SimpleNamespace(**{hook_name: function})}, environ=NO_ENV)
    record = host.records["odd"]
    assert record.status == "error" and record.error.startswith(f"{hook_name} failed")


def test_misspelt_hook_is_an_error(fake_distribution):
    fake_distribution("typo", """
        from padfree_plugins import Architecture, hookimpl

        @hookimpl
        def register_architecture():
            return [Architecture("typo", model_types=("typo_model",), kind="decoder")]
    """)
    host = PluginHost(environ=NO_ENV)
    record = host.records["typo"]
    assert record.status == "error" and record.hooks == ()
    assert "unknown hook 'register_architecture'" in record.error
    assert "Did you mean 'register_architectures'?" in record.error
    assert host.pm.get_plugin("typo") is None
    assert_llama_assembles(host)


def test_optional_hook_without_spec_is_allowed():
    function = hookimpl(optionalhook=True)(lambda: None)
    host = PluginHost({"future": types.SimpleNamespace(some_future_hook=function)}, environ=NO_ENV)
    assert host.records["future"].status == "ok" and host.records["future"].hooks == ("some_future_hook",)


def test_declaration_that_returns_none_declares_nothing():
    host = PluginHost({"quiet": types.SimpleNamespace(register_tasks=hookimpl(lambda: None))}, environ=NO_ENV)
    assert host.records["quiet"].status == "ok" and host.records["quiet"].tasks == ()


def test_several_broken_plugins_do_not_hide_each_other(fake_distribution):
    fake_distribution("broken", BROKEN_IMPORT)
    fake_distribution("badsig", BAD_SIGNATURE)
    fake_distribution("good", claiming("goodarch", model_type="good_model"))
    host = PluginHost(environ=NO_ENV)
    assert host.records["broken"].status == host.records["badsig"].status == "error"
    assert host.records["good"].status == "ok" and host.records["good"].source == "entry point"
    assert host.architecture_for("good_model").name == "goodarch"


# -- conflicts ------------------------------------------------------------------------------------------------------


def test_third_party_wins_over_builtin_at_equal_priority(fake_distribution, caplog):
    fake_distribution("zzz-llama", claiming("fastllama"))
    host = PluginHost(environ=NO_ENV)
    spec, plugin = host.architectures()["llama"]
    assert (spec.name, plugin) == ("fastllama", "zzz-llama")
    assert len(host.notes) == 1
    note = host.notes[0]
    assert "'llama'" in note and "zzz-llama:fastllama" in note and "llama:llama" in note
    assert note.index("zzz-llama:fastllama") < note.index("over") < note.index("llama:llama")
    # the winner is what assembly plans with, and the note travels into the plan
    resolved = plan(tiny_model("llama").config, {"attention": "exact"}, host=host)
    assert resolved.architecture.name == "fastllama" and resolved.architecture_plugin == "zzz-llama"
    assert any("fastllama" in n for n in resolved.notes)
    with caplog.at_level("WARNING", logger="padfree_plugins"):
        assert_llama_assembles(host)
    assert any("zzz-llama:fastllama" in record.getMessage() for record in caplog.records)  # visible when training


def test_builtin_wins_over_lower_priority(fake_distribution):
    fake_distribution("aaa-llama", claiming("slowllama", priority=-1))
    host = PluginHost(environ=NO_ENV)
    assert host.architectures()["llama"][1] == "llama"
    assert "using llama:llama over aaa-llama:slowllama" in host.notes[0]


def test_higher_priority_wins_over_name_and_source():
    host = PluginHost({"aaa": arch_plugin("a_arch", priority=1), "zzz": arch_plugin("z_arch", priority=5)},
                      environ=NO_ENV)
    assert host.architectures()["llama"] == (host.architectures()["llama"][0], "zzz")
    assert host.architecture_for("llama").name == "z_arch"
    note = host.notes[0]
    assert "zzz:z_arch over" in note and "aaa:a_arch" in note and "llama:llama" in note


def test_equal_priority_third_parties_are_ordered_by_plugin_name():
    for order in (("bbb", "aaa"), ("aaa", "bbb")):
        plugins = {name: arch_plugin(f"{name}_arch") for name in order}
        host = PluginHost(plugins, environ=NO_ENV)
        assert host.architectures()["llama"][1] == "aaa"
        assert host.notes == ["model type 'llama' is claimed by several plugins: using aaa:aaa_arch over "
                              "bbb:bbb_arch, llama:llama"]


def test_conflicts_on_tasks_and_backends():
    @hookimpl
    def register_tasks():
        return [Task("causal_lm", token_keys=("labels", "weights"))]

    @hookimpl
    def register_attention_backends():
        return [AttentionBackend("exact", exact_varlen, priority=-1)]

    host = PluginHost({"mine": types.SimpleNamespace(register_tasks=register_tasks,
                                                     register_attention_backends=register_attention_backends)},
                      environ=NO_ENV)
    assert host.tasks()["causal_lm"][1] == "mine"
    assert host.backends()["exact"][1] == "backends"
    assert any(note.startswith("task 'causal_lm'") and "mine:causal_lm" in note for note in host.notes)
    assert any(note.startswith("attention backend 'exact'") and "backends:exact over mine:exact" in note
               for note in host.notes)
    host.tasks()  # asking again does not duplicate notes
    assert len(host.notes) == 2


# -- environment switches -------------------------------------------------------------------------------------------


def test_block_env(fake_distribution):
    fake_distribution("broken", BROKEN_IMPORT, module="fake_blocked_broken")
    host = PluginHost(environ={"PADFREE_PLUGINS_BLOCK": " bert , broken"})
    for name in ("bert", "broken"):
        record = host.records[name]
        assert record.status == "blocked" and "blocked" in record.error
    assert "fake_blocked_broken" not in sys.modules  # a blocked plugin is never imported
    assert host.architecture_for("bert") is None
    assert host.records["llama"].status == "ok"
    assert_llama_assembles(host)


def test_block_argument_and_registered_plugins():
    host = PluginHost({"mine": arch_plugin("mine", model_types=("m",))}, block=["mine", "bert"], environ=NO_ENV)
    assert host.records["mine"].status == host.records["bert"].status == "blocked"
    assert host.architecture_for("m") is None and host.architecture_for("bert") is None


def test_block_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("PADFREE_PLUGINS_BLOCK", "bert")
    monkeypatch.delenv("PADFREE_PLUGINS_ALLOW", raising=False)
    assert PluginHost().records["bert"].status == "blocked"


def test_allow_env(fake_distribution):
    fake_distribution("extra", claiming("extra", model_type="extra_model"))
    host = PluginHost(environ={"PADFREE_PLUGINS_ALLOW": "core,causal_lm,backends,llama"})
    assert {r.name for r in host.loaded()} == {"core", "causal_lm", "backends", "llama"}
    assert host.records["bert"].status == host.records["extra"].status == "blocked"
    assert host.architecture_for("extra_model") is None
    assert_llama_assembles(host)


def test_allow_argument_and_env_are_combined():
    host = PluginHost({"mine": arch_plugin("mine", model_types=("m",))}, allow=["mine"],
                      environ={"PADFREE_PLUGINS_ALLOW": "llama"})
    assert {r.name for r in host.loaded()} == {"mine", "llama"}


def test_block_beats_allow():
    host = PluginHost(environ={"PADFREE_PLUGINS_ALLOW": "llama,bert", "PADFREE_PLUGINS_BLOCK": "bert"})
    assert {r.name for r in host.loaded()} == {"llama"}


# -- require ------------------------------------------------------------------------------------------------------


def test_require_loaded_plugins_passes():
    PluginHost(environ=NO_ENV).require(["llama", "core"])
    PluginHost(environ=NO_ENV).require([])


def test_require_missing_plugin_suggests_nearest():
    host = PluginHost(environ=NO_ENV)
    with pytest.raises(PluginError) as info:
        host.require(["llama", "lamma"])
    message = str(info.value)
    assert "required plugin 'lamma' is not installed" in message and "Did you mean 'llama'?" in message
    assert "Installed:" in message and "bert" in message
    with pytest.raises(PluginError, match="required plugin 'qqqqqq' is not installed") as info:
        host.require(["qqqqqq"])
    assert "Did you mean" not in str(info.value)


def test_require_broken_plugin_reports_its_error(fake_distribution):
    fake_distribution("broken", BROKEN_IMPORT)
    host = PluginHost(environ=NO_ENV)
    with pytest.raises(PluginError) as info:
        host.require(["broken"])
    message = str(info.value)
    assert "required plugin 'broken' is error" in message and "RuntimeError: boom at import" in message
    # and through a config, plan fails hard while the same host without the requirement works
    with pytest.raises(PluginError, match="boom at import"):
        plan(tiny_model("llama").config, {"plugins": {"require": ["broken"]}, "attention": "exact"}, host=host)
    plan(tiny_model("llama").config, {"attention": "exact"}, host=host)


def test_require_blocked_plugin():
    host = PluginHost(environ={"PADFREE_PLUGINS_BLOCK": "bert"})
    with pytest.raises(PluginError, match="required plugin 'bert' is blocked"):
        host.require(["bert"])


# -- duplicate entry-point names -----------------------------------------------------------------------------------


def test_duplicate_entry_point_name_from_two_distributions(fake_distribution):
    fake_distribution("dup", claiming("first", model_type="dup_a"), module="fake_dup_a", dist="fake-dup-a")
    fake_distribution("dup", claiming("second", model_type="dup_b"), module="fake_dup_b", dist="fake-dup-b")
    host = PluginHost(environ=NO_ENV)
    winner = host.records["dup"]
    assert winner.status == "ok" and winner.module == "fake_dup_a"  # first by distribution name, deterministically
    loser = host.records["dup (fake_dup_b)"]
    assert loser.status == "error" and loser.source == "entry point"
    assert "duplicate plugin name 'dup'" in loser.error and "fake_dup_a" in loser.error
    assert host.architecture_for("dup_a").name == "first"
    assert host.architecture_for("dup_b") is None
    with pytest.raises(PluginError):
        host.require(["dup (fake_dup_b)"])


def test_third_party_entry_point_cannot_shadow_a_builtin_name(fake_distribution):
    fake_distribution("llama", claiming("impostor", model_type="llama"), module="aaa_impostor", dist="aaa-impostor")
    host = PluginHost(environ=NO_ENV)
    assert host.records["llama"].source == "builtin" and host.records["llama"].status == "ok"
    impostor = host.records["llama (aaa_impostor)"]
    assert impostor.status == "error" and "duplicate plugin name 'llama'" in impostor.error
    assert host.architectures()["llama"][1] == "llama" and host.notes == []


def test_an_assembly_hook_answering_with_something_uncallable_is_named():
    from padfree_plugins import PluginError, assemble
    from tests.conftest import tiny_model

    @hookimpl
    def collate(task, architecture, model_config, config):
        return {"not": "callable"}

    host = PluginHost({"odd": types.SimpleNamespace(collate=collate)}, environ=NO_ENV)
    with pytest.raises(PluginError, match="plugin 'odd' answered its collate hook with a dict, not a callable"):
        assemble(tiny_model("llama", head="causal_lm"), {"task": "causal_lm"}, host=host)


def test_a_plugins_pooling_mode_serves_the_embedding_task():
    """The embedding task pools with what the pool hook answers, so a plugin's mode works there too."""
    from padfree_plugins import assemble
    from padfree_plugins.modeling.pooling import MeanPooler
    from tests.conftest import make_examples, tiny_model

    calls = []

    class HalfMean(MeanPooler):
        def __call__(self, hidden_states, batch):
            calls.append(1)
            return super().__call__(hidden_states, batch) / 2

    @hookimpl
    def pool(task, architecture, mode, config):
        return HalfMean() if mode == "half_mean" else None

    host = PluginHost({"halves": types.SimpleNamespace(pool=pool)}, environ=NO_ENV)
    model = tiny_model("bert")
    config = {"task": "embedding", "attention": "exact", "task_options": {"loss": "MultipleNegativesRankingLoss"}}
    rows = [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"]}
            for a, b in zip(make_examples([3, 5]), make_examples([4, 2], seed=1))]
    embeddings = {}
    for mode in ("mean", "half_mean"):
        assembly = assemble(model, {**config, "pooling": mode}, host=host)
        try:
            embeddings[mode] = assembly.forward(model, assembly.collator(rows)).embeddings.detach()
        finally:
            assembly.undo()
    assert calls and torch.allclose(embeddings["half_mean"], embeddings["mean"] / 2)


def test_a_plugin_task_declares_its_options():
    from padfree_plugins import ConfigError, plan
    from tests.conftest import tiny_config

    @hookimpl
    def register_tasks():
        return [Task("tagging", token_keys=("labels",), model_keys=("labels",), options={"scheme": "bio"}),
                Task("free", options=None)]

    host = PluginHost({"tags": types.SimpleNamespace(register_tasks=register_tasks)}, environ=NO_ENV)
    llama = tiny_config("llama")
    assert plan(llama, {"task": "tagging", "task_options": {"scheme": "bioes"}}, host=host, device_type="cpu")
    with pytest.raises(ConfigError, match="'schema' is not an option of task 'tagging'. Did you mean 'scheme'"):
        plan(llama, {"task": "tagging", "task_options": {"schema": "bio"}}, host=host, device_type="cpu")
    with pytest.raises(ConfigError, match="scheme of task 'tagging' must be a string"):
        plan(llama, {"task": "tagging", "task_options": {"scheme": 3}}, host=host, device_type="cpu")
    assert plan(llama, {"task": "free", "task_options": {"anything": 1}}, host=host, device_type="cpu")
    with pytest.raises(ConfigError, match="It takes no options"):
        plan(llama, {"task": "hidden_states", "task_options": {"x": 1}}, host=host, device_type="cpu")


def test_only_the_conflicts_a_model_uses_are_noted():
    from padfree_plugins import plan
    from tests.conftest import tiny_config

    @hookimpl
    def register_architectures():
        return [Architecture("other_llama", model_types=("llama",), kind="decoder")]

    host = PluginHost({"zzz": types.SimpleNamespace(register_architectures=register_architectures)}, environ=NO_ENV)
    llama = plan(tiny_config("llama"), {}, host=host, device_type="cpu").notes
    bert = plan(tiny_config("bert"), {"task": "hidden_states"}, host=host, device_type="cpu").notes
    assert any("model type 'llama' is claimed by several plugins" in note for note in llama)
    assert not any("'llama'" in note for note in bert)
