"""``axolotl train`` with plugins/padfree-axolotl: SFT (``AxolotlTrainer``) and DPO (axolotl's ``DPOTrainer``) on a
tiny local Llama, with and without ``padfree:``, the padding-free loss curve equal to axolotl's own padded run.

axolotl 0.21 needs Python >= 3.12 and pins its own transformers / TRL / datasets, so it runs in an environment of
its own, made by scripts/axolotl_env.sh (``.axolotl-env``, or ``PADFREE_AXOLOTL_ENV``). Skipped, saying so, where
that environment does not exist."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.test_trl_launcher import assets  # noqa: F401 - the fixture: a tiny Llama, its tokenizer, SFT / DPO data

ROOT = Path(__file__).resolve().parents[1]
ENV = Path(os.environ.get("PADFREE_AXOLOTL_ENV", ROOT / ".axolotl-env"))
AXOLOTL = ENV / "bin" / "axolotl"
STEPS = 3
#: No telemetry, no tracker, the CPU (axolotl's torch is a CUDA build).
QUIET = {"AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
         "CUDA_VISIBLE_DEVICES": ""}

pytestmark = pytest.mark.skipif(
    not AXOLOTL.exists(), reason=f"no axolotl environment at {ENV}: run scripts/axolotl_env.sh (Python 3.12, ~7 GB)")

#: What the padding-free run says it did: the trainer plugin that took each trainer.
WRAPPERS = {"sft": "AxolotlTrainer trains padding-free (AxolotlTrainerPatch (plugin axolotl_trainer))",
            "dpo": "AxolotlDPOTrainer trains padding-free (AnyTrainerPatch (plugin any_trainer))"}
#: axolotl 0.21 pins TRL 1.14, which has no fused LM head: its DPOTrainer takes the generic path, and is told so.
GENERIC_DPO = "TRL 1.14.1 has no fused LM head"


def axolotl_config(assets: Path, kind: str, output_dir: Path, padfree: bool) -> dict:  # noqa: F811
    """An axolotl config on the tiny local model, fp32 on the CPU, a checkpoint at the last step."""
    dataset = {"sft": {"type": "completion", "field": "text"}, "dpo": {"type": "passthrough", "split": "train"}}[kind]
    config = {
        "base_model": str(assets / "model"), "tokenizer_config": str(assets / "model"),
        "datasets": [{"path": str(assets / kind / "train.jsonl"), "ds_type": "json", **dataset}],
        "dataset_prepared_path": str(output_dir / "prepared"), "val_set_size": 0, "sequence_len": 128,
        "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": STEPS, "num_epochs": 1,
        "optimizer": "adamw_torch", "lr_scheduler": "constant", "learning_rate": 1e-3, "weight_decay": 0.0,
        "output_dir": str(output_dir), "logging_steps": 1, "save_steps": STEPS, "seed": 0,
        "bf16": False, "fp16": False, "tf32": False, "flash_attention": False, "sdp_attention": True,
        "dataloader_num_workers": 0, "use_tensorboard": False,
    }
    if kind == "dpo":
        config["rl"] = "dpo"
    if padfree:
        config["padfree"] = {"attention": "exact"}
    return config


def losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_axolotl_train_padding_free_equals_axolotls_padded_run(assets, tmp_path, kind, monkeypatch):  # noqa: F811
    from tests.test_trl_launcher import run_together

    runs = {}
    for padfree in (False, True):
        output_dir = tmp_path / ("padfree" if padfree else "padded")
        output_dir.mkdir()
        path = output_dir / "config.yml"
        path.write_text(json.dumps(axolotl_config(assets, kind, output_dir, padfree)))  # JSON is YAML
        runs[padfree] = (output_dir, [str(AXOLOTL), "train", str(path), "--launcher", "python"])
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    padded_log, padfree_log = run_together([runs[False][1], runs[True][1]], tmp_path)
    assert WRAPPERS[kind] in padfree_log, padfree_log[-6000:]
    assert (GENERIC_DPO in padfree_log) == (kind == "dpo")
    assert "trains padding-free" not in padded_log  # the plugin does nothing without the key
    padded, packed = losses(runs[False][0]), losses(runs[True][0])
    assert len(padded) == len(packed) == STEPS
    assert packed == pytest.approx(padded, abs=1e-5), (packed, padded)
    assert len(set(padded)) > 1, "every step's loss is the same: the comparison would prove little"


def test_axolotl_refuses_sample_packing_beside_padfree(assets, tmp_path):  # noqa: F811
    """The refusal, as axolotl users see it: ``axolotl train`` stops at its config check, with the reason."""
    import subprocess

    config = axolotl_config(assets, "sft", tmp_path, padfree=True) | {"sample_packing": True}
    path = tmp_path / "config.yml"
    path.write_text(json.dumps(config))
    result = subprocess.run([str(AXOLOTL), "train", str(path), "--launcher", "python"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **QUIET})
    assert result.returncode != 0
    assert re.search(r"sample_packing: true and padfree: are both set\. axolotl's sample_packing packs",
                     result.stdout + result.stderr), (result.stdout + result.stderr)[-6000:]
    assert not (tmp_path / "prepared").exists()  # stopped before any dataset was prepared
