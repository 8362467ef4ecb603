"""What users import keeps working: every padfree_plugins import and dotted name in the README, docs/ and
examples/ runs today, and every module path that moved (``padfree_plugins._moved``) still imports, warning with
its new path and giving the new module's objects."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import padfree_plugins
from padfree_plugins import _moved

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
        *sorted(path for path in (ROOT / "examples").rglob("*") if path.is_file() and "__pycache__" not in path.parts)]
IMPORT_START = re.compile(r"^[ \t]*(?:from[ \t]+padfree_plugins\b[\w.]*[ \t]+import\b|import[ \t]+padfree_plugins\b)")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
INLINE_IMPORT = re.compile(r"`((?:from|import) padfree_plugins\b[^`]*)`")
DOTTED = re.compile(r"(?<![\w./-])padfree_plugins(?:\.[A-Za-z_]\w*)+")


def python_imports(text: str) -> list[tuple[int, str]]:
    """(line, statement) of every padfree_plugins import in Python source, nested ones too."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if any(name.split(".")[0] == "padfree_plugins" for name in names):
            found.append((node.lineno, ast.get_source_segment(text, node)))
    return sorted(found)


def markdown_imports(text: str) -> list[tuple[int, str]]:
    """(line, statement) of every padfree_plugins import in a markdown page: lines of its code blocks (a
    parenthesised or backslash-continued import joined with its following lines) and inline code spans."""
    lines = text.splitlines()
    found, in_code, prose = [], False, []
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            prose.append((i + 1, line))
        elif IMPORT_START.match(line):
            start, statement = i + 1, [line]
            while (statement[-1].rstrip().endswith("\\")
                   or "".join(statement).count("(") > "".join(statement).count(")")) and i + 1 < len(lines):
                i += 1
                statement.append(lines[i])
            found.append((start, textwrap.dedent("\n".join(statement))))
        i += 1
    prose_text = "\n".join(line for _, line in prose)
    for match in INLINE_IMPORT.finditer(prose_text):
        line = prose[prose_text.count("\n", 0, match.start())][0]
        found.append((line, " ".join(match.group(1).split())))
    return sorted(found)


