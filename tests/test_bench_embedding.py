"""Smoke test of ``padfree-plugins bench embedding`` (tiny sizes; checks parity and bookkeeping, not speed)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from padfree_plugins import PadfreeError
from padfree_plugins.benchmarks.embedding import Workload, parse_workload, run_embedding_benchmark, run_workload
from padfree_plugins.cli import app


@pytest.mark.parametrize("task", ["embedding", "reranker"])
def test_tiny_workload_parity_and_bookkeeping(task):
    result = run_workload(Workload(task, "tiny", 8, 12), batches=1, rounds=1)
    assert result.backend == "exact" and result.device == "cpu"
    assert result.max_loss_diff < 1e-5 and result.max_output_diff < 1e-5
    assert len(result.losses) == 2 and all(a == pytest.approx(b, abs=1e-5) for a, b in result.losses)
    assert 0 < result.real_tokens < result.padded_tokens
    assert result.ideal_speedup == pytest.approx(result.padded_tokens / result.real_tokens)
    assert result.padded_tokens_per_s > 0 and result.padfree_tokens_per_s > 0
    assert 0 < result.padfree_memory_mib < result.padded_memory_mib  # padding inflates saved activations


def test_cli_json():
    out = CliRunner().invoke(app, ["bench", "embedding", "--workload", "embedding:tiny:6:10", "--batches", "1",
                                   "--rounds", "1", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output[out.output.index("["):])
    assert rows[0]["task"] == "embedding" and rows[0]["max_loss_diff"] < 1e-5
    assert {"padded_tokens_per_s", "padfree_tokens_per_s", "of_ideal", "padding_fraction"} <= rows[0].keys()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_a_gpu_fails_loudly():
    with pytest.raises(PadfreeError, match="--device cuda was asked for but torch sees no CUDA device"):
        run_embedding_benchmark(device="cuda")
    out = CliRunner().invoke(app, ["bench", "embedding", "--device", "cuda"])
    assert out.exit_code == 2 and "no CUDA device" in out.output


def test_bad_workload():
    with pytest.raises(PadfreeError, match="task:model:batch_size:median"):
        parse_workload("embedding:tiny:8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("task", ["embedding", "reranker"])
def test_cuda_bf16_fast_backend_parity(task):
    """On a GPU the padding-free side runs a fast varlen kernel in bf16; it agrees with padded sdpa to bf16 noise."""
    result = run_workload(Workload(task, "tiny", 16, 30), device="cuda", dtype="bfloat16", batches=1, rounds=1)
    assert result.backend in ("varlen", "flash_attn")
    assert result.max_output_diff < 5e-2 and result.max_loss_diff < 5e-2
    assert result.padfree_memory_mib < result.padded_memory_mib
