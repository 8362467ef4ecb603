"""``axolotl train`` with plugins/padfree-axolotl: SFT (``AxolotlTrainer``), DPO, KTO and GRPO (axolotl's
subclasses of TRL's trainers) on a tiny local Llama, with and without ``padfree:``, the padding-free loss curve equal
to axolotl's own padded run.

axolotl 0.21 pins its own transformers / datasets, so it runs in an environment of its own, made from
scripts/axolotl-lock.txt by scripts/axolotl_env.sh (which ``make test`` runs first). That environment has TRL 1.16
over axolotl's pin of 1.14.1, so the RL trainers take padfree-plugins' fused TRL plugins. Skipped, saying so, where
the environment does not exist (a bare ``pytest`` run without the setup); failed there under ``make test``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.test_trl_launcher import assets  # noqa: F401 - the fixture: a tiny Llama, its tokenizer, SFT / DPO data

ROOT = Path(__file__).resolve().parents[1]


def environment() -> Path:
    """Where scripts/axolotl_env.sh made the environment (the same rule: PADFREE_AXOLOTL_ENV, else the cache)."""
    if os.environ.get("PADFREE_AXOLOTL_ENV"):
        return Path(os.environ["PADFREE_AXOLOTL_ENV"])
    result = subprocess.run(["bash", str(ROOT / "scripts" / "axolotl_env.sh"), "--print-path"], capture_output=True,
                            text=True, check=True)
    return Path(result.stdout.strip())


ENV = environment()
AXOLOTL = ENV / "bin" / "axolotl"
STEPS = 3
#: No telemetry, no tracker, the CPU.
QUIET = {"AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
         "CUDA_VISIBLE_DEVICES": ""}

READY = (ENV / ".padfree-axolotl-setup").exists()
#: ``make test`` sets PADFREE_REQUIRE_AXOLOTL=1 after making the environment: there a missing one fails, not skips.
REQUIRED = os.environ.get("PADFREE_REQUIRE_AXOLOTL") == "1"
pytestmark = pytest.mark.skipif(
    not READY and not REQUIRED, reason=f"no axolotl environment at {ENV}: run scripts/axolotl_env.sh (make test does)")


@pytest.fixture(autouse=True)
def axolotl_environment():
    """Under ``make test`` (PADFREE_REQUIRE_AXOLOTL=1) a missing environment is a failure, with the reason."""
    if not READY:
        pytest.fail(f"PADFREE_REQUIRE_AXOLOTL=1 but no axolotl environment at {ENV}: scripts/axolotl_env.sh did not "
                    "make it")


#: What the padding-free run says it did: the trainer plugin that took each trainer. The RL trainers take the fused
#: TRL plugins (the environment's TRL 1.16 has the fused LM head), not the generic path.
WRAPPERS = {"sft": "AxolotlTrainer trains padding-free (AxolotlTrainerPatch (plugin axolotl_trainer))",
            "dpo": "AxolotlDPOTrainer trains padding-free (DPOTrainerPatch (plugin trl_dpo))",
            "kto": "AxolotlKTOTrainer trains padding-free (KTOTrainerPatch (plugin trl_kto))",
            "grpo": "AxolotlGRPOTrainer trains padding-free (GRPOTrainerPatch (plugin trl_grpo))"}
#: The dataset type of each kind: SFT's text, and TRL's columns as they are.
DATASETS = {"sft": {"type": "completion", "field": "text"}, "dpo": {"type": "passthrough", "split": "train"},
            "kto": {"type": {"field_label": "label"}, "split": "train"},
            "grpo": {"type": "passthrough", "split": "train"}}
#: GRPO: 2 prompts a step, 4 completions of at most 10 tokens each, rewarded by length (tests/axolotl_rewards.py).
GRPO = {"num_generations": 4, "max_completion_length": 10, "beta": 0.1, "use_vllm": False,
        "reward_funcs": ["tests.axolotl_rewards.length"]}


def datasets(assets: Path, root: Path) -> dict[str, Path]:  # noqa: F811
    """The fixture's SFT and DPO data, and KTO's (each DPO pair as a desirable and an undesirable completion) and
    GRPO's (the DPO prompts) made from the DPO rows."""
    pairs = [json.loads(line) for line in (assets / "dpo" / "train.jsonl").read_text().splitlines()]
    rows = {"kto": [{"prompt": pair["prompt"], "completion": pair[key], "label": key == "chosen"}
                    for pair in pairs for key in ("chosen", "rejected")],
            "grpo": [{"prompt": pair["prompt"]} for pair in pairs]}
    paths = {"sft": assets / "sft" / "train.jsonl", "dpo": assets / "dpo" / "train.jsonl"}
    for kind, kind_rows in rows.items():
        paths[kind] = root / f"{kind}.jsonl"
        paths[kind].write_text("".join(json.dumps(row) + "\n" for row in kind_rows))
    return paths


