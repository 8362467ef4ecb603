"""The example third-party plugin (plugins/padfree-example) works as any pip-installed plugin would.

It must be installed (``pip install -e plugins/padfree-example``, see the setup in README.md): these tests fail,
rather than skip, when it is not, so that a broken plugin install cannot pass CI unnoticed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
from conftest import tiny_config

import padfree_plugins

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugins" / "padfree-example"
SETUP_HINT = (
    "the example plugin padfree-example is not installed: run the setup from README.md "
    "(pip install -e plugins/padfree-example)"
)


@pytest.fixture(autouse=True)
def _no_plugin_switches(monkeypatch):
    """The developer's PADFREE_PLUGINS_BLOCK / ALLOW must not decide these tests."""
    monkeypatch.delenv("PADFREE_PLUGINS_BLOCK", raising=False)
    monkeypatch.delenv("PADFREE_PLUGINS_ALLOW", raising=False)


def require_example_plugin() -> padfree_plugins.PluginHost:
    """A host that loaded the example plugin; ``pytest.fail`` with the setup hint otherwise."""
    try:
        importlib.metadata.distribution("padfree-example")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if not installed:
        pytest.fail(SETUP_HINT, pytrace=False)
    host = padfree_plugins.PluginHost()
    record = host.records.get("cohere")
    if record is None:
        pytest.fail(f"padfree-example is installed but its entry point 'cohere' was not found; {SETUP_HINT}",
                    pytrace=False)
    if record.status != "ok":
        pytest.fail(f"the example plugin 'cohere' did not load ({record.status}: {record.error}); {SETUP_HINT}",
                    pytrace=False)
    return host


def load_plugin_tests():
    """The plugin package's own test module, plugins/padfree-example/tests/test_cohere.py."""
    path = PLUGIN_DIR / "tests" / "test_cohere.py"
    spec = importlib.util.spec_from_file_location("padfree_example_test_cohere", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_plugin_is_discovered_as_an_entry_point():
    host = require_example_plugin()
    record = host.records["cohere"]
    assert record.source == "entry point"  # loaded like any third-party package, not as a builtin
    assert record.version == "0.1.0"
    assert record.module == "padfree_example.cohere"
    assert record.hooks == ("register_architectures",)
    assert record.architectures == ("cohere",)
    spec, plugin = host.architectures()["cohere"]
    assert (spec.name, spec.kind, spec.default_pooling, plugin) == ("cohere", "decoder", "last", "cohere")


def test_plan_picks_the_example_plugin_for_cohere():
    require_example_plugin()
    config = tiny_config("cohere", num_key_value_heads=2)
    resolved = padfree_plugins.plan(config, {"task": "hidden_states", "plugins": {"require": ["cohere"]}},
                                    device_type="cpu")
    assert resolved.architecture.name == "cohere"
    assert resolved.architecture_plugin == "cohere"
    assert resolved.position_start == 0
    assert {"causal", "gqa"} <= resolved.features
    assert not resolved.notes  # no other plugin claims "cohere"


def test_example_plugin_equivalence():
    """The plugin package's own equivalence test, run from the main suite."""
    require_example_plugin()
    plugin_tests = load_plugin_tests()
    plugin_tests.test_plugin_is_discovered()
    for model_class, task in plugin_tests.MODEL_CLASSES:
        plugin_tests.test_packed_forward_equals_each_example_alone(model_class, task)
