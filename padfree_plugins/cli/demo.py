"""``demo``: a batch run padded and padding-free through tiny models, outputs compared and timed."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from padfree_plugins.cli.common import JsonFlag, console, positive

app = typer.Typer()


@app.command()
def demo(
    batch_size: Annotated[int, positive("Examples per batch.")] = 16,
    median: Annotated[float, positive("Median example length (lognormal law).")] = 120,
    repeats: Annotated[int, positive("Interleaved timing rounds (one step of each variant each).")] = 5,
    threads: Annotated[Optional[int], positive("torch intra-op threads (default 1: on a shared machine, OpenMP "
                                               "barriers on busy cores would decide the timing).")] = 1,
    as_json: JsonFlag = False,
) -> None:
    """Pack a batch, run tiny models padded and padding-free, print both results and the speed ratio.

    The ratio is measured as the benchmarks measure it: interleaved rounds, the ratio taken within each round, its
    median and range printed beside the ideal speed-up of the batch (its padded tokens over its real tokens).
    Progress goes to stderr, one line per stage; the results to stdout.
    """
    from padfree_plugins.recipes.demo import run_demo

    progress = console(stderr=True)
    results = run_demo(batch_size=batch_size, median=median, repeats=repeats, threads=threads,
                       progress=lambda line: progress.print(line, highlight=False, markup=False, soft_wrap=True))
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return
    table = Table(title="padded vs padding-free, same batch, same weights (forward + backward, CPU fp32)")
    for column in ("model", "batch", "real tokens", "padding", "ideal", "max |diff|", "padded tok/s",
                   "padfree tok/s", "speed-up (range)", "backend"):
        table.add_column(column, justify="right")
    for r in results:
        s = r.speedup
        table.add_row(r.model, str(r.batch_size), str(r.real_tokens), f"{r.padding_fraction:.0%}",
                      f"{r.ideal:.2f}x", f"{r.max_abs_diff:.1e}", f"{r.padded_tokens_per_s:,.0f}",
                      f"{r.padfree_tokens_per_s:,.0f}", f"{s.median:.2f}x ({s.low:.2f}-{s.high:.2f})", r.backend)
    stdout = console()
    stdout.print(table)
    rounds, threads_used = results[0].speedup.rounds, results[0].threads
    stdout.print("max |diff|: largest difference between padded and padding-free hidden states of any example.\n"
                 f"speed-up: padded step time over padding-free step time, within each of {rounds} interleaved "
                 f"rounds: the median and (lowest-highest); {threads_used} thread(s). ideal: the padded batch's "
                 "tokens over its real tokens, the speed-up when padding-free computes only real tokens.",
                 highlight=False)
