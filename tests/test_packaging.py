"""The release artefacts: ``python -m build`` makes the sdist and, from it, the wheel; ``twine check`` passes their
metadata; the wheel, installed into a clean venv, is what runs there: ``padfree-plugins list`` finds every builtin
plugin through the installed entry points, and the shipped dataset is read from the installed package.

The clean venv gets its dependencies (torch, transformers, ...) from this suite's environment through a ``.pth``
file appended after the venv's own site-packages, never the project itself: the suite's own padfree-plugins install
(editable) and its plugins are left out, so a file missing from the wheel cannot be found in the checkout instead.
The build runs without isolation, with this environment's setuptools (the ``test`` extra requires it), so it needs
no network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of transformers (huggingface_hub)

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME = PYPROJECT["project"]["name"].replace("-", "_")
VERSION = PYPROJECT["project"]["version"]
ENTRY_POINTS = PYPROJECT["project"]["entry-points"]["padfree_plugins"]
#: Package data the CLI reads at run time (``padfree-plugins train``'s default dataset).
PACKAGE_DATA = ["padfree_plugins/data/instructions.jsonl"]
#: What a build from the sdist needs besides the package's modules.
SDIST_FILES = ["pyproject.toml", "README.md", "PKG-INFO", *PACKAGE_DATA]
#: Left out of the copy the build runs on (the checkout stays untouched: no egg-info, no build/ written into it).
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "out", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", ".whl")
TIMEOUT = 300


def require(module: str) -> None:
    """Fail, not skip, without a tool of the ``test`` extra: a missing install must not pass CI unnoticed."""
    try:
        __import__(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: pip install -c constraints.txt -e '.[test]'")


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def shared_dir(tmp_path_factory) -> Path:
    """This run's temporary folder, shared by the xdist workers (so that only one of them builds)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel ``python -m build`` makes (the wheel built from the unpacked sdist)."""
    require("build")
    root = shared_dir(tmp_path_factory)
    work = root / "packaging"
    with FileLock(str(root / "packaging.lock")):
        if not (work / "built").exists():
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(ROOT, work / "source", ignore=NOT_SOURCES)
            run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(work / "dist"),
                 str(work / "source")])
            (work / "built").touch()
    sdists = list((work / "dist").glob("*.tar.gz"))
    wheels = list((work / "dist").glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in (work / "dist").iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0], "work": work, "lock": root / "packaging.lock"}


def test_build_makes_an_sdist_and_a_wheel_of_this_version(built):
    assert built["sdist"].name == f"{NAME}-{VERSION}.tar.gz"
    assert built["wheel"].name == f"{NAME}-{VERSION}-py3-none-any.whl"


def test_twine_check_passes(built):
    require("twine")
    result = run([sys.executable, "-m", "twine", "check", "--strict", str(built["sdist"]), str(built["wheel"])])
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_sdist_holds_what_a_build_needs(built):
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = [name for name in SDIST_FILES if name not in names]
    assert not missing, f"missing from the sdist: {missing}"
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "padfree_plugins").rglob("*.py")}
    assert not modules - names, f"modules missing from the sdist: {sorted(modules - names)[:10]}"


def test_the_wheel_holds_the_package_its_data_and_every_entry_point(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(f"{NAME}-{VERSION}.dist-info/entry_points.txt").decode()
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "padfree_plugins").rglob("*.py")}
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)[:10]}"
    assert not [name for name in PACKAGE_DATA if name not in names], names
    assert "padfree-plugins = padfree_plugins.cli:main" in entry_points
    for name, module in ENTRY_POINTS.items():
        assert f"{name} = {module}" in entry_points, name


def site_packages(venv: Path) -> Path:
    found = list((venv / "lib").glob("python3*/site-packages"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def clean_venv(built) -> Path:
    """A venv holding the built wheel and nothing else of the project; its dependencies come from this suite's
    site-packages (linked entry by entry, without the project's own distributions and without ``.pth`` files, so
    that no editable install of the checkout is reachable)."""
    work = built["work"]
    venv = work / "venv"
    with FileLock(str(built["lock"])):
        if not (work / "venv-ready").exists():
            make_clean_venv(venv, work / "dependencies", built["wheel"])
            (work / "venv-ready").touch()
    return venv


def make_clean_venv(venv: Path, dependencies: Path, wheel: Path) -> None:
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    dependencies.mkdir()
    for directory in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(directory).iterdir():
            project_own = entry.name.lower().startswith(("padfree", "__editable__", "_padfree"))
            if project_own or entry.suffix == ".pth" or (dependencies / entry.name).exists():
                continue
            (dependencies / entry.name).symlink_to(entry)
    (site_packages(venv) / "zz_suite_dependencies.pth").write_text(f"{dependencies}\n")
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", "-q", str(wheel)], env=clean_env(), cwd=venv.parent)


def clean_env() -> dict[str, str]:
    """This environment without what would import the checkout or decide which plugins load."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "PADFREE_PLUGINS_ALLOW", "PADFREE_PLUGINS_BLOCK",
                          "PADFREE_PLUGINS_TRACE", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}


def test_the_installed_wheel_is_what_the_clean_venv_imports(clean_venv):
    probe = ("import json, padfree_plugins; from importlib.resources import files; "
             "from padfree_plugins.data.loading import DEFAULT_DATASET; "
             "data = files('padfree_plugins.data').joinpath(DEFAULT_DATASET); "
             "print(json.dumps({'file': padfree_plugins.__file__, 'data': str(data), 'text': data.read_text()}))")
    result = run([str(clean_venv / "bin" / "python"), "-c", probe], env=clean_env(), cwd=clean_venv.parent)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    installed = site_packages(clean_venv).resolve()
    assert Path(seen["file"]).resolve().is_relative_to(installed), seen["file"]
    # the dataset `padfree-plugins train` reads by default, found where train's loader looks: the installed package
    assert Path(seen["data"]).resolve().is_relative_to(installed), seen["data"]
    assert seen["text"] == (ROOT / PACKAGE_DATA[0]).read_text() != ""


def test_padfree_plugins_list_in_the_clean_venv_finds_every_builtin_entry_point(clean_venv):
    result = run([str(clean_venv / "bin" / "padfree-plugins"), "list", "--json"], env=clean_env(),
                 cwd=clean_venv.parent)
    listed = json.loads(result.stdout)
    plugins = {plugin["name"]: plugin for plugin in listed["plugins"]}
    builtin = {name for name, plugin in plugins.items() if plugin["source"] == "builtin"}
    assert builtin == set(ENTRY_POINTS), (sorted(set(ENTRY_POINTS) - builtin), sorted(builtin - set(ENTRY_POINTS)))
    assert len(builtin) == len(ENTRY_POINTS) > 90
    broken = {name: plugin["error"] for name, plugin in plugins.items() if plugin["status"] != "ok"}
    assert not broken, broken
    assert set(plugins) == builtin, "the clean venv holds no third-party plugin"
    for name in ("llama", "bert", "causal_lm"):
        assert plugins[name]["module"] == ENTRY_POINTS[name], plugins[name]
        assert plugins[name]["version"] == VERSION
    assert "llama" in plugins["llama"]["model_types"] and "bert" in plugins["bert"]["model_types"]
    assert listed["model_types"]["llama"]["plugin"] == "llama"
