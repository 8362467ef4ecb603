"""The ``padfree-plugins`` command line: list plugins, check a config, run the demonstration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import PadfreeError

app = typer.Typer(help="Padding-free training for the Hugging Face stack.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
console = Console()
if not console.is_terminal:  # pipes and CI logs: wide enough for the tables
    console = Console(width=160)


def _version(value: bool) -> None:
    if value:
        console.print(f"padfree-plugins {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Show the version and exit.")] = None,
) -> None:
    """Padding-free training for the Hugging Face stack."""


def _fail(error: Exception) -> None:
    console.print(f"[bold red]error:[/] {error}", highlight=False)
    raise typer.Exit(code=2)


@app.command("list")
def list_plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List installed plugins: what each provides and whether it loaded."""
    from .host import PluginHost

    host = PluginHost()
    host.architectures(), host.tasks(), host.backends()  # resolve, so that precedence notes are recorded
    records = sorted(host.records.values(), key=lambda r: (r.source != "builtin", r.name))
    if as_json:
        print(json.dumps({"plugins": [r.as_dict() for r in records], "notes": host.notes}, indent=2))
        return
    table = Table(title=f"padfree-plugins {__version__}: plugins")
    for column in ("name", "version", "source", "hooks", "architectures", "tasks", "backends", "status"):
        table.add_column(column, overflow="fold")
    for r in records:
        status = "[green]ok[/]" if r.status == "ok" else f"[red]{r.status}[/]: {r.error}"
        table.add_row(r.name, r.version or "-", r.source, ", ".join(r.hooks) or "-",
                      ", ".join(r.architectures) or "-", ", ".join(r.tasks) or "-", ", ".join(r.backends) or "-",
                      status)
    console.print(table)
    for note in host.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


@app.command()
def check(
    config: Annotated[Path, typer.Argument(help="The acceleration config (padfree.yaml).")],
    model_type: Annotated[Optional[str], typer.Option(help="A transformers model type, e.g. llama.")] = None,
    model: Annotated[Optional[Path], typer.Option(help="A local model directory (reads its config.json).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda if available).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Validate CONFIG and show what would be assembled for a model type or a local model."""
    from transformers import AutoConfig

    from .assembly import plan
    from .config import load_config

    try:
        cfg = load_config(config)
        if (model_type is None) == (model is None):
            raise PadfreeError("give exactly one of --model-type or --model")
        model_config = AutoConfig.from_pretrained(model) if model else AutoConfig.for_model(model_type)
        resolved = plan(model_config, cfg, device_type=device)
    except (PadfreeError, ValueError, OSError) as error:
        _fail(error)
    description = {"config": str(config), **resolved.describe()}
    if as_json:
        print(json.dumps(description, indent=2, default=str))
        return
    table = Table(title=f"{config}: valid", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in description.items():
        table.add_row(key, "\n".join(value) if isinstance(value, list) else str(value))
    console.print(table)


@app.command()
def demo(
    batch_size: Annotated[int, typer.Option(help="Examples per batch.")] = 16,
    median: Annotated[float, typer.Option(help="Median example length (lognormal law).")] = 120,
    repeats: Annotated[int, typer.Option(help="Timed repeats per variant.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Pack a batch, run tiny models padded and padding-free, print both results and the speed ratio."""
    from .demo import run_demo

    results = run_demo(batch_size=batch_size, median=median, repeats=repeats)
    if as_json:
        print(json.dumps([{**r.__dict__, "speedup": r.speedup} for r in results], indent=2))
        return
    table = Table(title="padded vs padding-free, same batch, same weights (forward + backward, CPU fp32)")
    for column in ("model", "batch", "real tokens", "padding", "max |diff|", "padded tok/s", "padfree tok/s",
                   "speedup", "backend"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.model, str(r.batch_size), str(r.real_tokens), f"{r.padding_fraction:.0%}",
                      f"{r.max_abs_diff:.1e}", f"{r.padded_tokens_per_s:,.0f}", f"{r.padfree_tokens_per_s:,.0f}",
                      f"{r.speedup:.2f}x", r.backend)
    console.print(table)
    console.print("max |diff|: largest difference between padded and padding-free hidden states of any example.")


bench_app = typer.Typer(help="Benchmarks: side-by-side ratios measured in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("collator")
def bench_collator(
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "4,16,64",
    batches: Annotated[int, typer.Option(help="Batches per round.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Our packing collator vs transformers.DataCollatorWithFlattening on identical batches."""
    from .benchmarks.collator import run_collator_benchmark

    results = [run_collator_benchmark(int(bs), batches) for bs in batch_sizes.split(",")]
    if as_json:
        print(json.dumps([{**r.__dict__, "ratio": r.ratio} for r in results], indent=2))
        return
    table = Table(title="collator time per batch (lognormal lengths, median 120): ours vs HF flattening")
    for column in ("batch size", "ours ms", "HF ms", "ours / HF"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r.batch_size), f"{r.ours_ms:.3f}", f"{r.hf_ms:.3f}", f"{r.ratio:.2f}")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
