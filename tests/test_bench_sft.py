"""Smoke test of ``padfree-plugins bench sft`` at minimal sizes: it runs, writes its outputs, and the three variants
compute the same loss. Nothing here is timed."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from padfree_plugins import PadfreeError
from padfree_plugins.benchmarks.sft import VARIANTS, BenchSettings, draw_lengths, run_sft_benchmark, write_outputs
from padfree_plugins.cli import app

TINY = dict(model_size="micro", batch_sizes=(3,), laws=("lognormal", "mix"), batches=1, rounds=1, warmup=0,
            max_length=96)




def test_variants_agree_and_outputs_are_written(tmp_path):
    result = run_sft_benchmark(BenchSettings(**TINY))
    assert [(r.law, r.variant) for r in result.rows] == [(law, v) for law in TINY["laws"] for v in VARIANTS]
    for row in result.rows:
        assert row.loss_rel_diff < 1e-5, row
        assert row.tokens_per_s > 0 and row.step_ms > 0 and row.memory_bytes > 0
        assert 0 <= row.padding_fraction < 1
    assert {r.backend for r in result.rows if r.variant == "padfree"} == {"exact"}
    paths = write_outputs(result, tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][0]["variant"] == "padded"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_length_laws():
    lognormal = draw_lengths("lognormal", 4000, seed=0, low=8, high=2048)
    assert 110 < sorted(lognormal)[2000] < 130  # median 120
    mix = draw_lengths("mix", 4000, seed=0, low=8, high=2048)
    assert sorted(mix)[2000] < 80 and sum(n > 300 for n in mix) > 500  # mostly short, a long fifth
    with pytest.raises(PadfreeError, match="unknown length law"):
        draw_lengths("uniform", 4, seed=0, low=1, high=2)


def test_cli_prints_the_table(tmp_path):
    result = CliRunner().invoke(app, ["bench", "sft", "--model-size", "micro", "--batch-sizes", "2", "--laws",
                                      "lognormal", "--batches", "1", "--rounds", "1", "--warmup", "0",
                                      "--max-length", "64", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "hf_native" in result.output and "padfree" in result.output and "vs padded" in result.output
    assert (tmp_path / "bench_sft.png").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_fails_loudly(tmp_path):
    result = CliRunner().invoke(app, ["bench", "sft", "--device", "cuda", "--dtype", "bfloat16", "--model-size", "1b",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "CUDA is not available" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_run_uses_a_fast_backend_and_measures_cuda_memory():
    result = run_sft_benchmark(BenchSettings(device="cuda", dtype="bfloat16", **{**TINY, "laws": ("lognormal",)}))
    padfree = next(r for r in result.rows if r.variant == "padfree")
    assert padfree.backend in ("varlen", "flash_attn")
    assert all(r.memory_kind == "cuda peak" and r.memory_bytes > 0 for r in result.rows)
    assert all(r.loss_rel_diff < 2e-2 for r in result.rows)
