"""Smoke test of ``padfree-plugins bench dpo --vision`` / ``bench grpo --vision`` at minimal sizes: each runs
through the CLI and writes its outputs, the packed variants (``native``, and ``shared``: each prompt's images once)
compute the padded losses and gradients, every packed
forward ran on the packed row (a fused call left padded stops the benchmark), and real tokens are the padded batch's
non-pad tokens. Nothing here is timed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from padfree_plugins.benchmarks import vision_preference
from padfree_plugins.benchmarks.preference import NotPacked
from padfree_plugins.benchmarks.vision_preference import QUICK, VisionPreferenceSettings, dpo_batch
from padfree_plugins.cli.app import app
from padfree_plugins.integrations import trl_fused

pytest.importorskip("PIL")
pytest.importorskip("trl")


@pytest.mark.parametrize("trainer,batch_size", [("dpo", "3"), ("grpo", "8")])
def test_the_command_runs_packed_and_writes_its_outputs(trainer, batch_size, tmp_path):
    result = CliRunner().invoke(app, ["bench", trainer, "--vision", "--quick", "--batch-size", batch_size, "--out",
                                      str(tmp_path)], env={"COLUMNS": "220"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / f"bench_{trainer}_vision.json").read_text())
    padded, native, shared = data["rows"]
    assert (padded["variant"], native["variant"], shared["variant"]) == ("padded", "native", "shared")
    assert data["images"] > 0
    for row in (native, shared):
        assert row["packed"] == ("policy + reference" if trainer == "dpo" else "policy")
        assert row["loss_rel_diff"] < 1e-5 and row["grad_rel_diff"] < 1e-4
    assert padded["real_tokens"] == native["real_tokens"] == shared["real_tokens"]
    assert 0 < padded["padding_fraction"] < 1
    # each prompt's images once: the tower's pixel rows halved (DPO pairs) or cut by the group size (GRPO)
    rows = data["tower_rows"]
    assert rows["padded"] == rows["native"] == (2 if trainer == "dpo" else 8) * rows["shared"] > 0, rows
    assert shared["tokens_computed"] < native["tokens_computed"]
    assert shared["ideal_vs_native"] == pytest.approx((native["tokens_computed"] + rows["native"]) /
                                                      (shared["tokens_computed"] + rows["shared"]))
    assert native["tokens_per_s"] > 0 and native["memory_ratio"] > 0 and set(data["targets met"]) == {"speed",
                                                                                                       "memory"}
    assert "native" in result.output and "targets" in result.output
    costs = data["costs"]  # measured in the rounds: the towers alone, and the ideal weighted by what they cost
    assert costs["tower_ms_per_step"]["native"] > 0 and costs["tower_ms_per_step"]["shared"] > 0
    assert costs["pixel_row_vs_token"] > 0 and costs["cost_weighted_ideal"] > 0
    assert "ideal weighted by measured cost" in (tmp_path / f"bench_{trainer}_vision.md").read_text()


def test_the_cost_weighted_ideal_weighs_pixel_rows_and_tokens_by_what_native_spends_on_them():
    """Per round: a pixel row costs native's tower time over its pixel rows, a token the rest of its step over its
    tokens; the ideal is native's time over shared's tokens and pixel rows at those costs."""
    from padfree_plugins.benchmarks.preference import PreferenceRow

    def row(variant, tokens):
        return PreferenceRow(variant, 2, 0, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0, 0.0, "policy", tokens_computed=tokens)

    native = vision_preference.TowerTimed("native", None, None, seconds=[10.0, 20.0], tower_seconds=[1, 1, 4, 4])
    shared = vision_preference.TowerTimed("shared", None, None, seconds=[4.0, 8.0], tower_seconds=[0.2] * 4)
    costs = vision_preference.measured_costs([row("native", 90), row("shared", 30)], [native, shared],
                                             {"native": 800, "shared": 100})
    # round 1: a pixel row 2 / 800 s, a token 8 / 90 s; round 2: 8 / 800 and 12 / 90
    first, second = 10 / (30 * 8 / 90 + 100 * 2 / 800), 20 / (30 * 12 / 90 + 100 * 8 / 800)
    assert costs["cost_weighted_ideal"] == pytest.approx((first + second) / 2)
    assert costs["pixel_row_vs_token"] == pytest.approx(((2 / 800) / (8 / 90) + (8 / 800) / (12 / 90)) / 2)
    assert costs["tower_ms_per_step"] == pytest.approx({"native": 2500.0, "shared": 200.0})


def test_real_tokens_are_the_padded_batchs_non_pad_tokens():
    """The DPO batch is TRL's layout: chosen rows then rejected rows, each prompt's images in both."""
    from padfree_plugins.testing.vision import image_text_processor, tiny_vision_language_model

    processor = image_text_processor("qwen2_5_vl", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 96)
    config = tiny_vision_language_model("qwen2_5_vl", processor).config
    batch = dpo_batch(processor, config, VisionPreferenceSettings(batch_size=3), 0)
    assert batch["input_ids"].shape[0] == 6 and (batch["attention_mask"] == 0).any()
    images = (batch["input_ids"] == config.image_token_id).sum(1)
    assert images[:3].tolist() == images[3:].tolist() and images.sum() > 0
    assert int(batch["image_grid_thw"].prod(-1).sum()) // 4 == int(images.sum())
    assert not ((batch["completion_mask"] == 1) & (batch["input_ids"] == config.image_token_id)).any()


def test_the_reported_real_tokens_are_the_batches_attention_mask_sums():
    """Every row reports the padded batches' non-pad tokens (their attention masks' sum), built as the run builds
    them."""
    from padfree_plugins.testing.vision import image_text_processor, tiny_vision_language_model

    settings = VisionPreferenceSettings(**{**QUICK, "batch_size": 3})
    result = vision_preference.run_vision_preference_benchmark(settings)
    processor = image_text_processor("qwen2_5_vl", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 96)
    config = tiny_vision_language_model("qwen2_5_vl", processor, **settings.text).config
    masks = [dpo_batch(processor, config, settings, index)["attention_mask"] for index in range(settings.batches)]
    assert [row.real_tokens for row in result.rows] == [int(sum(mask.sum() for mask in masks))] * 3


def test_a_packed_call_left_padded_stops_the_benchmark(monkeypatch):
    monkeypatch.setattr(trl_fused, "pack_media_call", lambda *args: None)
    with pytest.raises(NotPacked, match="native policy forward did not run on one packed row"):
        vision_preference.run_vision_preference_benchmark(VisionPreferenceSettings(**{**QUICK, "batch_size": 2}))
