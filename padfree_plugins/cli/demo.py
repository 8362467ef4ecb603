"""``demo``: a batch run padded and padding-free through tiny models, outputs compared and timed."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from padfree_plugins.cli.common import JsonFlag, console, positive

app = typer.Typer()


@app.command()
def demo(
    batch_size: Annotated[int, positive("Examples per batch.")] = 16,
    median: Annotated[float, positive("Median example length (lognormal law).")] = 120,
    repeats: Annotated[int, positive("Timed repeats per variant.")] = 5,
    as_json: JsonFlag = False,
) -> None:
    """Pack a batch, run tiny models padded and padding-free, print both results and the speed ratio.

    Progress goes to stderr, one line per stage; the results to stdout.
    """
    from padfree_plugins.recipes.demo import run_demo

    progress = console(stderr=True)
    results = run_demo(batch_size=batch_size, median=median, repeats=repeats,
                       progress=lambda line: progress.print(line, highlight=False, markup=False, soft_wrap=True))
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
    stdout = console()
    stdout.print(table)
    stdout.print("max |diff|: largest difference between padded and padding-free hidden states of any example.")
