"""Smoke test of ``padfree-plugins bench dpo`` / ``bench grpo`` at the micro size: they run, write their outputs, the
three variants compute the same loss and gradient, and the accelerated rows really ran packed. Nothing here is
timed."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from padfree_plugins import PadfreeError
from padfree_plugins.benchmarks.preference import (
    GRPO_GENERATIONS,
    VARIANTS,
    PROMPT_SHARES,
    NotPacked,
    PreferenceSettings,
    dpo_examples,
    grpo_batch,
    run_preference_benchmark,
    write_outputs,
)
from padfree_plugins.cli.app import app
from padfree_plugins.modeling import unpad

MICRO = dict(model_size="micro", batches=1, rounds=1)
#: The forwards each variant runs packed: DPO's reference too on the native path, never on the generic one.
PACKED = {"dpo": {"padded": "none", "generic": "policy", "native": "policy + reference", "shared": "policy + reference"},
          "grpo": {"padded": "none", "generic": "policy", "native": "policy", "shared": "policy"}}
#: Completions per batch of the GRPO runs here: one group.
GRPO_BATCH = GRPO_GENERATIONS


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_variants_agree_and_outputs_are_written(trainer, tmp_path):
    batch = 4 if trainer == "dpo" else GRPO_BATCH
    result = run_preference_benchmark(PreferenceSettings(trainer=trainer, batch_size=batch, **MICRO))
    rows = {r.variant: r for r in result.rows}
    assert list(rows) == list(VARIANTS) == ["padded", "generic", "native", "shared"]
    assert {v: r.packed for v, r in rows.items()} == PACKED[trainer]
    native = f"{trainer.upper()}TrainerPatch (plugin trl_{trainer})"
    assert result.environment["plugins"] == {"padded": "none", "generic": "AnyTrainerPatch (plugin any_trainer)",
                                             "native": native, "shared": native}
    for row in result.rows:
        assert row.rows == (8 if trainer == "dpo" else GRPO_BATCH)  # DPO: chosen and rejected rows of 4 pairs
        assert 0 < row.padding_fraction < 1 and row.real_tokens > 0
        assert row.tokens_per_s > 0 and row.step_ms > 0 and row.memory_bytes > 0
        assert row.loss_rel_diff < 1e-5 and row.loss_abs_diff < 1e-5 and row.grad_rel_diff < 1e-5, row
    for row in (rows["generic"], rows["native"]):
        assert row.of_ideal > 0 and row.memory_ratio < 1  # fewer activations than padded at any padding
        assert set(row.targets()) == {"speed", "memory", "loss"}
    # shared computes each prompt once: fewer tokens than native (which computes the real ones), in the ratio it
    # reports as its ideal
    shared = rows["shared"]
    assert rows["native"].tokens_computed == rows["native"].real_tokens > shared.tokens_computed
    assert shared.ideal_vs_native == rows["native"].tokens_computed / shared.tokens_computed > 1.2
    assert shared.speedup_vs_native > 0 and set(shared.targets()) == {"vs native", "memory", "loss"}
    assert 0.4 < shared.prompt_share < 0.9
    assert rows["padded"].targets() == {} and rows["padded"].loss_rel_diff == 0
    paths = write_outputs(result, tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert [r["variant"] for r in saved["rows"]] == list(VARIANTS) and saved["settings"]["trainer"] == trainer
    assert "| native |" in paths["markdown"].read_text() and "| shared |" in paths["markdown"].read_text()


def test_in_float64_the_packed_losses_are_the_padded_ones():
    """With the body in float64 (TRL's fused head computes in float32 either way), what remains of the float32 loss
    differences is gone: the packed paths compute padded's loss."""
    result = run_preference_benchmark(PreferenceSettings(trainer="dpo", batch_size=3, dtype="float64", **MICRO))
    assert [r.loss_abs_diff < 1e-12 for r in result.rows] == [True] * len(VARIANTS)
    with pytest.raises(PadfreeError, match="--dtype must be float32 or float64"):
        run_preference_benchmark(PreferenceSettings(dtype="bfloat16"))


def test_an_accelerated_row_that_runs_padded_is_refused(monkeypatch):
    """Were the batch not packed (the plugins' packing off), the generic and native rows would time padded runs: the
    benchmark stops instead."""
    monkeypatch.setattr(unpad, "pack_padded_call", lambda *args: None)
    with pytest.raises(NotPacked, match="generic policy forward did not run on one packed row"):
        run_preference_benchmark(PreferenceSettings(trainer="dpo", batch_size=2, **MICRO))


def test_a_shared_row_that_shares_nothing_is_refused(monkeypatch):
    """Were the prompts not shared, the shared row would time native's run: the benchmark stops instead."""
    monkeypatch.setattr(unpad, "shared_rows", lambda *args: None)
    with pytest.raises(NotPacked, match="shared policy forward did not run on one packed row of fewer than"):
        run_preference_benchmark(PreferenceSettings(trainer="dpo", batch_size=2, **MICRO))


def test_length_laws_give_the_prompt_shares_and_pad():
    """The default batches: DPO's prompt + chosen / prompt + rejected rows (prompts 60% of the tokens, ~55% padding),
    GRPO's left-padded prompts (repeated per generation) beside right-padded completions (prompts 75%, ~40%
    padding); a prompt share given is the share drawn."""

    def dpo_figures(seed: int, share: float) -> tuple[float, float]:
        examples = dpo_examples(8, 4096, seed, 2048, share)
        rows = [len(ex["prompt_ids"]) + len(ex[key]) for key in ("chosen_ids", "rejected_ids") for ex in examples]
        prompts = 2 * sum(len(ex["prompt_ids"]) for ex in examples)
        return 1 - sum(rows) / (len(rows) * max(rows)), prompts / sum(rows)

    def grpo_figures(seed: int, share: float) -> tuple[float, float]:
        batch = grpo_batch(16, 4096, seed, 2048, share)
        assert (batch["prompt_mask"][:, -1] == 1).all() and (batch["completion_mask"][:, 0] == 1).all()
        assert (batch["prompt_ids"][::GRPO_GENERATIONS] == batch["prompt_ids"][1::GRPO_GENERATIONS]).all()
        mask = [batch["prompt_mask"], batch["completion_mask"]]
        real = sum(int(m.sum()) for m in mask)
        return 1 - real / (16 * sum(m.shape[1] for m in mask)), int(mask[0].sum()) / real

    def means(figures, share):
        drawn = [figures(seed, share) for seed in range(20)]
        return statistics.mean(p for p, _ in drawn), statistics.mean(s for _, s in drawn)

    padding, share = means(dpo_figures, PROMPT_SHARES["dpo"])
    assert 0.5 < padding < 0.65 and abs(share - 0.6) < 0.03
    padding, share = means(grpo_figures, PROMPT_SHARES["grpo"])
    assert 0.35 < padding < 0.5 and abs(share - 0.75) < 0.04
    assert abs(means(dpo_figures, 0.1)[1] - 0.1) < 0.03 and abs(means(grpo_figures, 0.1)[1] - 0.1) < 0.03


def test_cli_prints_the_table_and_writes_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    result = CliRunner().invoke(app, ["bench", "dpo", "--quick", "--batch-size", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "generic" in result.output and "native" in result.output and "of ideal" in result.output
    assert "targets:" in result.output and "policy + reference" in result.output
    assert (tmp_path / "bench_dpo.json").is_file() and (tmp_path / "bench_dpo.md").is_file()
    result = CliRunner().invoke(app, ["bench", "grpo", "--quick", "--batch-size", str(GRPO_BATCH), "--out",
                                      str(tmp_path), "--json", "--prompt-share", "0.1"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]  # stderr: progress bars
    assert [row["variant"] for row in rows] == list(VARIANTS) and rows[0]["prompt_share"] < 0.3


def test_cli_errors_and_help():
    result = CliRunner().invoke(app, ["bench", "grpo", "--quick", "--batch-size", "6"])
    assert result.exit_code == 2 and f"multiple of {GRPO_GENERATIONS}" in result.output
    result = CliRunner().invoke(app, ["bench", "dpo", "--batches", "0"])
    assert result.exit_code == 2 and "0 is not a positive number" in result.output
    for command in ("dpo", "grpo"):
        result = CliRunner().invoke(app, ["bench", command, "--help"])
        assert result.exit_code == 0 and "--quick" in result.output
    with pytest.raises(PadfreeError, match="unknown trainer"):
        run_preference_benchmark(PreferenceSettings(trainer="ppo"))


def test_bench_runs_dpo_and_grpo(monkeypatch):
    from padfree_plugins.cli import bench

    calls = []
    for name in ("bench_collator", "bench_sft", "bench_hybrids", "bench_dpo", "bench_grpo", "bench_vlm",
                 "bench_embedding", "bench_batching"):
        monkeypatch.setattr(bench, name, lambda name=name, **options: calls.append(
            (name, options.get("prompt_share")) if options else name))
    bench.bench_all(SimpleNamespace(invoked_subcommand=None))
    assert calls == ["bench_collator", "bench_sft", "bench_hybrids", "bench_dpo", ("bench_dpo", 0.1),
                     ("bench_dpo", None), "bench_grpo", ("bench_grpo", 0.1), ("bench_grpo", None), "bench_vlm",
                     "bench_embedding", "bench_batching"]


def test_shared_is_held_to_its_target_at_the_default_prompt_share_and_to_no_cost_elsewhere():
    from padfree_plugins.benchmarks.preference import SHARED_FLOOR, SHARED_TARGETS, shared_target

    from padfree_plugins.benchmarks.preference import SHARED_MEMORY, shared_memory_target

    for trainer in ("dpo", "grpo"):
        assert shared_target(PreferenceSettings(trainer=trainer)) == SHARED_TARGETS[trainer]
        assert shared_target(PreferenceSettings(trainer=trainer, prompt_share=0.1)) == SHARED_FLOOR
        assert shared_memory_target(PreferenceSettings(trainer=trainer)) == SHARED_MEMORY[trainer]
        assert shared_memory_target(PreferenceSettings(trainer=trainer, prompt_share=0.1)) == 1.0
    assert (SHARED_TARGETS["grpo"], SHARED_MEMORY["grpo"]) == (2.4, 0.5)
    assert shared_target(PreferenceSettings(trainer="grpo", law="tree"), 3.0) == pytest.approx(0.85 * 3.0)


def test_tree_law_builds_episodes_whose_turns_share_at_equal_positions():
    """``--law tree``: one episode per batch, every prompt of one length (no left pads: their common turns stand at
    equal positions), four prompts (2 x 2 branches) each under a quarter of the rows; the prompts share turn 1 and,
    by pairs, turn 2, never turn 3; depth1_tokens counts each whole prompt once."""
    from padfree_plugins.benchmarks.preference import TREE_HISTORY, depth1_tokens, grpo_tree_batch

    batch = grpo_tree_batch(16, 4096, 3, 2048)
    prompts = batch["prompt_ids"]
    assert (batch["prompt_mask"] == 1).all() and (batch["completion_mask"][:, 0] == 1).all()
    leaves = prompts[::4]
    assert (prompts == leaves.repeat_interleave(4, 0)).all()  # 4 rollouts per prompt
    real = real_tokens_of(batch)
    width = prompts.shape[1]
    history = round(width * TREE_HISTORY)
    turn2 = (width - history) // 2

    def common(a: torch.Tensor, b: torch.Tensor) -> int:
        differ = (a != b).nonzero()
        return int(differ[0]) if len(differ) else len(a)

    assert common(leaves[0], leaves[1]) >= history + turn2 and common(leaves[2], leaves[3]) >= history + turn2
    assert history <= common(leaves[0], leaves[2]) < history + turn2  # turn 2 branches
    assert common(leaves[0], leaves[1]) < width  # turn 3 branches
    assert depth1_tokens(batch) == real - 4 * 3 * (width - 1)
    groups = grpo_batch(16, 4096, 3, 2048)  # groups of 8 under prompts of their own: each prompt once
    assert depth1_tokens(groups) == real_tokens_of(groups) - sum(
        (GRPO_GENERATIONS - 1) * (int(mask.sum()) - 1) for mask in groups["prompt_mask"][::GRPO_GENERATIONS])
    with pytest.raises(PadfreeError, match="multiple of 4"):
        grpo_tree_batch(6, 4096, 3, 2048)


def real_tokens_of(batch: dict) -> int:
    return int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())


def test_tree_law_shares_deeper_than_whole_prompts_and_depth1_is_what_depth1_sharing_computes(monkeypatch):
    """On episode trees shared computes fewer tokens than sharing whole prompts only would (its ideal above the
    depth-1 one), and is held to 85% of its ideal. Deliberate fault: a trie cut to depth 1 (each whole prompt a key
    of its own) computes exactly depth1_tokens — the depth-1 ideal reported is the one depth-1 sharing reaches."""
    from padfree_plugins.benchmarks.preference import TREE_OF_IDEAL
    from padfree_plugins.packing.prefixes import shared_layout

    settings = PreferenceSettings(trainer="grpo", batch_size=8, law="tree", **MICRO)
    shared = run_preference_benchmark(settings).rows[-1]
    assert shared.variant == "shared" and shared.packed == "policy"
    assert shared.ideal_vs_native > shared.depth1_vs_native > 1.2
    assert shared.shared_target == pytest.approx(TREE_OF_IDEAL * shared.ideal_vs_native)
    assert shared.loss_rel_diff < 1e-5 and shared.grad_rel_diff < 1e-5
    monkeypatch.setattr(unpad, "prefix_tree", lambda lengths, shareable, chunk=1, declined=None: shared_layout(
        lengths, [(len(s), tuple(s)) if s else None for s in shareable], chunk))
    flat = run_preference_benchmark(settings).rows[-1]
    assert flat.ideal_vs_native == pytest.approx(flat.depth1_vs_native) == pytest.approx(shared.depth1_vs_native)
    assert flat.loss_rel_diff < 1e-5
    with pytest.raises(PadfreeError, match="unknown length law 'tree' for dpo"):
        run_preference_benchmark(PreferenceSettings(trainer="dpo", law="tree"))


def small_hybrid(tmp_path, name: str) -> str:
    """A shipped hybrid config (configs/bench) made smaller: the test's seconds, the same layer kinds."""
    from padfree_plugins.cli.bench import hybrid_config_dir

    config = json.loads((hybrid_config_dir() / name).read_text())
    config.update(hidden_size=64, vocab_size=512, num_hidden_layers=4, layer_types=config["layer_types"][:4])
    if "mamba_n_heads" in config:  # Mamba2's heads x head size = expand x hidden size
        config.update(mamba_n_heads=4, mamba_d_head=32)
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("name", ["qwen3_5_hybrid.json", "granite4h_hybrid.json"])
def test_cli_model_config_runs_grpo_on_a_hybrid_with_shared_prompts(name, tmp_path, monkeypatch):
    """``bench grpo --model-config``: the hybrids share their groups' prompts (mixers continuing each prompt's
    state; the prompts of a few hundred tokens pay for the chunk rule), held to 2.4x native and 0.5x its memory; the
    Granite shape (no experts) shares despite TRL's router-loss check."""
    monkeypatch.setenv("COLUMNS", "250")
    result = CliRunner().invoke(app, ["bench", "grpo", "--quick", "--model-config", small_hybrid(tmp_path, name),
                                      "--batch-size", str(GRPO_BATCH), "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    saved = json.loads(result.stdout)
    rows = {row["variant"]: row for row in saved["rows"]}
    assert saved["environment"]["model"].startswith(("Qwen3_5", "GraniteMoeHybrid"))
    shared = rows["shared"]
    assert shared["packed"] == "policy" and shared["ideal_vs_native"] > 2
    assert shared["depth1_vs_native"] == pytest.approx(shared["ideal_vs_native"], rel=0.05)
    assert (shared["shared_target"], shared["shared_memory_target"]) == (2.4, 0.5)
    assert shared["memory_vs_native"] < 1 and shared["loss_rel_diff"] < 1e-5 and shared["grad_rel_diff"] < 1e-4


def test_cli_tree_law_prints_its_targets(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    result = CliRunner().invoke(app, ["bench", "grpo", "--quick", "--law", "tree", "--batch-size", "8", "--out",
                                      str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "episode trees" in result.output and "depth 1" in result.output and "85% of its ideal" in result.output
    result = CliRunner().invoke(app, ["bench", "dpo", "--quick", "--law", "tree"])
    assert result.exit_code != 0 and "unknown length law 'tree' for dpo" in result.output
