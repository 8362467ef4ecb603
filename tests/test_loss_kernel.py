"""``memory.loss_kernel``: Liger's fused linear cross-entropy computes the tiled loss where liger-kernel is installed
and the call fits, the torch tiles otherwise. The dispatch is tested everywhere with a stand-in for Liger's function;
Liger itself against the torch tiles where liger-kernel and triton are installed (CUDA, or Triton's interpreter on
CPU)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from padfree_plugins import ConfigError, accelerate, patch_of, plan
from padfree_plugins.config.schema import load_config
from padfree_plugins.modeling import loss_kernel, tiling
from padfree_plugins.modeling.loss_kernel import why_not_liger
from tests.conftest import tiny_config
from tests.loss_kernel_run import CANNOT_RUN
from tests.test_tiling import assert_same, causal_lm, loss_and_grads

ROOT = Path(__file__).resolve().parent.parent
TILED = {"tile_tokens": 16}


class FakeLiger:
    """Liger's function as the tests see it: the loss computed plainly (the whole logits), each call recorded;
    ``scale`` a deliberate error in its result."""

    def __init__(self, scale: float = 1.0):
        self.calls: list[tuple] = []
        self.scale = scale

    def __call__(self, hidden, weight, bias, labels, divisor, smoothing):
        self.calls.append((hidden.dtype, smoothing))
        logits = F.linear(hidden, weight, bias).float()
        summed = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum", label_smoothing=smoothing)
        return summed / divisor * self.scale


@pytest.fixture
def fake_liger(monkeypatch):
    """liger-kernel "installed", its function the stand-in, and Triton's interpreter on (so CPU tensors fit)."""
    fake = FakeLiger()
    monkeypatch.setattr(loss_kernel, "liger_version", lambda: "0.0-fake")
    monkeypatch.setattr(loss_kernel, "liger_head_loss", fake)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return fake


@pytest.fixture
def torch_tiles(monkeypatch):
    """The torch tiles' calls, counted."""
    calls = []
    original = tiling.TiledHeadLoss.forward

    def counting(ctx, hidden, *rest):
        calls.append(hidden.shape[0])
        return original(ctx, hidden, *rest)

    monkeypatch.setattr(tiling.TiledHeadLoss, "forward", staticmethod(counting))
    return calls


def test_auto_calls_liger_when_the_call_fits_and_its_result_is_the_loss(fake_liger, torch_tiles):
    want = loss_and_grads(causal_lm("llama"))
    got = loss_and_grads(causal_lm("llama"), {**TILED, "loss_kernel": "auto"})
    assert fake_liger.calls == [(torch.float32, 0.0)] and not torch_tiles
    assert_same(got, want)
    fake_liger.scale = 1.001  # a kernel that computes another loss: the comparison sees it
    with pytest.raises(AssertionError):
        assert_same(loss_and_grads(causal_lm("llama"), TILED), want)


def test_hf_trainer_hands_liger_its_label_smoothing(fake_liger, torch_tiles):
    """Through HF Trainer's loss call, with label smoothing: Liger gets the trainer's ε; the loss and gradients are
    the trainer's own LabelSmoother's, untiled."""
    from tests.test_tiling import trainer_step

    want = trainer_step("hf", None, label_smoothing_factor=0.1)
    got = trainer_step("hf", {**TILED, "loss_kernel": "liger"}, label_smoothing_factor=0.1)
    assert fake_liger.calls == [(torch.float32, 0.1)] and not torch_tiles
    assert_same(got, want)


@pytest.mark.parametrize("case", ["no interpreter on cpu", "float64", "torch asked for"])
def test_the_torch_tiles_run_where_the_call_does_not_fit(fake_liger, torch_tiles, monkeypatch, case):
    memory = {**TILED, "loss_kernel": "torch" if case == "torch asked for" else "auto"}
    if case == "no interpreter on cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
    model = causal_lm("llama")
    if case == "float64":
        model = model.double()
    got = loss_and_grads(model, memory)
    assert not fake_liger.calls and torch_tiles  # the stand-in was not called; the torch tiles computed the loss
    want = loss_and_grads(model.float() if case == "float64" else causal_lm("llama"))
    assert_same((got[0].float(), {k: v.float() for k, v in got[1].items()}), want)


