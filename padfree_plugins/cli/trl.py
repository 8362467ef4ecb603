"""``trl``: run TRL's own training scripts padding-free (``padfree-plugins trl sft … --acceleration_config …``)."""

from __future__ import annotations

import typer

from padfree_plugins.cli.common import fail
from padfree_plugins.errors import PadfreeError

app = typer.Typer()


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def trl(ctx: typer.Context) -> None:
    """Run TRL's script (sft, dpo, grpo, rloo, kto, reward) with its trainer made padding-free:
    padfree-plugins trl sft [TRL's arguments] --acceleration_config padfree.yaml. Launched through accelerate
    as `trl sft` is (--num_processes, --config_file …); `padfree-plugins trl sft --help` lists the arguments."""
    if ctx.args[:1] in (["-h"], ["--help"]):
        typer.echo(ctx.get_help())
        raise typer.Exit()
    from padfree_plugins.recipes.trl_launch import launch

    try:
        launch(ctx.args)
    except PadfreeError as error:
        fail(error)