def axolotl_config(assets: Path, kind: str, output_dir: Path, padfree: bool,  # noqa: F811
                   data: Path | None = None) -> dict:
    """An axolotl config on the tiny local model, fp32 on the CPU, a checkpoint at the last step."""
    data = data or assets / kind / "train.jsonl"
    config = {
        "base_model": str(assets / "model"), "tokenizer_config": str(assets / "model"),
        "datasets": [{"path": str(data), "ds_type": "json", **DATASETS[kind]}],
        "dataset_prepared_path": str(output_dir / "prepared"), "dataset_num_proc": 1, "val_set_size": 0,
        "sequence_len": 128, "micro_batch_size": 8 if kind == "grpo" else 4, "gradient_accumulation_steps": 1,
        "max_steps": STEPS, "num_epochs": 1,
        "optimizer": "adamw_torch", "lr_scheduler": "constant", "learning_rate": 1e-3, "weight_decay": 0.0,
        "output_dir": str(output_dir), "logging_steps": 1, "save_steps": STEPS, "seed": 0,
        "bf16": False, "fp16": False, "tf32": False, "flash_attention": False, "sdp_attention": True,
        "dataloader_num_workers": 0, "use_tensorboard": False,
    }
    if kind != "sft":
        config["rl"] = kind
    if kind == "kto":
        config["remove_unused_columns"] = False  # axolotl asks for it with KTO
    if kind == "grpo":
        config["trl"] = GRPO
    if padfree:
        config["padfree"] = {"attention": "exact"}
    return config


KINDS = ("sft", "dpo", "kto", "grpo")


def log_history(output_dir: Path) -> list[dict]:
    """The logged steps of the run whose ``output_dir`` was given: a sweep trains it in a ``sweepNNNN`` folder."""
    state, = [json.loads(path.read_text()) for path in output_dir.glob(f"*/checkpoint-{STEPS}/trainer_state.json")]
    return [entry for entry in state["log_history"] if "loss" in entry]


@pytest.fixture(scope="module")
def axolotl_runs(assets, tmp_path_factory):  # noqa: F811
    """Every kind trained padded by one ``axolotl train --sweep`` and padding-free by another (axolotl's sweep runs
    each config of a list in the same process, one after the other: one start-up per mode, not one per run), the
    two invocations side by side. Returns the two logs and, per kind, the padded and the padding-free output
    folders."""
    from tests.test_trl_launcher import run_together

    root = tmp_path_factory.mktemp("axolotl_train")
    data = datasets(assets, root)
    commands, folders = [], {}
    for padfree in (False, True):
        mode = root / ("padfree" if padfree else "padded")
        mode.mkdir()
        configs = []
        for kind in KINDS:
            folders[kind, padfree] = mode / kind
            configs.append(axolotl_config(assets, kind, mode / kind, padfree, data[kind]))
        (mode / "base.yml").write_text(json.dumps(configs[0]))  # JSON is YAML
        (mode / "sweep.yml").write_text(json.dumps({"_": configs}))  # paired values: each config as a whole
        commands.append([str(AXOLOTL), "train", str(mode / "base.yml"), "--sweep", str(mode / "sweep.yml"),
                         "--launcher", "python"])
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in QUIET.items():
            monkeypatch.setenv(name, value)
        padded_log, padfree_log = run_together(commands, root, timeout=600)  # four runs each
    return padded_log, padfree_log, folders


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_axolotl_train_padding_free_equals_axolotls_padded_run(axolotl_runs, kind):
    """``axolotl train`` padded and with ``padfree:``, side by side: the same loss at every step (1e-5), the same
    gradient norm, log-probabilities, entropy and KL as logged (1e-4), the padding-free run through the trainer
    plugin named, and (RL) every fused call packed."""
    padded_log, padfree_log, folders = axolotl_runs
    assert WRAPPERS[kind] in padfree_log, padfree_log[-6000:]
    assert "has no fused LM head" not in padfree_log  # TRL 1.16: not the generic path
    assert "trains padding-free" not in padded_log  # the plugin does nothing without the key
    padded, packed = log_history(folders[kind, False]), log_history(folders[kind, True])
    assert len(padded) == len(packed) == STEPS
    assert [entry["loss"] for entry in packed] == pytest.approx([entry["loss"] for entry in padded], abs=1e-5)
    assert len({entry["loss"] for entry in padded}) > 1, "every step's loss is the same: the comparison proves little"
    # what the forward computes, every step: an RL loss at its first step does not depend on it (policy = reference)
    for step, (padded_entry, packed_entry) in enumerate(zip(padded, packed)):
        compared = {key: value for key, value in padded_entry.items()
                    if key in ("grad_norm", "entropy", "kl") or key.startswith(("logps/", "logits/"))}
        assert "grad_norm" in compared and (kind == "sft" or "entropy" in compared), compared
        assert {key: packed_entry.get(key) for key in compared} == pytest.approx(compared, rel=1e-4, abs=1e-5), step
    if kind != "sft":  # TRL's fused calls: every one packed, none run padded
        assert packed[-1]["padfree/packed_calls"] > 0 and packed[-1]["padfree/padded_calls"] == 0, packed[-1]


def test_axolotl_refuses_sample_packing_beside_padfree(assets, tmp_path):  # noqa: F811
    """The refusal, as axolotl users see it: ``axolotl train`` stops at its config check, with the reason."""
    config = axolotl_config(assets, "sft", tmp_path, padfree=True) | {"sample_packing": True}
    path = tmp_path / "config.yml"
    path.write_text(json.dumps(config))
    result = subprocess.run([str(AXOLOTL), "train", str(path), "--launcher", "python"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **QUIET})
    assert result.returncode != 0
    assert re.search(r"sample_packing: true and padfree: are both set\. axolotl's sample_packing packs",
                     result.stdout + result.stderr), (result.stdout + result.stderr)[-6000:]
    assert not (tmp_path / "prepared").exists()  # stopped before any dataset was prepared
