"""``padfree-plugins bench vlm`` at the test suite's size: both variants run the same image-text batches to the same
loss, the padding-free one on less activation memory, and the CLI writes its table. (Speed is measured by the
benchmark itself, never asserted in a test.)"""

from __future__ import annotations

import dataclasses
import json

from typer.testing import CliRunner

from padfree_plugins.benchmarks.vlm import QUICK, VARIANTS, VLMSettings, image_text_batch, run_vlm_benchmark
from padfree_plugins.cli.app import app
from padfree_plugins.testing.vision import image_text_processor, tiny_vision_language_model


def test_both_variants_give_the_same_loss_and_padding_free_keeps_less():
    result = run_vlm_benchmark(dataclasses.replace(VLMSettings(), **QUICK))
    rows = {row.variant: row for row in result.rows}
    assert list(rows) == list(VARIANTS)
    assert 0 < result.padding_fraction < 1 and result.images_per_batch > 0
    assert rows["padfree"].loss_rel_diff < 1e-5 and rows["padded"].loss_rel_diff == 0
    assert rows["padfree"].activation_mib < rows["padded"].activation_mib
    assert all(row.real_tokens_per_s > 0 for row in rows.values())


def test_batches_mix_examples_with_zero_one_and_two_images():
    processor = image_text_processor("qwen2_5_vl")
    model = tiny_vision_language_model("qwen2_5_vl", processor)
    examples = image_text_batch(processor, model, VLMSettings(batch_size=16), 0)
    counts = {0 if "image_grid_thw" not in example else len(example["image_grid_thw"]) for example in examples}
    assert counts == {0, 1, 2}


def test_cli_writes_the_table(tmp_path):
    result = CliRunner().invoke(app, ["bench", "vlm", "--quick", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench_vlm.json").read_text())
    assert [row["variant"] for row in data["rows"]] == list(VARIANTS)
    assert "| padfree |" in (tmp_path / "bench_vlm.md").read_text()
