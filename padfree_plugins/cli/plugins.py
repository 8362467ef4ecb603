"""``list`` (the installed plugins) and ``check`` (what a config assembles for a model)."""

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
from padfree_plugins.errors import PadfreeError

app = typer.Typer()

STATUS_STYLES = {"ok": "green", "error": "red", "blocked": "yellow"}
#: What a plugin record shows in each column of ``list``; lists of names hold one name per line.
COLUMNS: dict[str, Callable[[Any], Any]] = {
    "name": lambda r: r.name,
    "version": lambda r: r.version or "-",
    "source": lambda r: r.source,
    "hooks": lambda r: "\n".join(r.hooks) or "-",
    "architectures": lambda r: "\n".join(r.architectures) or "-",
    "tasks": lambda r: "\n".join(r.tasks) or "-",
    "backends": lambda r: "\n".join(r.backends) or "-",
    "provides": lambda r: "\n".join([*r.architectures, *r.tasks, *r.backends]) or "-",
    "status": lambda r: Text(r.status, style=STATUS_STYLES.get(r.status, "")),
}
#: The tables of ``list``, widest first: the first that fits the console is printed, else one block per plugin.
LAYOUTS = (("name", "version", "source", "hooks", "architectures", "tasks", "backends", "status"),
           ("name", "source", "hooks", "provides", "status"))


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
        for record in records:
            if record.error:
                reason = _wrapped(f"{record.name}: {record.status}", [record.error], out.width).lstrip()
                out.print(Text(reason), soft_wrap=True)
        return
    out.print(f"padfree-plugins {__version__}: plugins", highlight=False)
    for record in records:
        out.print(Text.assemble((record.name, "bold"), f" {record.version or '-'}, {record.source}: ",
                                COLUMNS["status"](record)), soft_wrap=True)
        for label in ("hooks", "architectures", "tasks", "backends", "error"):
            items = getattr(record, label)
            if items:
                out.print(Text(_wrapped(label, [items] if label == "error" else items, out.width)), soft_wrap=True)


@app.command("list")
def list_plugins(as_json: JsonFlag = False) -> None:
    """List installed plugins: what each provides and whether it loaded."""
    from padfree_plugins.contract.host import PluginHost

    host = PluginHost()
    host.architectures(), host.tasks(), host.backends()  # resolve, so that precedence notes are recorded
    records = sorted(host.records.values(), key=lambda r: (r.source != "builtin", r.name))
    if as_json:
        print(json.dumps({"plugins": [r.as_dict() for r in records], "notes": host.notes}, indent=2))
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
    """Validate CONFIG and show what would be assembled for a model.

    Name the model with one of --model-type (e.g. llama) or --model (a local directory): one of them is required.
    """
    from transformers import AutoConfig

    from padfree_plugins.assembly import plan
    from padfree_plugins.config.model_configs import check_model_type, load_model_config
    from padfree_plugins.config.schema import load_config

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
        resolved = plan(model_config, cfg, device_type=device)
    except (PadfreeError, ValueError, OSError) as error:
        fail(error)
    description = {"config": str(config), **resolved.describe()}
    if as_json:
        print(json.dumps(description, indent=2, default=str))
        return
    table = Table(title=f"{config}: valid", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in description.items():
        table.add_row(key, "\n".join(value) if isinstance(value, list) else str(value))
    console().print(table)
