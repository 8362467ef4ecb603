"""The config's documentation: ``configs/padfree.yaml`` shows every key of the schema with its default and a
comment, and the batching figures of ``docs/scaling.md``'s summary are those of its benchmark table.

The documentation site's configuration page, generated from the
schema: tests/test_docs_site.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from padfree_plugins.config.schema import PadfreeConfig, describe_fields, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = ROOT / "configs" / "padfree.yaml"


def schema_keys() -> set[str]:
    return {key for key, _, _ in describe_fields()}


def file_keys(data: dict, sections: set[str], prefix: str = "") -> set[str]:
    """Dotted keys of a loaded YAML mapping, descending into the schema's sections only (``task_options: {}`` is a
    key whose value is a mapping)."""
    keys = set()
    for key, value in data.items():
        dotted = prefix + key
        if dotted in sections and isinstance(value, dict):
            keys |= file_keys(value, sections, dotted + ".")
        else:
            keys.add(dotted)
    return keys


def test_padfree_yaml_has_every_key_of_the_schema():
    sections = {key.rsplit(".", 1)[0] for key in schema_keys() if "." in key}
    data = yaml.safe_load(DOCUMENTED.read_text(encoding="utf-8"))
    keys = file_keys(data, sections)
    assert not schema_keys() - keys, f"{DOCUMENTED.name} does not document {sorted(schema_keys() - keys)}"
    assert not keys - schema_keys(), f"{DOCUMENTED.name} has keys the schema lacks: {sorted(keys - schema_keys())}"


def test_padfree_yaml_validates_and_shows_the_defaults():
    assert load_config(DOCUMENTED).to_dict() == PadfreeConfig().to_dict()


def test_every_key_of_padfree_yaml_has_a_comment():
    """A key's own line, or a line above it in its paragraph (up to a blank line), carries a ``#`` comment."""
    lines = DOCUMENTED.read_text(encoding="utf-8").splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)(\w+):", line)
        if not match:
            continue
        start = number
        while start > 0 and lines[start - 1].strip():
            start -= 1
        if not any("#" in text for text in lines[start:number + 1]):
            undocumented.append(match.group(2))
    assert not undocumented, f"keys without a comment in {DOCUMENTED.name}: {undocumented}"


def test_scaling_summary_batching_figures_are_the_benchmark_table():
    """The summary's "against 1.15 / 1.43 on average for fixed N-example batches" is the lognormal rows of the
    balance table of ``padfree-plugins bench batching`` in docs/scaling.md (2 and 8 ranks)."""
    page = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    summary = " ".join(page.split("## At a glance", 1)[1].split("\n## ", 1)[0].split())
    claim = re.search(r"against ([\d.]+) / ([\d.]+) on average for fixed (\d+)-example batches", summary)
    assert claim, "docs/scaling.md's At a glance section no longer states the example-count batches' spread"
    rows = re.findall(r"^\| lognormal \| (\d+) \| examples \(bs=(\d+)\) \| [^|]+\| [^|]+\| ([\d.]+) \|",
                      page, flags=re.M)
    table = {int(ranks): (int(bs), float(spread)) for ranks, bs, spread in rows}
    assert set(table) == {2, 8}, rows
    assert {bs for bs, _ in table.values()} == {int(claim.group(3))}
    assert [round(table[2][1], 2), round(table[8][1], 2)] == [float(claim.group(1)), float(claim.group(2))]
