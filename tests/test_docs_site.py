"""The documentation site: ``mkdocs build --strict`` passes (broken links, anchors and pages left out of the nav
fail it), the configuration page is the generator's output for the schema (so every ``padfree.yaml`` key is on it
and it cannot drift), the README stays a front page, and no page points outside the repository."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from padfree_plugins.config.schema import PadfreeConfig, _help, describe_fields

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
HOOKS = ROOT / "scripts" / "docs_hooks.py"


@pytest.fixture(scope="module")
def reference():
    """scripts/config_reference.py, imported."""
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mkdocs_build(config: Path, site: Path, repo_url: str | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PADFREE_DOCS_REPO_URL"}
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's end-of-life notice, printed on every build
    if repo_url:
        env["PADFREE_DOCS_REPO_URL"] = repo_url
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


# -- the site --------------------------------------------------------------------------------------------------------


def test_the_site_builds_strict(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    front = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Two commands" in front and 'href="configuration/"' in front  # the README, its docs/ links made local
    for page in PAGES:
        assert (tmp_path / "site" / page.relative_to(ROOT / "docs").with_suffix("") / "index.html").is_file(), page


def small_site(tmp_path: Path, page: str) -> Path:
    """A site of one page beside the front page, built with the project's hooks."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text(page, encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    config.write_text(textwrap.dedent(f"""\
        site_name: test
        repo_url: !ENV PADFREE_DOCS_REPO_URL
        hooks: [{HOOKS}]
        validation: {{omitted_files: warn, absolute_links: warn, unrecognized_links: warn, anchors: warn}}
        nav: [index.md, page.md]
        """), encoding="utf-8")
    return config


def test_a_link_to_a_repository_file_becomes_a_repository_address_or_its_text(tmp_path):
    target = os.path.relpath(ROOT / "configs" / "padfree.yaml", tmp_path / "docs")
    config = small_site(tmp_path, f"# Page\n\nSee [the config]({target}).\n")
    plain = mkdocs_build(config, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-4000:]
    html = (tmp_path / "plain" / "page" / "index.html").read_text(encoding="utf-8")
    assert "See the config." in html and "padfree.yaml" not in html
    linked = mkdocs_build(config, tmp_path / "linked", repo_url="https://example.org/padfree")
    assert linked.returncode == 0, linked.stderr[-4000:]
    html = (tmp_path / "linked" / "page" / "index.html").read_text(encoding="utf-8")
    assert 'href="https://example.org/padfree/blob/main/configs/padfree.yaml"' in html


def test_a_link_to_a_missing_file_fails_the_strict_build(tmp_path):
    target = os.path.relpath(ROOT / "configs" / "no_such_config.yaml", tmp_path / "docs")
    config = small_site(tmp_path, f"# Page\n\nSee [the config]({target}).\n")
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "no_such_config.yaml" in result.stderr and "not a file of the repository" in result.stderr


# -- the configuration page ------------------------------------------------------------------------------------------


def test_the_configuration_page_is_the_generators_output(reference):
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == reference.render(), "docs/configuration.md is stale: run python scripts/config_reference.py"


def test_every_key_of_the_schema_and_every_task_option_is_on_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    keys = [key for key, _, _ in describe_fields()]
    assert len(keys) >= 20
    missing = [key for key in keys if f"| `{key}` |" not in page]
    assert not missing, f"docs/configuration.md lacks {missing}"
    task_sections = dict(re.findall(r"^### `(\w+)`\n(.*?)(?=^### |\Z)", page, flags=re.M | re.S))
    assert {"causal_lm", "seq_cls", "reranker", "embedding", "hidden_states"} <= set(task_sections)
    from padfree_plugins.builtin.tasks import causal_lm, embedding, reranker, seq_cls

    for module in (causal_lm, embedding, reranker, seq_cls):
        (task,) = module.register_tasks()
        for option in task.options:
            assert f"| `{option}` |" in task_sections[task.name], (task.name, option)


def test_a_new_config_key_changes_the_generated_page(reference):
    """The deliberate fault: a schema with one more key renders it, so the committed page is stale."""

    @dataclasses.dataclass
    class Extended(PadfreeConfig):
        brand_new_key: int = _help("a key added to the schema", default=3, minimum=1)

    page = reference.render(Extended)
    assert "| `brand_new_key` | integer | `3` | a key added to the schema |" in page
    assert page != (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


# -- the README and the pages ----------------------------------------------------------------------------------------


def test_the_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= 12 * 1024, f"README.md is {len(text.encode())} bytes; move reference to docs/"
    commands = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "make bench" in commands and "make test" in commands
    assert re.search(r"```python\n(?:.*\n)*?.*accelerate\(trainer", text), "the 30-second example is gone"


@pytest.mark.parametrize("path", [README, ROOT / "mkdocs.yml", *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_points_outside_the_repository(path):
    text = path.read_text(encoding="utf-8")
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)\s#]+)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (path.parent / target).resolve()
        assert resolved == ROOT or ROOT in resolved.parents, f"{path.name} links to {target}, outside the repository"
        assert resolved.exists(), f"{path.name} links to {target}, which does not exist"


def test_every_builtin_task_option_is_explained_on_the_tasks_page():
    """The configuration page lists the options (generated); docs/tasks.md says what each does."""
    from padfree_plugins.builtin.tasks import causal_lm, embedding, reranker, seq_cls

    page = (ROOT / "docs" / "tasks.md").read_text(encoding="utf-8")
    section = page.split("## Task options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.M)
    explained = {(task, option) for task, cell in rows for option in re.findall(r"`(\w+)`", cell)}
    for module in (causal_lm, embedding, reranker, seq_cls):
        (task,) = module.register_tasks()
        missing = [option for option in task.options if (task.name, option) not in explained]
        assert not missing, f"docs/tasks.md (Task options) does not explain {task.name}'s {missing}"


def test_every_error_class_is_on_the_errors_page():
    from padfree_plugins import errors

    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    classes = [name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, errors.PadfreeError)]
    assert len(classes) >= 7
    missing = [name for name in classes if f"| `{name}` |" not in page]
    assert not missing, f"docs/errors.md does not describe {missing}"
