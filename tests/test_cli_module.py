"""The command line as a module and its version: ``python -m padfree_plugins`` (so that ``torchrun -m
padfree_plugins train ...`` works) and ``--version``, which prints the one version of the package: pyproject.toml's,
as the installed distribution reports it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import padfree_plugins

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def pyproject_version() -> str:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def test_the_version_is_pyprojects_as_installed():
    """One version: pyproject.toml's, read back from the installed distribution (reinstall after changing it)."""
    installed, source = importlib.metadata.version("padfree-plugins"), pyproject_version()
    assert installed == source, f"installed {installed}, pyproject.toml {source}: reinstall (make setup)"
    assert padfree_plugins.__version__ == source


def test_python_m_padfree_plugins_runs_the_command_line():
    done = run(sys.executable, "-m", "padfree_plugins", "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"padfree-plugins {pyproject_version()}", done
    done = run(sys.executable, "-m", "padfree_plugins", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m padfree_plugins" in done.stdout and "train" in done.stdout and "bench" in done.stdout
    done = run(sys.executable, "-m", "padfree_plugins", "no-such-command")
    assert done.returncode == 2 and "No such command" in done.stderr


def test_the_console_script_prints_the_version():
    script = Path(sys.executable).parent / "padfree-plugins"
    if not script.exists():
        pytest.skip("padfree-plugins is not installed as a console script beside this interpreter")
    done = run(str(script), "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"padfree-plugins {pyproject_version()}", done


def test_torchrun_runs_the_module():
    """``torchrun -m padfree_plugins ...``: every process runs the command line (one process here)."""
    pytest.importorskip("torch")
    done = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
               "padfree_plugins", "--version", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"padfree-plugins {pyproject_version()}" in done.stdout.splitlines()