def test_liger_asked_for_says_once_per_kind_why_a_call_runs_the_torch_tiles(fake_liger, torch_tiles, monkeypatch,
                                                                            caplog):
    monkeypatch.delenv("TRITON_INTERPRET")
    model = causal_lm("llama")
    with caplog.at_level(logging.INFO, logger="padfree_plugins"):
        from padfree_plugins import assemble
        from padfree_plugins.packing.labelled_logits import keep_labelled_logits
        from tests.conftest import make_examples

        assembly = assemble(model, {"task": "causal_lm", "memory": {**TILED, "loss_kernel": "liger"}})
        try:
            for seed in (1, 2):
                batch = keep_labelled_logits(assembly.collator(make_examples([30, 20], seed=seed)))
                assembly.forward(model, batch).loss.backward()
        finally:
            assembly.undo()
    said = [r for r in caplog.records if "loss_kernel" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "tensors are on cpu" in said[0].getMessage() and "torch tiles" in said[0].getMessage()
    assert len(torch_tiles) == 2 and not fake_liger.calls


def test_why_a_call_does_not_fit(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    assert why_not_liger(hidden, weight, None) is None
    assert why_not_liger(hidden.double(), weight.double(), None)[0] == "dtype"
    assert why_not_liger(hidden.bfloat16(), weight, None)[0] == "mixed dtypes"
    assert why_not_liger(hidden[:0], weight, None)[0] == "empty"
    assert why_not_liger(hidden.detach(), weight, None)[0] == "frozen input"
    with torch.no_grad():
        assert why_not_liger(hidden.detach(), weight, None) is None  # evaluation: a loss, no gradients
    monkeypatch.delenv("TRITON_INTERPRET")
    assert why_not_liger(hidden, weight, None)[0] == "device"


def test_liger_asked_for_without_liger_is_refused_at_accelerate_with_the_install_hint(monkeypatch):
    from tests.test_trainer import make_trainer

    monkeypatch.setattr(loss_kernel, "liger_version", lambda: None)
    trainer, _ = make_trainer("hf", packed=False)
    collator, compute_loss = trainer.data_collator, trainer.compute_loss
    with pytest.raises(ConfigError, match=r"liger-kernel .* not installed: pip install 'padfree-plugins\[liger\]'"):
        accelerate(trainer, {"task": "causal_lm", "memory": {**TILED, "loss_kernel": "liger"}})
    assert patch_of(trainer.model) is None
    assert trainer.data_collator is collator and trainer.compute_loss == compute_loss
    assert "forward" not in trainer.model.lm_head.__dict__
    accelerate(trainer, {"task": "causal_lm", "memory": {**TILED, "loss_kernel": "auto"}}).undo()  # auto: torch


@pytest.mark.parametrize("memory", [{"loss_kernel": "liger"}, {"tile_tokens": 16, "tile_loss": False,
                                                               "loss_kernel": "liger"}])
def test_liger_asked_for_without_the_tiled_loss_is_refused(memory):
    with pytest.raises(ConfigError, match="loss_kernel: liger computes the tiled loss, which is off"):
        load_config({"memory": memory})
    with pytest.raises(ConfigError, match="loss_kernel"):
        load_config({"memory": {"loss_kernel": "triton"}})


def test_check_shows_which_kernel_computes_the_loss(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from padfree_plugins.cli import app

    small = tiny_config("llama")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(loss_kernel, "liger_version", lambda: None)
    assert plan(small, {"memory": TILED}, device_type="cuda").describe()["loss kernel"] == \
        "torch tiles (liger-kernel is not installed)"
    assert plan(small, {}).describe()["loss kernel"] == "- (no tiled loss)"
    monkeypatch.setattr(loss_kernel, "liger_version", lambda: "9.9")
    assert plan(small, {"memory": TILED}, device_type="cuda").describe()["loss kernel"].startswith(
        "Liger fused linear cross-entropy (liger-kernel 9.9)")
    assert "the device is cpu" in plan(small, {"memory": TILED}, device_type="cpu").describe()["loss kernel"]
    torch_asked = {"memory": {**TILED, "loss_kernel": "torch"}}
    assert plan(small, torch_asked, device_type="cuda").describe()["loss kernel"] == \
        "torch tiles (memory.loss_kernel: torch)"
    config = tmp_path / "padfree.yaml"
    config.write_text("memory:\n  tile_tokens: auto\n")
    result = CliRunner().invoke(app, ["check", str(config), "--model-type", "llama", "--device", "cuda", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["loss kernel"].startswith("Liger fused linear cross-entropy")


# -- Liger itself (where liger-kernel and triton are installed) ------------------------------------------------------

LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def run_comparison(device: str, interpret: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", **({"TRITON_INTERPRET": "1"} if interpret else {})}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "loss_kernel_run.py"), device], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode == CANNOT_RUN:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not LIGER, reason="liger-kernel and triton are not installed (pip install "
                                      "'padfree-plugins[liger]')")
def test_liger_matches_the_torch_tiles_under_tritons_interpreter():
    """Loss within 1e-5, gradients (hidden states, LM head, every parameter of a tiny Llama) within 1e-4."""
    figures = run_comparison("cpu", interpret=True)
    assert figures["tiny llama step"]["lm_head.weight"] <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not (LIGER and torch.cuda.is_available()), reason="needs CUDA with liger-kernel and triton")
def test_liger_matches_the_torch_tiles_on_cuda():
    figures = run_comparison("cuda", interpret=False)
    assert figures["tiny llama step"]["lm_head.weight"] <= 1e-4
