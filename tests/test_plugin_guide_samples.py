"""docs/writing-a-plugin.md's samples for plugin tests run as printed: step 3's host checks (``host.records``,
``host.architectures()``) on the example plugin, and the tiny models with windows and layer kinds."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md"


def sample(containing: str) -> types.ModuleType:
    """The guide's one python code block that contains ``containing``, executed as a module."""
    blocks = [block for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
              if containing in block]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of the guide contain {containing!r}"
    module = types.ModuleType("guide_sample")
    exec(compile(blocks[0], str(GUIDE), "exec"), module.__dict__)
    return module


def test_step_3s_host_checks_pass_on_the_example_plugin():
    pytest.importorskip("padfree_example", reason="the example plugin is not installed (pip install -e "
                                                  "plugins/padfree-example)")
    step3 = sample("def test_plugin_is_discovered")
    step3.test_plugin_is_discovered()
    step3.PLUGIN = "no-such-plugin"  # the sample's checks can fail
    with pytest.raises(KeyError):
        step3.test_plugin_is_discovered()


def test_tiny_models_with_windows_and_layer_kinds():
    """The sample builds both models and checks them packed; what it asks for is on the built configs."""
    windows = sample('tiny_model("mistral"')
    assert windows.model.config.model_type == "gemma2" and windows.model.config.sliding_window == 4
    assert windows.model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
