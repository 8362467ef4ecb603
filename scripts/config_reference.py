"""Write docs/configuration.md, the reference of every ``padfree.yaml`` key, from the config schema.

The page is generated so that it cannot drift: every key, type, default and meaning comes from the dataclasses of
``padfree_plugins.config.schema`` (their ``help`` metadata), and the task options from the builtin tasks'
declarations. ``tests/test_docs_site.py`` checks that the committed page equals this script's output.

    python scripts/config_reference.py           # rewrite docs/configuration.md
    python scripts/config_reference.py --check   # exit 1 if the committed page is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"

INTRO = """\
# Configuration: `padfree.yaml`

<!-- Generated from padfree_plugins/config/schema.py by scripts/config_reference.py: do not edit by hand.
     Run `python scripts/config_reference.py` after changing the schema; tests/test_docs_site.py checks it. -->

One YAML file (or a dict, or a `PadfreeConfig`) says how a model is trained padding-free. Every key is optional;
[`configs/padfree.yaml`](../configs/padfree.yaml) spells out every key with its default and a comment, and the
other files in [`configs/`](../configs/) are complete examples (`seq_cls.yaml`, `embedding.yaml`,
`reranker_listwise.yaml`, `token_budget.yaml`, `sentence_transformers.yaml`).

Unknown keys are errors that suggest the nearest valid one, a key given twice is an error, and each value is
checked against its type and allowed values. Names that plugins provide (tasks, attention backends,
architectures, pooling modes) are checked against the installed plugins when the model is assembled. YAML 1.1
reads a bare `on`, `off`, `yes`, `no`, `true` or `false` as a boolean: an option with `on` / `off` values takes it
as `on` / `off` (`prefix_sharing: on`, `unpad: off`); anywhere else the error says to quote the word. Check a
config against a model type before training:

```bash
padfree-plugins check configs/padfree.yaml --model-type llama   # what would be assembled, every resolved setting
```

Python takes the same keys: `accelerate(trainer, {"task": "seq_cls"})`, `assemble(model, "padfree.yaml")`, or
`padfree_plugins.config.schema.PadfreeConfig`.
"""


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def yaml_value(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {yaml_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def type_text(hint: Any) -> str:
    """A type in words (no ``|``: the text lives in a table cell)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(f"`{yaml_value(arg)}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in args)
    if origin is list:
        return f"list of {type_text(args[0])}s"
    if origin is dict:
        return "mapping"
    names = {bool: "`true` / `false`", int: "integer", float: "number", str: "string", type(None): "`null`"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def prose(text: str) -> str:
    """Help text for a table cell: snake_case names as code, no line breaks, no bare ``|``."""
    text = " ".join(text.split()).replace("|", "/").replace("``", "`")
    name = re.compile(r"(?<![`\w.])([a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*)(?![`\w])")
    return name.sub(lambda m: f"`{m.group(1)}`" if "_" in m.group(1) else m.group(1), text)


def key_table(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            meaning = f"{prose(f.metadata.get('help', ''))}: see [`{prefix}{f.name}`](#{f.name})"
            rows.append(f"| `{prefix}{f.name}` | section | | {meaning} |")
            continue
        rows.append(f"| `{prefix}{f.name}` | {type_text(hint)} | `{yaml_value(default_of(f))}` | "
                    f"{prose(f.metadata.get('help', ''))} |")
    return rows


def sections(cls: type) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]


def builtin_tasks() -> list[Any]:
    """The tasks the builtin task plugins declare (``padfree_plugins.builtin.tasks.*``), by name."""
    package = importlib.import_module("padfree_plugins.builtin.tasks")
    tasks = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "register_tasks"):
            tasks.extend(module.register_tasks())
    return sorted(tasks, key=lambda task: task.name)


def task_options_section() -> list[str]:
    lines = ["## `task_options`", "",
             "Options of the task plugin; each task declares its options with their defaults, and an unknown "
             "option or a value of another kind than its default's is an error. What each option does: "
             "[Tasks](tasks.md#task-options). The builtin tasks:", ""]
    for task in builtin_tasks():
        lines += [f"### `{task.name}`", "", prose(task.description[:1].upper() + task.description[1:]) + ".", ""]
        if task.options is None:
            lines += ["The task reads `task_options` itself.", ""]
        elif not task.options:
            lines += ["No options.", ""]
        else:
            lines += ["| option | default |", "| --- | --- |"]
            lines += [f"| `{key}` | `{yaml_value(value)}` |" for key, value in task.options.items()]
            lines.append("")
    return lines


def render(schema: type | None = None) -> str:
    """The page for ``schema`` (default: :class:`~padfree_plugins.config.schema.PadfreeConfig`)."""
    if schema is None:
        from padfree_plugins.config.schema import PadfreeConfig as schema

    lines = [INTRO, "## Top-level keys", "", prose(schema.__doc__ or ""), ""]
    lines += key_table(schema, "")
    lines.append("")
    for name, cls in sections(schema):
        lines += [f"## `{name}`", "", prose(cls.__doc__ or ""), ""]
        lines += key_table(cls, f"{name}.")
        lines.append("")
    lines += task_options_section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
