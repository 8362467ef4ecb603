"""``padfree-plugins trl <script> [TRL's arguments] --acceleration_config padfree.yaml``: ``trl <script>``,
padding-free.

The command line is split exactly as ``trl <script>`` splits it (TRL 1.16's ``TrainingCommand``): what TRL's parser
of the script (plus ``--acceleration_config``) does not take goes to ``accelerate launch`` (``--num_processes``,
``--config_file``, ``--multi_gpu``, ``--machine_rank`` …; TRL's ``--accelerate_config NAME`` too), the rest to the
script. Then ``accelerate launch -m padfree_plugins.recipes.trl_run <script> …`` starts every process on TRL's
script, whose trainer is made padding-free once built (:mod:`.trl_run`). The arguments are parsed, and the
acceleration config read and validated, before anything is launched.
"""

from __future__ import annotations

from collections.abc import Sequence

from padfree_plugins.errors import ConfigError
from padfree_plugins.recipes.trl_run import SCRIPTS, script_parser

#: The module every launched process runs.
RUN_MODULE = "padfree_plugins.recipes.trl_run"


def without_subsequence(items: Sequence[str], subsequence: Sequence[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (each of its entries removed once, in order)."""
    rest = iter(subsequence)
    pending = next(rest, None)
    kept = []
    for item in items:
        if pending is not None and item == pending:
            pending = next(rest, None)
        else:
            kept.append(item)
    return kept


def launch_arguments(argv: Sequence[str]) -> list[str]:
    """The ``accelerate launch`` command line (without ``accelerate launch``) for ``padfree-plugins trl argv``."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    if not argv or argv[0] not in SCRIPTS:
        given = f" (got {argv[0]!r})" if argv else ""
        raise ConfigError(f"name a TRL script first{given}: padfree-plugins trl <{'|'.join(SCRIPTS)}> "
                          "[TRL's arguments] --acceleration_config padfree.yaml")
    name, args = argv[0], list(argv[1:])
    parser = script_parser(name, prog=f"padfree-plugins trl {name}")
    # -h exits here with TRL's help of the script, --acceleration_config included
    *_, config_remaining, cli_remaining = parser.parse_args_and_config(
        args, return_remaining_strings=True, separate_remaining_strings=True)
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = without_subsequence(args, cli_remaining)
    return [*launch_args, "--module", RUN_MODULE, name, *script_args]


def launch(argv: Sequence[str]) -> None:
    """Parse ``argv`` as ``trl`` does and start the processes through ``accelerate launch``."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args(launch_arguments(argv)))
