"""``bench longctx`` at the test suite's size: its tiled variants really tile (MLP in 2 tiles, loss in 16) and train
the same loss as checkpointing alone; the summary's arithmetic."""

from __future__ import annotations

from padfree_plugins.benchmarks.longctx import LongContextResult, LongContextSettings, Measurement, measure


def test_the_tiled_variants_compute_the_loss_of_checkpointing_alone():
    # hidden 64: MLP tiles of 1024 tokens (2 in a row of 2048), loss tiles of 128 (1024 x 224 / 1984 -> 128)
    losses = {variant: measure("llama", variant, 2048, 64, 1, 512, "cpu", steps=1).loss
              for variant in ("checkpointing", "+ tiled MLP", "+ tiled loss")}
    assert abs(losses["+ tiled MLP"] - losses["checkpointing"]) < 1e-5
    assert abs(losses["+ tiled loss"] - losses["checkpointing"]) < 1e-5


def test_the_summary_compares_the_longest_row_and_fits_the_budget():
    settings = LongContextSettings(shapes=("llama",), lengths=(1024, 4096), budget_gib=1.0)  # 0.1 MiB a token
    result = LongContextResult(settings, [
        Measurement("llama", "checkpointing", 1024, 100 << 20, 1000.0, 1.0, "cpu"),
        Measurement("llama", "checkpointing", 4096, 400 << 20, 1000.0, 1.0, "cpu"),
        Measurement("llama", "+ tiled loss", 1024, 30 << 20, 900.0, 1.0, "cpu"),
        Measurement("llama", "+ tiled loss", 4096, 120 << 20, 900.0, 1.0, "cpu")])
    lines = "\n".join(result.summary("llama"))
    assert "tiled peak = 0.30 x checkpointing alone" in lines
    assert "growth 4,096 / 1,024 tokens, tiled: 4.00 x" in lines
    assert "tiled 0.90 x checkpointing alone (target" in lines
    assert "checkpointing: ~10,485 tokens" in lines and "+ tiled loss: ~34,952 tokens" in lines


def test_the_variants_option_names_the_benchmarks_variants_and_refuses_unknown_ones():
    import pytest
    import typer

    from padfree_plugins.benchmarks.longctx import variants_of
    from padfree_plugins.cli.bench import longctx_variants

    assert longctx_variants("all") == ()
    assert longctx_variants("checkpointing, mixers") == ("checkpointing", "+ tiled mixers")
    assert variants_of("llama") == ["checkpointing", "+ tiled MLP", "+ tiled loss"]  # no sequence mixers
    assert variants_of("qwen3_5")[-1] == "+ tiled mixers"
    with pytest.raises(typer.Exit):
        longctx_variants("checkpointing,mixer")


def test_the_summary_of_a_shape_with_mixers_compares_everything_tiled():
    settings = LongContextSettings(shapes=("qwen3_5",), lengths=(1024, 4096), budget_gib=1.0)
    rows = [Measurement("qwen3_5", variant, tokens, peak << 20, 1000.0, 1.0, "cpu", 500.0)
            for variant, peaks in (("checkpointing", (100, 400)), ("+ tiled loss", (40, 160)),
                                   ("+ tiled mixers", (20, 80))) for tokens, peak in zip((1024, 4096), peaks)]
    lines = "\n".join(LongContextResult(settings, rows).summary("qwen3_5"))
    assert "tiled peak = 0.20 x checkpointing alone" in lines
    assert "per CPU-second 1.00 x" in lines and "+ tiled mixers: ~" in lines and "+ tiled loss: ~" not in lines


def test_rounds_compare_each_round_under_its_own_load():
    from padfree_plugins.benchmarks.longctx import medians

    settings = LongContextSettings(shapes=("qwen3_5",), lengths=(16384,), rounds=3)
    # checkpointing's tokens/CPU-s moves with the load; each round's tiled run is 0.9, 0.95, 1.0 x its own
    samples = [Measurement("qwen3_5", variant, 16384, 10 << 20, 100.0, 1.0, "cpu", cpu * scale, round_, 5.0)
               for round_, (cpu, tiled) in enumerate(((1000.0, 0.9), (2000.0, 0.95), (500.0, 1.0)))
               for variant, scale in (("checkpointing", 1.0), ("+ tiled mixers", tiled))]
    rows = [medians([s for s in samples if s.variant == v]) for v in ("checkpointing", "+ tiled mixers")]
    result = LongContextResult(settings, rows, samples)
    assert abs(result.cpu_ratio("qwen3_5", "+ tiled mixers", 16384) - 0.95) < 1e-9
    assert rows[0].tokens_per_cpu_s == 1000.0 and rows[1].tokens_per_cpu_s == 900.0  # medians of the rounds
    assert "per CPU-second 0.95 x" in "\n".join(result.summary("qwen3_5"))
