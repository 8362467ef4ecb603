"""mkdocs hooks of the documentation site (``mkdocs.yml``).

* The front page is ``README.md`` itself (``index.md`` is generated from it), so the two cannot differ.
* A link to a repository file outside ``docs/`` (``../configs/padfree.yaml``, or ``configs/padfree.yaml`` from the
  README) works on GitHub but not on the site: it becomes a link into the repository when ``repo_url`` is set
  (``PADFREE_DOCS_REPO_URL``), else its text. A link to a path the repository does not have is a warning, so
  ``mkdocs build --strict`` fails on it as it does on a broken link between pages.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
#: Pages generated from repository files: page -> source, relative to the repository root.
GENERATED = {"index.md": "README.md"}
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
log = logging.getLogger("mkdocs.hooks.padfree_docs")


def on_files(files, config):
    for page, source in GENERATED.items():
        if files.get_file_from_path(page) is None:
            files.append(File.generated(config, page, content=(ROOT / source).read_text(encoding="utf-8")))
    return files


def source_of(page) -> Path:
    """The repository file a page was written in."""
    if page.file.abs_src_path:
        return Path(page.file.abs_src_path)
    return ROOT / GENERATED[page.file.src_uri]


def repo_link(path: Path, config) -> str | None:
    """The repository's web address of ``path``, or None without ``repo_url``."""
    if not config.repo_url:
        return None
    branch = config.extra.get("repo_branch", "main")
    kind = "tree" if path.is_dir() else "blob"
    return f"{config.repo_url.rstrip('/')}/{kind}/{branch}/{path.relative_to(ROOT).as_posix()}"


def rewrite(match: re.Match, page, config) -> str:
    text, target = match.group("text"), match.group("target")
    if "://" in target or target.startswith(("#", "mailto:")):
        return match.group(0)
    where, _, anchor = target.partition("#")
    source = source_of(page)
    path = (source.parent / where).resolve()
    docs = Path(config.docs_dir).resolve()
    if path == docs or docs in path.parents:  # a page of the site: relative to this page's place in it
        page_dir = posixpath.dirname(page.file.src_uri)
        inside = path.relative_to(docs).as_posix()
        if path.is_dir():  # a folder of pages: its index page
            inside = posixpath.join(inside, "index.md") if inside != "." else "index.md"
        relative = posixpath.relpath(inside, page_dir or ".")
        return f"[{text}]({relative}{'#' + anchor if anchor else ''})"
    shown = GENERATED.get(page.file.src_uri) if not page.file.abs_src_path else page.file.src_uri
    if ROOT not in path.parents or not path.exists():
        log.warning(f"{shown} links to {target!r}, which is not a file of the repository")
        return match.group(0)
    address = repo_link(path, config)
    return f"[{text}]({address})" if address else text


def on_page_markdown(markdown, page, config, files):
    lines, in_code = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_code = not in_code
        lines.append(line if in_code else LINK.sub(lambda m: rewrite(m, page, config), line))
    return "".join(lines)
