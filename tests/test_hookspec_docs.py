"""Every hookspec is documented for plugin authors and exercised by a test plugin.

The hook names come from pluggy (the specs registered from :mod:`padfree_plugins.contract.hookspecs`), so a new
hookspec gets a failing case here until docs/writing-a-plugin.md names it (in a heading or a code span) and a test
under tests/ or plugins/*/tests implements it in a plugin (``@hookimpl`` over ``def <hook>(``, or
``<hook>=hookimpl(…)``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pluggy
import pytest

from padfree_plugins.contract import hookspecs

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-a-plugin.md"
TEST_DIRS = [ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests"))]


def hookspec_names() -> list[str]:
    """The hooks pluggy knows once the specs are added, as a host adds them."""
    manager = pluggy.PluginManager("padfree_plugins")
    manager.add_hookspecs(hookspecs)
    return sorted(name for name in vars(manager.hook) if not name.startswith("_"))


HOOKS = hookspec_names()


def documented_text(markdown: str) -> list[str]:
    """The headings and inline code spans of a markdown page (fenced code blocks left out)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    headings = [line for line in prose.splitlines() if line.startswith("#")]
    return headings + re.findall(r"`([^`\n]+)`", prose)


def implementing_files(hook: str) -> list[Path]:
    """Test files with a plugin that implements ``hook``."""
    decorated = re.compile(rf"@hookimpl\b[^\n]*\n(?:[ \t]*@[^\n]*\n)*[ \t]*def {hook}\(")
    assigned = re.compile(rf"\b{hook}\s*=\s*hookimpl\b")
    found = []
    for folder in TEST_DIRS:
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if decorated.search(text) or assigned.search(text):
                found.append(path)
    return found


def test_hook_names_come_from_the_hookspec_markers():
    marked = sorted(name for name, value in vars(hookspecs).items()
                    if callable(value) and hasattr(value, "padfree_plugins_spec"))
    assert HOOKS == marked and {"register_architectures", "patch_model", "wrap_trainer"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_is_documented(hook):
    spans = documented_text(GUIDE.read_text(encoding="utf-8"))
    assert any(re.search(rf"\b{hook}\b", span) for span in spans), (
        f"hookspec {hook!r} is not documented in {GUIDE.relative_to(ROOT)}: name it in a heading or a code span "
        "(the hooks table under '## The hooks')")


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_is_exercised_by_a_test_plugin(hook):
    assert implementing_files(hook), (
        f"no test implements hookspec {hook!r} in a plugin: add one (an object with a @hookimpl def {hook}(...) "
        "handed to PluginHost, as in tests/test_hookspec_plugins.py) under tests/ or plugins/*/tests")


def test_the_detectors_can_fail():
    assert not any(re.search(r"\bnot_a_hook\b", span) for span in documented_text("# Title\n`pool` and `collate`"))
    assert documented_text("```\n`hidden`\n```\n## `shown`") == ["## `shown`", "shown"]
    assert implementing_files("not_a_hook") == []
