"""``list`` (the installed plugins, the model types they cover) and ``check`` (what a config assembles for a model,
every setting included)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from padfree_plugins import __version__
from padfree_plugins.cli.common import JsonFlag, console, fail
from padfree_plugins.errors import PadfreeError, did_you_mean

app = typer.Typer()

STATUS_STYLES = {"ok": "green", "error": "red", "blocked": "yellow"}
#: What a plugin record shows in each column of ``list``; lists of names hold one name per line.
COLUMNS: dict[str, Callable[[Any], Any]] = {
    "name": lambda r: r.name,
    "version": lambda r: r.version or "-",
    "source": lambda r: r.source,
    "hooks": lambda r: "\n".join(r.hooks) or "-",
    "architectures": lambda r: "\n".join(r.architectures) or "-",
    "model types": lambda r: "\n".join(r.model_types) or "-",
    "tasks": lambda r: "\n".join(r.tasks) or "-",
    "backends": lambda r: "\n".join(r.backends) or "-",
    "provides": lambda r: "\n".join([*r.architectures, *r.tasks, *r.backends]) or "-",
    "status": lambda r: Text(r.status, style=STATUS_STYLES.get(r.status, "")),
}
#: The tables of ``list``, widest first: the first that fits the console is printed, else one block per plugin.
LAYOUTS = (("name", "version", "source", "hooks", "architectures", "model types", "tasks", "backends", "status"),
           ("name", "source", "hooks", "provides", "model types", "status"),
           ("name", "source", "hooks", "provides", "status"))
#: The lines of a plugin's block (``list`` narrower than any table): label -> record attribute.
BLOCK_LINES = {"hooks": "hooks", "architectures": "architectures", "model types": "model_types", "tasks": "tasks",
               "backends": "backends", "error": "error"}
#: Printed under a table too narrow for the model types column.
NO_MODEL_TYPES = ("(model types left out at this width: padfree-plugins list --model-type NAME says which plugin "
                  "covers one, list --json lists them all)")


def plugin_table(records: Sequence[Any], columns: Sequence[str]) -> Table:
    """The plugins as a table; no cell ever wraps, so that no name is ever split."""
    table = Table(title=f"padfree-plugins {__version__}: plugins")
    for column in columns:
        table.add_column(column, no_wrap=True)
    for record in records:
        table.add_row(*(COLUMNS[column](record) for column in columns))
    return table


def _wrapped(label: str, items: Sequence[str], width: int) -> str:
    """``label: a, b, c`` wrapped between items (a name longer than the line stays whole)."""
    return textwrap.fill(", ".join(items), width, initial_indent=f"  {label}: ", subsequent_indent="    ",
                         break_long_words=False, break_on_hyphens=False)


def fitting_table(out: Console, records: Sequence[Any]) -> Table | None:
    """The widest table of :data:`LAYOUTS` that fits ``out`` with no cell wrapped, or ``None``."""
    for columns in LAYOUTS:
        table = plugin_table(records, columns)
        if Measurement.get(out, out.options.update_width(10_000), table).maximum <= out.width:
            return table
    return None


def print_plugins(out: Console, records: Sequence[Any]) -> None:
    """The widest table that fits, then why each broken plugin is; narrower than any table, a block a plugin."""
    table = fitting_table(out, records)
    if table is not None:
        out.print(table)
        if not any(column.header == "model types" for column in table.columns):
            out.print(Text(NO_MODEL_TYPES))
        for record in records:
            if record.error:
                reason = _wrapped(f"{record.name}: {record.status}", [record.error], out.width).lstrip()
                out.print(Text(reason), soft_wrap=True)
        return
    out.print(f"padfree-plugins {__version__}: plugins", highlight=False)
    for record in records:
        out.print(Text.assemble((record.name, "bold"), f" {record.version or '-'}, {record.source}: ",
                                COLUMNS["status"](record)), soft_wrap=True)
        for label, attribute in BLOCK_LINES.items():
            items = getattr(record, attribute)
            if items:
                out.print(Text(_wrapped(label, [items] if label == "error" else items, out.width)), soft_wrap=True)


def model_type_answer(host: Any, model_type: str) -> dict[str, Any]:
    """Which plugin covers ``model_type`` (its architecture, kind, description), or ``plugin: None`` and a message
    that says why none does and how to add one."""
    found = host.architectures().get(model_type)
    if found is not None:
        spec, plugin = found
        return {"model_type": model_type, "plugin": plugin, "architecture": spec.name, "kind": spec.kind,
                "description": spec.description, "note": host.conflicts.get(("model type", model_type))}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from padfree_plugins.assembly import ADD_AN_ARCHITECTURE
    from padfree_plugins.modeling.probe import PROBE

    unknown = "" if model_type in CONFIG_MAPPING else " transformers does not know it either."
    message = (f"no loaded plugin covers model type {model_type!r}.{unknown}"
               f"{did_you_mean(model_type, host.architectures())}{host.filter_note(model_type)} To try it anyway, "
               f"set architecture: {PROBE} in the acceleration config: assembly then accepts it only after a "
               f"packed-vs-per-example equivalence check on the model itself. {ADD_AN_ARCHITECTURE}")
    return {"model_type": model_type, "plugin": None, "architecture": None, "message": message}


def print_model_type(answer: dict[str, Any], as_json: bool) -> None:
    """``list --model-type``: the answer of :func:`model_type_answer`, exit status 2 when no plugin covers it."""
    if as_json:
        print(json.dumps(answer, indent=2))
        if answer["plugin"] is None:
            raise typer.Exit(code=2)
        return
    if answer["plugin"] is None:
        fail(answer["message"])
    description = f": {answer['description']}" if answer["description"] else ""
    console().print(f"model type {answer['model_type']!r} is covered by plugin {answer['plugin']!r}: architecture "
                    f"{answer['architecture']!r} ({answer['kind']}){description}", highlight=False, soft_wrap=True)
    if answer["note"]:
        console().print(f"[yellow]note:[/] {answer['note']}", highlight=False, soft_wrap=True)


@app.command("list")
def list_plugins(
    model_type: Annotated[Optional[str], typer.Option(
        help="Say which plugin covers this transformers model type (e.g. xlm-roberta), or how to add one.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """List installed plugins: what each provides, the model types it covers, whether it loaded."""
    from padfree_plugins.contract.host import PluginHost

    host = PluginHost()
    host.architectures(), host.tasks(), host.backends()  # resolve, so that precedence notes are recorded
    if model_type is not None:
        print_model_type(model_type_answer(host, model_type), as_json)
        return
    records = sorted(host.records.values(), key=lambda r: (r.source != "builtin", r.name))
    if as_json:
        model_types = {name: {"plugin": plugin, "architecture": spec.name}
                       for name, (spec, plugin) in host.architectures().items()}
        print(json.dumps({"plugins": [r.as_dict() for r in records], "model_types": model_types,
                          "filtered": host.filtered(), "notes": host.notes}, indent=2))
        return
    stdout = console()
    print_plugins(stdout, records)
    for note in host.notes:
        stdout.print(f"[yellow]note:[/] {note}", highlight=False)


@app.command()
def check(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The acceleration config (padfree.yaml).")],
    model_type: Annotated[Optional[str], typer.Option(
        help="A transformers model type, e.g. llama. Give this or --model (one of them is required).")] = None,
    model: Annotated[Optional[Path], typer.Option(
        help="A local model directory (reads its config.json). Give this or --model-type (one of them is "
             "required).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda if available).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Validate CONFIG and show what would be assembled for a model, and every setting, defaults included.

    Name the model with one of --model-type (e.g. llama) or --model (a local directory): one of them is required.
    """
    from transformers import AutoConfig

    from padfree_plugins.assembly import plan
    from padfree_plugins.config.model_configs import check_model_type, load_model_config
    from padfree_plugins.config.schema import PadfreeConfig, load_config
    from padfree_plugins.contract.host import PluginHost

    if model_type is None and model is None:
        fail("check needs a model: give --model-type (e.g. --model-type llama) or --model (a local model "
             "directory); one of them is required")
    if model_type is not None and model is not None:
        fail("give either --model-type or --model, not both")
    try:
        cfg = load_config(config)
        if model is not None:
            model_config = load_model_config(str(model), "--model")
        else:
            check_model_type(model_type, "--model-type")
            model_config = AutoConfig.for_model(model_type)
        host = PluginHost(block=cfg.plugins.block)
        resolved = plan(model_config, cfg, host=host, device_type=device)
    except (PadfreeError, ValueError, OSError) as error:
        fail(error)
    if not host.hook.patch_model.get_hookimpls():  # plan needs no model, so it never asks patch_model
        fail(f"no loaded plugin implements patch_model: assembly would stop with 'no plugin could patch' the "
             f"{model_config.model_type} model.{host.filter_note('core')}")
    settings = resolved_settings(cfg, resolved)
    description = {"config": str(config), **resolved.describe(), "settings": settings,
                   "filtered plugins": host.filtered()}
    if as_json:
        print(json.dumps(description, indent=2, default=str))
        return
    table = Table(title=f"{config}: valid", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in description.items():
        if key not in ("settings", "filtered plugins"):
            table.add_row(key, "\n".join(value) if isinstance(value, list) else str(value))
    table.add_row("plugins filtered out", host.filter_note().strip() or "-")
    table.add_section()
    table.add_row(Text("settings", style="italic"),
                  Text("every key of the config as assembly reads it", style="italic"))
    defaults = resolved_settings(PadfreeConfig(), resolved, task_options={})
    flat_defaults = dict(_flattened(defaults))
    for key, value in _flattened(settings):
        shown = _yaml(value) + (" (default)" if key in flat_defaults and flat_defaults[key] == value else "")
        table.add_row(key, Text(shown))
    console().print(table)


def resolved_settings(cfg: Any, resolved: Any, task_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every key of the config as assembly reads it: the task's options with their defaults, the pooling mode with
    the model's when the config leaves it to the model."""
    settings = cfg.to_dict()
    options = cfg.task_options if task_options is None else task_options
    settings["task_options"] = {**(resolved.task.options or {}), **options}
    if settings["pooling"] is None and resolved.task.needs_pooling:
        settings["pooling"] = resolved.architecture.default_pooling
    return settings


def _flattened(settings: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` for every setting, sections flattened (``batching.strategy``)."""
    rows = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            rows.extend(_flattened(value, f"{prefix}{key}."))
        else:
            rows.append((prefix + key, value))
    return rows


def _yaml(value: Any) -> str:
    """A setting as padfree.yaml can write it: null, true / false, ["a", "b"], {}."""
    return json.dumps(value) if value is None or isinstance(value, (bool, list, dict)) else str(value)
