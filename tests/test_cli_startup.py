"""The command line starts without the heavy stack: ``--version`` and ``--help`` import neither torch nor
transformers, ``list`` not transformers' model code. Imports are checked, not timed (timings are noisy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Runs the command line in a fresh interpreter, then prints the modules it imported (one JSON line, last).
PROBE = """
import json, sys
from padfree_plugins.cli.app import main
sys.argv = ["padfree-plugins", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def imported_by(*args: str) -> set[str]:
    """The modules ``padfree-plugins ARGS`` imports, run in a subprocess."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def heavy(modules: set[str], *packages: str) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in packages)


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("bench", "--help"), ("check", "--help")])
def test_version_and_help_import_neither_torch_nor_transformers(args):
    modules = imported_by(*args)
    assert not heavy(modules, "torch", "transformers", "trl", "datasets", "accelerate", "peft",
                     "sentence_transformers"), heavy(modules, "torch", "transformers")[:5]


def test_import_padfree_plugins_is_light_and_its_exports_load_on_first_use():
    code = ("import sys, padfree_plugins as p; light = 'torch' not in sys.modules and 'transformers' not in "
            "sys.modules; from padfree_plugins import assemble, PackingCollator, PluginHost; "
            "from padfree_plugins.assembly import assemble as a; from padfree_plugins.contract.host import "
            "PluginHost as h; print(light, assemble is a, PluginHost is h, sorted(set(p.__all__) - set(dir(p))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "True", "True", "[]"], done.stderr


def test_list_does_not_import_transformers_model_code():
    """``list`` imports every plugin module (torch and transformers' base package come with some of them); the
    model code (``transformers.modeling_utils``, ~4 s of the start-up) only when a model is patched."""
    modules = imported_by("list", "--json")
    assert "padfree_plugins.builtin.architectures.llama" in modules  # the plugins were loaded
    assert "transformers.modeling_utils" not in modules and not heavy(modules, "trl", "datasets", "peft",
                                                                      "sentence_transformers", "accelerate")
