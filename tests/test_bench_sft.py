"""Smoke test of ``padfree-plugins bench sft`` at minimal sizes: it runs, writes its outputs, and the variants
compute the same loss; the ``unpad`` row is a padded batch packed inside the model, never a padded run. Nothing here
is timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from padfree_plugins import PadfreeError
from padfree_plugins.benchmarks.lengths import draw_lengths
from padfree_plugins.benchmarks.sft import VARIANTS, BenchSettings, UnpadRefused, run_sft_benchmark, write_outputs
from padfree_plugins.cli.app import app
from padfree_plugins.modeling import unpad

TINY = dict(model_size="micro", batch_sizes=(3,), laws=("lognormal", "mix"), batches=1, rounds=1, warmup=0,
            max_length=96)


def test_variants_agree_and_outputs_are_written(tmp_path, packed_calls):
    result = run_sft_benchmark(BenchSettings(**TINY))
    assert VARIANTS == ("padded", "hf_native", "unpad", "padfree")
    assert [(r.law, r.variant) for r in result.rows] == [(law, v) for law in TINY["laws"] for v in VARIANTS]
    for row in result.rows:
        assert row.loss_rel_diff < 1e-5, row
        assert row.tokens_per_s > 0 and row.step_ms > 0 and row.memory_bytes > 0
        assert 0 <= row.padding_fraction < 1
    assert {r.backend for r in result.rows if r.variant in ("unpad", "padfree")} == {"exact"}
    unpadded = [r for r in result.rows if r.variant == "unpad"]
    assert all(r.loss_rel_diff <= 1e-6 and r.of_ideal > 0 and r.speedup_vs_padded > 0 for r in unpadded)
    # per law: the memory step and one timed round, each one forward of the base model, packed by unpad
    assert result.environment["unpad steps packed"] == 2 * len(TINY["laws"])
    assert packed_calls == [True] * (2 * len(TINY["laws"]))
    paths = write_outputs(result, tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][0]["variant"] == "padded"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_an_unpad_step_that_runs_padded_is_refused(monkeypatch):
    """Were the padded batch not packed inside the model (unpad off, a batch it does not take), the ``unpad`` row
    would time a padded run: the benchmark refuses instead. A batch without a pad has nothing to unpad (unpad runs
    it as the model's own code, which is padding-free already): counted, not refused."""
    no_pads = BenchSettings(**{**TINY, "laws": ("lognormal",), "batch_sizes": (2,), "max_length": 64})
    result = run_sft_benchmark(no_pads)  # both examples clipped to 64 tokens
    assert {r.padding_fraction for r in result.rows} == {0.0}
    assert result.environment["unpad steps packed"] == 0
    assert result.environment["unpad steps on batches without a pad (nothing to unpad)"] == 2
    monkeypatch.setattr(unpad, "pack_padded_call", lambda *args: None)
    with pytest.raises(UnpadRefused, match="not packed inside the model"):
        run_sft_benchmark(BenchSettings(**{**TINY, "laws": ("lognormal",)}))


def test_mfu_is_six_matmul_parameters_per_token_over_the_peak():
    from padfree_plugins.benchmarks.sft import build_model

    settings = BenchSettings(**{**TINY, "laws": ("lognormal",)}, peak_tflops=0.5)
    result = run_sft_benchmark(settings)
    model = build_model(settings)
    parameters = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    for row in result.rows:
        assert row.mfu == pytest.approx(6 * parameters * row.tokens_per_s / 0.5e12)
    assert result.environment["MFU peak source"] == "given"
    measured = run_sft_benchmark(BenchSettings(**{**TINY, "laws": ("lognormal",)}))
    assert "measured" in measured.environment["MFU peak source"]
    assert measured.environment["MFU peak TFLOP/s"] > 0 and all(row.mfu > 0 for row in measured.rows)


def test_length_laws():
    lognormal = draw_lengths("lognormal", 4000, seed=0, low=8, high=2048)
    assert 110 < sorted(lognormal)[2000] < 130  # median 120
    mix = draw_lengths("mix", 4000, seed=0, low=8, high=2048)
    assert sorted(mix)[2000] < 80 and sum(n > 300 for n in mix) > 500  # mostly short, a long fifth
    with pytest.raises(PadfreeError, match="unknown length law"):
        draw_lengths("uniform", 4, seed=0, low=1, high=2)


def test_cli_prints_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table fits the terminal: a narrow one would wrap its headers
    result = CliRunner().invoke(app, ["bench", "sft", "--model-size", "micro", "--batch-sizes", "2", "--laws",
                                      "lognormal", "--batches", "1", "--rounds", "1", "--warmup", "0",
                                      "--max-length", "64", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "hf_native" in result.output and "padfree" in result.output and "vs padded" in result.output
    assert "unpad" in result.output and "padded [B, L, V] logits" in result.output
    assert "MFU" in result.output
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


def test_dataset_lengths_and_a_model_config(tmp_path):
    from padfree_plugins.benchmarks.lengths import dataset_lengths, sample_lengths

    data = tmp_path / "data.jsonl"
    lengths = [5, 9, 0, 17, 30, 64]
    data.write_text("".join(json.dumps({"input_ids": list(range(n))}) + "\n" for n in lengths))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "vocab_size": 128, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 48}))
    settings = BenchSettings(**{**TINY, "laws": ("dataset",)}, dataset=str(data), model_config=str(config))
    assert dataset_lengths(str(data)) == [5, 9, 17, 30, 64]  # the empty row is left out
    drawn = sample_lengths([5, 9, 17, 30, 64], 200, seed=1, low=1, high=48)
    assert set(drawn) == {5, 9, 17, 30, 48}  # every row can be drawn; longer than the model takes: clipped
    result = run_sft_benchmark(settings)
    assert result.environment["model"] == "Qwen2ForCausalLM"
    assert result.environment["dataset"]["examples"] == 5
    assert [r.law for r in result.rows] == ["dataset"] * len(VARIANTS)
    assert all(r.loss_rel_diff < 1e-5 for r in result.rows)