def imports_of(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return python_imports(text) if path.suffix == ".py" else markdown_imports(text)


def old_path_in(statement: str) -> str | None:
    """The moved module path a statement imports, if any (docs must show the new one)."""
    for name in re.findall(r"padfree_plugins(?:\.\w+)*", statement):
        parts = name.split(".")
        for end in range(len(parts), 1, -1):
            if ".".join(parts[:end]) in _moved.MOVED_MODULES:
                return ".".join(parts[:end])
    return None


def run_import(statement: str, where: str) -> str | None:
    """Execute one import statement in a fresh namespace; the problem, or None."""
    old = old_path_in(statement)
    if old:
        return f"{where}: {statement!r} imports the old path {old}; write {_moved.MOVED_MODULES[old]}"
    try:
        exec(compile(statement, where, "exec"), {"__name__": "docs_example"})
    except Exception as error:  # noqa: BLE001 - any failure of a documented import is the finding
        return f"{where}: {statement!r} fails: {type(error).__name__}: {error}"
    return None


def resolve(dotted: str) -> object:
    """The object a dotted ``padfree_plugins.…`` name denotes: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        for attribute in parts[end:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)  # pragma: no cover - padfree_plugins itself always imports


# -- the collector sees what a reader copies -------------------------------------------------------------------------


def test_the_collector_reads_code_blocks_continued_imports_and_inline_code():
    page = textwrap.dedent('''\
        Use `from padfree_plugins import hookimpl,
        Architecture` in prose. `padfree_plugins.plan` is a name, not an import.

        ```python
        import padfree_plugins
        def plugin():
            from padfree_plugins.packing.batch import (
                BOUNDARY_KEYS,
                token_examples,
            )
        from padfree_plugins.batching.sampler import \\
            token_budget_dataloader
        x = 1  # from padfree_plugins import nothing
        ```
        ''')
    assert markdown_imports(page) == [
        (1, "from padfree_plugins import hookimpl, Architecture"),
        (5, "import padfree_plugins"),
        (7, "from padfree_plugins.packing.batch import (\n    BOUNDARY_KEYS,\n    token_examples,\n)"),
        (11, "from padfree_plugins.batching.sampler import \\\n    token_budget_dataloader"),
    ]
    source = "import os\nfrom padfree_plugins.batching.sampler import (\n    token_budget_dataloader,\n)\n"
    assert python_imports(source) == [(2, source.splitlines(keepends=True)[1] + "    token_budget_dataloader,\n)")]


def test_a_broken_or_moved_import_is_reported_with_its_file_and_line():
    assert "README.md:7" in run_import("from padfree_plugins.batching import no_such_name", "README.md:7")
    message = run_import("from padfree_plugins.sampler import token_budget_dataloader", "docs/scaling.md:3")
    assert "docs/scaling.md:3" in message and "padfree_plugins.batching.sampler" in message
    assert run_import("from padfree_plugins.batching.sampler import token_budget_dataloader", "x") is None


# -- the docs -------------------------------------------------------------------------------------------------------


def test_the_docs_hold_imports_to_check():
    assert sum(len(imports_of(path)) for path in DOCS) >= 20, "the collector found too few imports to mean anything"


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_documented_import_works(path):
    rel = path.relative_to(ROOT).as_posix()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dependency's deprecations are not the docs' problem
        problems = [run_import(statement, f"{rel}:{line}") for line, statement in imports_of(path)]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_documented_dotted_name_exists(path):
    """``padfree_plugins.batching.sampler.token_budget_dataloader`` in prose is as good as an import line."""
    rel = path.relative_to(ROOT).as_posix()
    problems = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for dotted in DOTTED.findall(line):
            old = old_path_in(dotted)
            if old:
                problems.append(f"{rel}:{number}: {dotted} names the old path {old}; write "
                                f"{_moved.MOVED_MODULES[old]}")
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    resolve(dotted)
            except (ImportError, AttributeError) as error:
                problems.append(f"{rel}:{number}: {dotted} does not exist: {type(error).__name__}: {error}")
    assert not problems, "\n".join(problems)


# -- the deprecated aliases -----------------------------------------------------------------------------------------


def public_names(module) -> list[str]:
    return [name for name in dir(module) if not name.startswith("_")]


@pytest.mark.parametrize("old", sorted(_moved.MOVED_MODULES))
def test_an_old_path_imports_warns_with_the_new_one_and_gives_its_objects(old, monkeypatch):
    new = _moved.MOVED_MODULES[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # a fresh import (restored afterwards)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"import {old}", "user_code.py", "exec"), {"__name__": "user_code"})
    ours = [w for w in caught if str(w.message).startswith(f"{old} moved to ")]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert ours[0].category is DeprecationWarning
    assert f"moved to {new}:" in str(ours[0].message)
    assert ours[0].filename == "user_code.py"  # stacklevel: the user's import line, not the import machinery
    alias, home = sys.modules[old], importlib.import_module(new)
    assert alias is not home and public_names(home)
    for name in public_names(home):
        assert getattr(alias, name) is getattr(home, name), name
    for name, target in _moved.MOVED_NAMES.get(old, {}).items():
        assert name in str(ours[0].message) and target in str(ours[0].message)
        assert getattr(alias, name) is getattr(importlib.import_module(target), name), name
    assert set(public_names(home)) | set(_moved.MOVED_NAMES.get(old, {})) <= set(dir(alias))
    with pytest.raises(AttributeError, match=f"{new}.*no_such_name"):
        alias.no_such_name


def test_from_imports_and_star_imports_of_an_old_path():
    from padfree_plugins.batching import sampler
    from padfree_plugins.integrations import base

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from padfree_plugins.sampler import token_budget_dataloader
        from padfree_plugins.trainer import TrainerPatch
        namespace: dict = {}
        exec("from padfree_plugins.trainer import *", namespace)
    assert token_budget_dataloader is sampler.token_budget_dataloader
    assert TrainerPatch is base.TrainerPatch is namespace["TrainerPatch"]
    assert namespace["accelerate"] is padfree_plugins.accelerate


def test_a_user_script_sees_the_warning_under_the_default_filters(tmp_path):
    script = tmp_path / "old_script.py"
    script.write_text("from padfree_plugins.sampler import token_budget_dataloader\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (f"{script}:1: DeprecationWarning: padfree_plugins.sampler moved to padfree_plugins.batching.sampler"
            in result.stderr), result.stderr[-2000:]


def test_old_paths_shadow_no_module_and_point_at_real_ones():
    for old, new in _moved.MOVED_MODULES.items():
        parent, _, leaf = old.rpartition(".")
        if parent not in _moved.MOVED_MODULES:  # an old package's children live only in the table
            search = importlib.import_module(parent).__path__
            assert importlib.machinery.PathFinder.find_spec(old, search) is None, f"{old} is a real module again"
        assert importlib.util.find_spec(new) is not None, new
        for name, target in _moved.MOVED_NAMES.get(old, {}).items():
            assert hasattr(importlib.import_module(target), name), (old, name, target)
    finders = [f for f in sys.meta_path if isinstance(f, _moved.MovedModuleFinder)]
    _moved.install()
    assert len(finders) == 1 and [f for f in sys.meta_path if isinstance(f, _moved.MovedModuleFinder)] == finders
