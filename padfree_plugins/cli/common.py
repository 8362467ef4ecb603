"""What the commands share: the console, the error exit, options that take positive numbers."""

from __future__ import annotations

import os
from typing import Annotated, Any, Callable, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

#: The ``--json`` flag of the commands that print a table.
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def console(stderr: bool = False) -> Console:
    """Rich's console on stdout (or stderr), as wide as the terminal or ``COLUMNS``; in a pipe or CI log without
    ``COLUMNS``, 160 columns, wide enough for the benchmark tables."""
    terminal = Console(stderr=stderr)
    if terminal.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return terminal
    return Console(stderr=stderr, width=160)


def progress_lines(prefix: str, shown: bool = True) -> Callable[[str], None] | None:
    """Where a long command reports progress: one ``[prefix] …`` line each, on stderr, so that stdout holds the
    results alone; ``None`` (no progress) unless ``shown`` (``--json``: the output is JSON alone)."""
    if not shown:
        return None
    err = console(stderr=True)
    return lambda line: err.print(f"[{prefix}] {line}", highlight=False, markup=False, soft_wrap=True)


def fail(error: Exception | str) -> NoReturn:
    """Print ``error: ...`` (one line per line of the message, never wrapped: it may be searched for) and exit with
    status 2, as a usage error does."""
    console().print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _check_positive(value: Optional[float]) -> Optional[float]:
    if value is not None and value <= 0:
        raise typer.BadParameter(f"{value:g} is not a positive number")
    return value


def positive(text: str) -> Any:
    """An option that takes numbers above 0 only: anything else is a usage error that names the value."""
    return typer.Option(callback=_check_positive, help=text)


def positive_ints(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``4,16``), or a usage error naming the option and value."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of positive integers, e.g. 4,16",
                                 param_hint=f"'{option}'")
    return values
