"""What each process of ``padfree-plugins trl <script>`` runs: TRL's own script, its trainer made padding-free.

``python -m padfree_plugins.recipes.trl_run sft [TRL's arguments] --acceleration_config padfree.yaml`` parses the
script's arguments with TRL's own parser (the script's ``make_parser``) plus :class:`AccelerationArguments`, then
calls the script's ``main()`` inside :func:`~padfree_plugins.integrations.on_train.accelerating_on_train`: the
trainer TRL builds is accelerated when its ``train()`` starts. Nothing of TRL's scripts is copied.
``padfree-plugins trl`` (:mod:`.trl_launch`) starts this module through ``accelerate launch``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.arguments import AccelerationArguments
from padfree_plugins.integrations.on_train import accelerating_on_train

#: TRL's training scripts (``trl/scripts/<name>.py``) that ``padfree-plugins trl`` runs.
SCRIPTS = ("sft", "dpo", "grpo", "rloo", "kto", "reward")


def script_module(name: str) -> Any:
    """TRL's script module ``trl.scripts.<name>``; an unknown name is an error that lists the known ones."""
    if name not in SCRIPTS:
        raise ConfigError(f"unknown TRL script {name!r}: choose one of {', '.join(SCRIPTS)} "
                          f"(padfree-plugins trl <script> [TRL's arguments] --acceleration_config padfree.yaml)")
    return importlib.import_module(f"trl.scripts.{name}")


def script_parser(name: str, prog: str | None = None) -> Any:
    """TRL's own parser of script ``name`` (its ``make_parser``), with :class:`AccelerationArguments` added last."""
    from trl import TrlParser

    trl_parser = script_module(name).make_parser(prog=prog)
    return TrlParser([*trl_parser.dataclass_types, AccelerationArguments], prog=prog)


def run_script(argv: Sequence[str]) -> None:
    """Run TRL's script ``argv[0]`` with the arguments ``argv[1:]``, padding-free when ``--acceleration_config``
    (or an ``acceleration_config:`` key of TRL's ``--config`` YAML) is given, as TRL runs it otherwise."""
    if not argv:
        raise ConfigError(f"name a TRL script: one of {', '.join(SCRIPTS)}")
    name, args = argv[0], list(argv[1:])
    parser = script_parser(name, prog=f"padfree-plugins trl {name}")
    # as TRL's scripts do: keys of the --config YAML meant for accelerate launch are not the script's
    *script_args, acceleration = parser.parse_args_and_config(args, fail_with_unknown_args=False)
    main = script_module(name).main
    if acceleration.config is None:
        warnings.warn(f"padfree-plugins trl {name}: no --acceleration_config given, so TRL's script trains as "
                      f"`trl {name}` does (padded)", stacklevel=1)
        main(*script_args)
        return
    with accelerating_on_train(acceleration.config) as applied:
        main(*script_args)
    if not applied:
        raise PadfreeError(f"padfree-plugins trl {name}: the script trained no transformers Trainer, so nothing was "
                           "made padding-free (a trainer is made padding-free when its train() starts)")
    for done in applied:
        accelerator = done.trainer.accelerator
        if accelerator.is_main_process:
            print(summary(done, accelerator.num_processes), flush=True)


def summary(done: Any, processes: int) -> str:
    """``padfree-plugins: GRPOTrainer trained padding-free on 1 process(es), plugin trl_grpo (fused calls: 6 packed,
    0 padded)``: the trainer, its plugin and, for TRL's fused log-probability calls, how they ran."""
    text = f"padfree-plugins: {type(done.trainer).__name__} trained padding-free on {processes} process(es)"
    if done.trainer_plugin:
        text += f", plugin {done.trainer_plugin}"
    calls = done.describe().get("fused calls")
    return text + (f" (fused calls: {calls})" if calls else "")


def main(argv: Sequence[str] | None = None) -> None:
    """The launched process: :func:`run_script`; a :class:`PadfreeError` is printed as ``error: …`` and the process
    exits non-zero."""
    try:
        run_script(sys.argv[1:] if argv is None else argv)
    except PadfreeError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
