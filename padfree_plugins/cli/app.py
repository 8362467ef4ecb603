"""The ``padfree-plugins`` command line: list plugins, check a config, run the demonstration, train, benchmark.

One module a command group: :mod:`.plugins` (``list``, ``check``), :mod:`.demo`, :mod:`.train`, :mod:`.bench`;
:mod:`.common` holds what they share.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from padfree_plugins import __version__
from padfree_plugins.cli import bench, demo, plugins, train, trl

# rich_markup_mode=None: click's plain help, which (unlike typer's rich panels) shows no "<bool>" type for flags;
# max_content_width: help as wide as the terminal, up to 120 columns (click's default stops at 80)
app = typer.Typer(help="Padding-free training for the Hugging Face stack.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None,
                  context_settings={"max_content_width": 120})
app.add_typer(plugins.app)
app.add_typer(demo.app)
app.add_typer(train.app)
app.add_typer(trl.app)
app.add_typer(bench.app, name="bench")


def _version(value: bool) -> None:
    if value:
        print(f"padfree-plugins {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Show the version and exit.")] = None,
) -> None:
    """Padding-free training for the Hugging Face stack."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
