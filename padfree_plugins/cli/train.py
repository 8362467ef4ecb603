"""``train``: fine-tune a causal LM padding-free with HF Trainer (the command line of :mod:`~padfree_plugins.recipes.
train`), then print the loss curve."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.table import Table

from padfree_plugins.cli.common import console, fail
from padfree_plugins.errors import PadfreeError

app = typer.Typer()


@contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """transformers', datasets' and huggingface_hub's progress bars off unless ``shown`` (in a pipe or a CI log,
    a bar is one line glued together by carriage returns); afterwards, as they were."""
    if shown:
        yield
        return
    import datasets
    from transformers.utils import logging

    were_shown = logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    logging.disable_progress_bar()  # huggingface_hub's too
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if were_shown[0]:
            logging.enable_progress_bar()
        if were_shown[1]:
            datasets.enable_progress_bars()


def print_losses(losses: list[tuple[int, float]]) -> None:
    """The loss curve: one row a logged step, with a bar as long as the loss."""
    table = Table(title="training loss (padding-free)")
    for column in ("step", "loss", ""):
        table.add_column(column, justify="right" if column else "left")
    values = [loss for _, loss in losses]
    low, high = min(values), max(values)
    for step, loss in losses:
        width = 1 + int(39 * (loss - low) / (high - low)) if high > low else 1
        table.add_row(str(step), f"{loss:.4f}", "█" * width)
    console().print(table)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def train(ctx: typer.Context) -> None:
    """Fine-tune a causal LM padding-free with HF Trainer. Every TrainingArguments flag passes through, plus
    --acceleration_config padfree.yaml, --model_name_or_path / --model_config, --dataset (see --help). Without
    a model or a dataset: trains a tiny Llama on the instruction dataset shipped with padfree-plugins."""
    from padfree_plugins.recipes.train import run_train

    stdout = console()
    try:
        with progress_bars(shown=sys.stderr.isatty()):
            report = run_train(ctx.args, print_fn=lambda line: stdout.print(line, highlight=False, markup=False,
                                                                        soft_wrap=True))
    except (PadfreeError, OSError) as error:
        fail(error)
    if report.losses:
        print_losses(report.losses)
    else:
        stdout.print("no training loss was logged (fewer steps than --logging_steps)", highlight=False)
    if report.eval_before is not None:
        stdout.print(f"eval loss: {report.eval_before:.4f} before training -> {report.eval_after:.4f} after",
                     highlight=False)
    stdout.print(f"{report.steps} steps in {report.runtime_s:.1f} s, {report.tokens:,} real tokens "
                 f"({report.tokens_per_s:,.0f} tokens/s, no padding)", highlight=False)