def test_dataset_errors(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(PadfreeError, match="no input_ids.*--tokenizer"):
        run_sft_benchmark(BenchSettings(**{**TINY, "laws": ("dataset",)}, dataset=str(text)))
    with pytest.raises(PadfreeError, match="needs --dataset"):
        run_sft_benchmark(BenchSettings(**{**TINY, "laws": ("dataset",)}))
    result = CliRunner().invoke(app, ["bench", "sft", "--model-size", "micro", "--dataset", str(tmp_path / "no.jsonl"),
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2 and "does not exist" in result.output
    encoder = tmp_path / "distilbert.json"
    encoder.write_text(json.dumps({"model_type": "distilbert", "vocab_size": 64, "dim": 32, "n_layers": 1,
                                   "n_heads": 2, "hidden_dim": 64}))
    with pytest.raises(PadfreeError, match="cannot build a causal LM.*'distilbert'"):
        run_sft_benchmark(BenchSettings(**TINY, model_config=str(encoder)))


def test_cli_defaults_to_the_dataset_law(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(n))}) + "\n" for n in (3, 7, 12)))
    result = CliRunner().invoke(app, ["bench", "sft", "--model-size", "micro", "--dataset", str(data),
                                      "--batch-sizes", "2", "--batches", "1", "--rounds", "1", "--warmup", "0",
                                      "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert {row["law"] for row in json.loads(result.output)["rows"]} == {"dataset"}


def test_text_rows_are_measured_with_their_tokenizer(tmp_path, monkeypatch):
    from padfree_plugins.benchmarks import lengths as module
    from padfree_plugins.benchmarks.lengths import dataset_lengths
    from padfree_plugins.data.tokenizer import train_tokenizer

    texts = ["a short one", "a somewhat longer sentence of text", "x"]
    tokenizer = train_tokenizer(texts * 20, vocab_size=300)
    tokenizer.save_pretrained(tmp_path / "tok")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    lengths = dataset_lengths(str(data), tokenizer=str(tmp_path / "tok"))
    eos = 1  # the tokenize step appends the end-of-sequence token
    assert lengths == [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + eos for t in texts]
    monkeypatch.setattr(module, "MAX_TOKENIZED_ROWS", 2)  # a larger text dataset: a random sample is tokenized
    sample = dataset_lengths(str(data), tokenizer=str(tmp_path / "tok"))
    assert len(sample) == 2 and set(sample) <= set(lengths)


def test_prompt_share_masks_labels_in_every_variant():
    from padfree_plugins.benchmarks.sft import make_examples

    examples = make_examples([10, 4], vocab=50, seed=0, prompt_share=0.5)
    assert [ex["labels"][:6].count(-100) for ex in examples] == [5, 2]
    assert examples[0]["labels"][5:] == examples[0]["input_ids"][5:]
    result = run_sft_benchmark(BenchSettings(**{**TINY, "laws": ("lognormal",)}, prompt_share=0.5))
    assert all(r.loss_rel_diff < 1e-5 for r in result.rows)
    with pytest.raises(PadfreeError, match="prompt-share"):
        run_sft_benchmark(BenchSettings(**TINY, prompt_share=1.0))


def test_bad_tokenizer_and_model_config_are_clear_errors(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no_such_model"}))
    cases = ((["--dataset", str(text), "--tokenizer", str(tmp_path / "none")], "cannot load the tokenizer"),
             (["--model-config", str(broken)], "not valid JSON"),
             (["--model-config", str(unknown)], "no_such_model"))
    for args, message in cases:
        result = CliRunner().invoke(app, ["bench", "sft", "--model-size", "micro", "--out", str(tmp_path), *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["qwen3_5_hybrid.json", "granite4h_hybrid.json"])
def test_hybrid_configs_run_one_step_and_hf_flattening_is_a_check(name):
    from padfree_plugins.benchmarks.measure import torch_threads
    from padfree_plugins.cli.bench import HYBRID_CONFIGS, hybrid_config_dir

    assert name in HYBRID_CONFIGS
    settings = BenchSettings(**{**TINY, "laws": ("mix",), "max_length": 64},  # lengths 64, 26, 24: padded
                             model_config=str(hybrid_config_dir() / name))
    with torch_threads(1):
        result = run_sft_benchmark(settings)
    assert result.environment["hybrid (sequence mixers)"] is True
    rows = {r.variant: r for r in result.rows}
    assert list(rows) == ["padded", "hf_native", "hf_native+cu_seq_lens", "unpad", "padfree"]
    for timed in (rows["unpad"], rows["padfree"]):
        assert timed.timed and timed.loss_rel_diff < 1e-6 and timed.tokens_per_s > 0 and timed.of_ideal > 0
        assert timed.memory_bytes > 0 and timed.backend == "exact"
    assert result.environment["unpad steps packed"] == 2  # the memory step and one timed round, each checked
    checks = [rows["hf_native"], rows["hf_native+cu_seq_lens"]]
    assert all(not r.timed and r.tokens_per_s != r.tokens_per_s for r in checks)  # not timed: NaN
    assert rows["hf_native"].note == "mixes examples" and rows["hf_native"].loss_rel_diff > 1e-5
    if name.startswith("qwen3_5"):  # the gated delta rule's torch code refuses the boundaries it cannot honour
        assert rows["hf_native+cu_seq_lens"].note.startswith("refuses: ValueError")
    else:  # Mamba2's torch code ignores them
        assert rows["hf_native+cu_seq_lens"].note == "mixes examples"


def test_cli_prints_a_hybrid_table_and_bench_runs_the_shipped_hybrids(tmp_path, monkeypatch):
    from padfree_plugins.cli import bench
    from padfree_plugins.config.model_configs import load_model_config

    monkeypatch.setenv("COLUMNS", "250")
    config = bench.hybrid_config_dir() / "qwen3_5_hybrid.json"
    result = CliRunner().invoke(app, ["bench", "sft", "--model-config", str(config), "--batch-sizes", "2", "--laws",
                                      "lognormal", "--batches", "1", "--rounds", "1", "--warmup", "0",
                                      "--max-length", "48", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "refuses" in result.output and "mixes examples" in result.output and "of ideal" in result.output
    calls = []
    monkeypatch.setattr(bench, "bench_sft", lambda **kwargs: calls.append(kwargs))
    bench.bench_hybrids()
    assert [Path(c["model_config"]).name for c in calls] == list(bench.HYBRID_CONFIGS)
    assert all(c["laws"] == "lognormal" and c["batch_sizes"] == "16" for c in calls)
    assert {load_model_config(c["model_config"]).model_type for c in calls} == {"qwen3_5_text", "granitemoehybrid"}


def test_best_of_n_times_the_shared_row_beside_padfree():
    """``--best-of 4``: every 4 examples answer one prompt; ``padfree+shared`` computes each prompt once (fewer
    tokens, its ideal above 1), with the padded loss, and counts the same real tokens."""
    from padfree_plugins.benchmarks.sft import SHARED_VARIANT, make_examples

    examples = make_examples([20, 30, 25, 40, 22], vocab=200, seed=0, prompt_share=0.6, best_of=4)
    prompt = examples[0]["labels"].count(-100)
    assert prompt == round(0.6 * (20 + 30 + 25 + 40) / 4) and len(examples[1]["input_ids"]) == prompt + 12
    assert all(ex["input_ids"][:prompt] == examples[0]["input_ids"][:prompt] for ex in examples[:4])
    assert examples[4]["input_ids"][:prompt] != examples[0]["input_ids"][:prompt]
    result = run_sft_benchmark(BenchSettings(**{**TINY, "laws": ("lognormal",), "batch_sizes": (8,)},
                                             prompt_share=0.6, best_of=4))
    rows = {r.variant: r for r in result.rows}
    shared = rows[SHARED_VARIANT]
    assert shared.loss_rel_diff < 1e-5 and shared.real_tokens == rows["padfree"].real_tokens
    assert "over padfree, ideal x" in shared.note and float(shared.note.split("ideal x")[1].split()[0]) > 1.2
    # the token ideal, and the one weighted by the LM head + loss timed alone: not shareable, so it lies between 1
    # and the token ideal (a weighted ideal that counted the head as shared, or left it out, would not)
    assert shared.ideal_vs_padfree == pytest.approx(float(shared.note.split("ideal x")[1].split()[0]), abs=0.005)
    assert 1 < shared.weighted_ideal_vs_padfree < shared.ideal_vs_padfree
    assert shared.speedup_vs_padfree > 0 and "cost-weighted ideal x" in shared.note
    assert rows["padfree"].head_loss_ms > 0 and shared.head_loss_ms > 0
    assert all(r.head_loss_ms != r.head_loss_ms for r in result.rows if r.variant not in ("padfree", SHARED_VARIANT))
    with pytest.raises(PadfreeError, match="--best-of 4"):
        run_sft_benchmark(BenchSettings(**TINY, best_of=4))  # no prompt


def test_the_weighted_ideal_weighs_labelled_positions_and_tokens_by_what_padfree_spends_on_them():
    """Per round: a labelled position costs padfree's head-and-loss time over its labelled positions, a computed
    token the rest of its step over its tokens; the ideal is padfree's time over the shared row's at those costs."""
    from padfree_plugins.benchmarks.sft import weighted_ideal

    # round 1: 10 s, 2 of them head + loss; round 2: 20 s, 8 of them; 900 -> 300 tokens, 100 labelled in both
    first, second, third = (10 / (300 * 8 / 900 + 100 * 2 / 100), 20 / (300 * 12 / 900 + 100 * 8 / 100),
                            30 / (300 * 27 / 900 + 100 * 3 / 100))
    assert weighted_ideal([10.0, 20.0, 30.0], [2.0, 8.0, 3.0], (900, 300), (100, 100)) == pytest.approx(
        sorted([first, second, third])[1])
    assert 1 < weighted_ideal([10.0], [2.0], (900, 300), (100, 100)) < 3
    assert weighted_ideal([10.0], [0.0], (900, 300), (100, 100)) == pytest.approx(3)  # no head: the token ideal
    with pytest.raises(ValueError):
        weighted_ideal([10.0, 20.0], [2.0], (900, 300), (100, 100))  # every round needs its head time


def test_the_head_and_loss_are_timed_alone_on_the_steps_own_labelled_positions(monkeypatch):
    """The LM head's call of a step, rerun alone: on the labelled positions only, through the model's loss on the
    step's shift_labels, its gradients cleared after (the next step starts clean)."""
    from padfree_plugins.benchmarks.measure import calls_seen
    from padfree_plugins.benchmarks.sft import (
        SHARED_VARIANT,
        Runner,
        build_model,
        head_and_loss_seconds,
        make_examples,
    )

    settings = BenchSettings(**TINY)
    model = build_model(settings)
    runner = Runner(model, torch.device("cpu"))
    examples = make_examples([30, 40, 24, 50], model.config.vocab_size, 0, prompt_share=0.6, best_of=4)
    inputs = runner.prepare(SHARED_VARIANT, examples)
    runner.enter(SHARED_VARIANT)
    head = model.get_output_embeddings()
    with calls_seen([head]) as calls:
        step_loss = runner.loss(SHARED_VARIANT, inputs)
    labelled = inputs["logits_to_keep"].numel()
    assert len(calls) == 1 and calls[0][1][0].shape[1] == labelled < inputs["input_ids"].shape[-1]
    seen = []
    original = model.loss_function
    runner.close()
    monkeypatch.setattr(type(model), "loss_function",
                        property(lambda self: lambda **kwargs: seen.append(kwargs) or original(**kwargs)))
    assert head_and_loss_seconds(model, calls, inputs) > 0
    assert len(seen) == 1 and seen[0]["shift_labels"] is inputs["shift_labels"]
    assert float(original(**seen[0])) == pytest.approx(float(step_loss), rel=1e-6)  # the step's own loss
    assert all(p.grad is None for p in model.parameters())
