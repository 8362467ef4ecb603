"""scripts/probe_sweep.py: its ground truth tells exact packing from a leak, and its verdicts on a few types hold.

The sweep itself covers every decoder / encoder text model type of transformers (docs/probe-sweep.md); this runs
four of them (~10 s) and a deliberate leak, so that the sweep cannot silently stop measuring."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from padfree_plugins.contract.host import PluginHost
from padfree_plugins.testing import leak_across_boundaries

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("probe_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["probe_sweep"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("probe_sweep", None)


@pytest.fixture(scope="module")
def claims():
    return PluginHost().architectures()


def row_of(sweep, claims, model_type, measure_refused=True):
    candidate = sweep.classify(model_type, claims)
    assert candidate.skip is None, candidate.skip
    return sweep.sweep_type(candidate, claims, measure_refused)


def test_llama_is_accepted_and_packs_exactly(sweep, claims):
    row = row_of(sweep, claims, "llama")
    assert row.status == "accepted" and row.declared_by == "llama"  # blocked: it went through the probe
    assert row.packs_exactly and not row.fooled
    loss, grad, output, grad_scale = row.packed_vs_padded
    assert loss <= sweep.LOSS_RTOL and grad <= sweep.GRAD_ATOL and output <= sweep.OUTPUT_RTOL and grad_scale > 0


def test_refusals_keep_their_reason_and_their_leak(sweep, claims):
    lfm2 = row_of(sweep, claims, "lfm2")
    assert lfm2.status == "refused" and lfm2.reason_kind == "sequence mixer outside attention"
    assert "conv" in " ".join(lfm2.features) and lfm2.packs_exactly is False  # the conv layer really leaks
    phimoe = row_of(sweep, claims, "phimoe")
    assert phimoe.status == "refused" and phimoe.reason_kind == "window no attention call receives"
    assert "window 8" in phimoe.features and phimoe.packs_exactly is False


def test_an_encoder_with_positions_after_the_padding_index(sweep, claims):
    """RoBERTa's positions start at padding_idx + 1: packed, padded and alone agree."""
    row = row_of(sweep, claims, "roberta")
    assert row.status == "accepted" and row.task == "hidden_states" and row.packs_exactly
    assert not sweep.exceeds(row.padded_vs_alone)


def test_the_ground_truth_catches_a_leak_the_probe_is_bypassed_for(sweep, claims):
    """With the probe bypassed, a leak of 1e-3 across each boundary is a fooled verdict: the ground truth is not
    blind to what the probe must catch."""
    candidate = sweep.classify("llama", claims)
    model, _ = sweep.build_model(candidate)
    row = sweep.Row("llama", "llama", "causal_lm")
    with leak_across_boundaries(model, strength=1e-3), sweep.probe_bypassed():
        row = sweep.measure(model, row, "causal_lm", "llama", measure_refused=False)
    assert row.status == "accepted" and row.fooled
    assert row.packed_vs_padded[2] > 10 * sweep.OUTPUT_RTOL


def test_report_counts(sweep):
    rows = [sweep.Row("a", status="accepted", packed_vs_padded=(0.0, 0.0, 0.0, 1.0),
                      packed_vs_alone=(0.0, 0.0, 0.0, 1.0)),
            sweep.Row("b", status="refused", reason="x", reason_kind="sequence mixer outside attention")]
    text = sweep.report(rows, {"encoder-decoder": ["t5"]}, 3, "cmd", 1.0, True, True)
    assert "**fooled: 0** (must be 0)" in text and "accepted by the probe: **1**" in text
    assert "sequence mixer outside attention: 1 — b" in text and "encoder-decoder: 1 — t5" in text


def test_the_findings_block_survives_a_rerun(sweep):
    kept = "<!-- findings -->\n## Findings\n\nwritten by hand\n<!-- /findings -->"
    text = sweep.report([], {}, 0, "cmd", 1.0, True, False, findings=sweep.findings_of(f"old\n{kept}\nold"))
    assert kept in text and "old" not in text
