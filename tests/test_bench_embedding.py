"""Smoke test of ``padfree-plugins bench embedding`` (tiny sizes; checks parity and bookkeeping, not speed)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from padfree_plugins import PadfreeError
from padfree_plugins.benchmarks.embedding import Workload, parse_workload, run_embedding_benchmark, run_workload
from padfree_plugins.cli.app import app


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


def test_dataset_lengths_drive_the_batches(tmp_path):
    """``--dataset``: an embedding dataset of text columns, tokenized with a local tokenizer; every text is one
    example, and the batches draw their lengths from those texts."""
    from padfree_plugins.benchmarks.embedding import make_batches, with_dataset_lengths
    from padfree_plugins.benchmarks.lengths import dataset_lengths
    from padfree_plugins.data.tokenizer import train_tokenizer

    rows = [{"anchor": "a short query", "positive": "a much longer passage of text that answers the query"},
            {"anchor": "another", "positive": None}]
    train_tokenizer([r["positive"] or r["anchor"] for r in rows] * 10, vocab_size=300).save_pretrained(tmp_path / "tok")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = dataset_lengths(str(data), tokenizer=str(tmp_path / "tok"), texts="each")
    assert len(lengths) == 3  # three texts; the missing positive counts as no example
    (workload,) = with_dataset_lengths((Workload("embedding", "tiny", 6, 12),), lengths)
    batch = make_batches(workload, 1, vocab_size=1000)[0]
    low = workload.min_length  # the shortest text a workload builds (CLS, a token, SEP and one more)
    assert {len(ex[k]) for ex in batch.examples for k in ex} <= {max(n, low) for n in lengths}
    out = CliRunner().invoke(app, ["bench", "embedding", "--workload", "embedding:tiny:6:10", "--batches", "1",
                                   "--rounds", "1", "--dataset", str(data), "--tokenizer", str(tmp_path / "tok"),
                                   "--json"])
    assert out.exit_code == 0, out.output
    (result,) = json.loads(out.output)
    assert result["median"] == pytest.approx(sorted(lengths)[1]) and result["max_loss_diff"] < 1e-5
    missing = CliRunner().invoke(app, ["bench", "embedding", "--dataset", str(data)])
    assert missing.exit_code == 2 and "--tokenizer" in missing.output
