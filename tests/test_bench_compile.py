"""Smoke test of ``padfree-plugins bench sft --compile`` at minimal sizes (``aot_eager``: no code generation): it
runs, writes its JSON, every compiled variant computes eager padfree's losses, and compiled padfree compiles in at
most 2 graphs, without a break, and recompiles nothing in the timed rounds. Nothing here is timed."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from padfree_plugins.benchmarks.compiled import COMPILE_VARIANTS, run_compile_benchmark
from padfree_plugins.benchmarks.sft import BenchSettings
from padfree_plugins.cli.app import app


def test_compiled_variants_agree_and_padfree_compiles_once_or_twice_without_a_break():
    settings = BenchSettings(model_size="micro", batch_sizes=(3,), laws=("lognormal", "mix"), batches=3, rounds=1,
                             max_length=96)
    result = run_compile_benchmark(settings, backend="aot_eager")
    assert [(r.law, r.variant) for r in result.rows] == [(law, v) for law in settings.laws for v in COMPILE_VARIANTS]
    for row in result.rows:
        assert row.loss_rel_diff < 1e-5, row
        assert row.tokens_per_s > 0 and row.recompiles == 0, row
    compiled = [r for r in result.rows if r.variant == "padfree+compile"]
    assert compiled[0].graphs in (1, 2) and all(r.breaks == 0 for r in compiled), compiled
    assert compiled[0].compile_s > 0
    assert result.environment["padfree backend"] == "exact"


def test_the_command_prints_the_table_and_writes_json(tmp_path):
    result = CliRunner().invoke(app, ["bench", "sft", "--compile", "--compile-backend", "aot_eager", "--model-size",
                                      "micro", "--batch-sizes", "2", "--laws", "lognormal", "--batches", "2",
                                      "--rounds", "1", "--max-length", "64", "--out", str(tmp_path)],
                                 env={"COLUMNS": "220"})  # the whole table, whatever the terminal
    assert result.exit_code == 0, result.output
    assert "padfree+compile" in result.output and "recompiles" in result.output
    rows = json.loads((tmp_path / "bench_sft_compile.json").read_text())["rows"]
    assert [row["variant"] for row in rows] == list(COMPILE_VARIANTS)
