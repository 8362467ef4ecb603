"""``padfree-plugins trl grpo|rloo|kto|reward``: each of TRL's RL and preference scripts launched as a subprocess
trains what the same script trains in this process with ``padfree_plugins.accelerate(trainer, config)``, on the
trainer's own plugin, every fused log-probability call packed. Bad input through the launcher fails before training.

A tiny Llama (and a tiny Llama scorer for the reward script) with a locally trained tokenizer, datasets saved to
disk; 2 steps each, fp32, one thread, so that both runs sample the same completions.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from padfree_plugins.errors import PadfreeError

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the a cat dog runs sleeps over under quickly slowly red blue green big small house tree river "
         "stone bird sings far near").split()
STEPS = 2
CONFIG = {"attention": "exact"}
#: The reward script's pairs batched by a token budget: only the plugin's planner keeps it, so the launched run's
#: step sizes show that it was packed (the reward script has no fused calls to count). Prompts not shared, so that
#: the budget counts every real token, as TRL's ``num_tokens`` does.
BUDGET = 256
CONFIGS = {"reward": {**CONFIG, "prefix_sharing": "off",
                      "batching": {"strategy": "tokens", "max_tokens_per_batch": BUDGET}}}
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--logging_steps", "1",
          "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(STEPS), "--seed", "0",
          "--learning_rate", "1e-4", "--bf16", "false", "--use_cpu", "--disable_tqdm", "true"]
GENERATION = ["--reward_funcs", "tests.trl_launcher_rewards.length_reward", "--num_generations", "2",
              "--max_completion_length", "8", "--beta", "0.1"]
#: Per script: its trainer, its plugin, its model and dataset (folders of the assets), its own flags, and how the
#: subprocess is started (the console script or ``python -m padfree_plugins``).
SCRIPTS = {
    "grpo": ("GRPOTrainer", "trl_grpo", "model", "prompts", GENERATION, "console"),
    "rloo": ("RLOOTrainer", "trl_rloo", "model", "prompts", GENERATION, "module"),
    "kto": ("KTOTrainer", "trl_kto", "model", "unpaired", [], "module"),
    "reward": ("RewardTrainer", "trl_reward", "scorer", "pairs", [], "console"),
}
#: Not compared: wall-clock times, and discontinuous counts (rounding could flip them at a near-tie).
NOT_COMPARED = {"step_time", "accuracy"}
NOT_COMPARED_PREFIXES = ("clip_ratio/",)


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A tiny Llama (its EOS logit scaled up, so that completions end at many lengths), a tiny Llama scorer (one
    label), a tokenizer trained here, and prompt / unpaired / pair datasets of many lengths, saved to disk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from padfree_plugins.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("trl_launcher_trainers")
    rng = random.Random(0)
    tokenizer = train_tokenizer([sentence(rng, 1, 30) for _ in range(32)] + list(WORDS), vocab_size=200)
    settings = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 40
    model.save_pretrained(root / "model")
    LlamaForSequenceClassification(LlamaConfig(**settings, num_labels=1)).save_pretrained(root / "scorer")
    for name in ("model", "scorer"):
        tokenizer.save_pretrained(root / name)
    datasets = {
        "prompts": [{"prompt": sentence(rng, 1, 12)} for _ in range(16)],
        "unpaired": [{"prompt": sentence(rng, 1, 12), "completion": sentence(rng, 1, 12), "label": i % 3 != 0}
                     for i in range(16)],
        "pairs": [{"prompt": sentence(rng, 1, 12), "chosen": sentence(rng, 1, 15), "rejected": sentence(rng, 1, 15)}
                  for _ in range(16)],
    }
    for name, rows in datasets.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for script in SCRIPTS:
        (root / f"{script}.yaml").write_text(json.dumps(CONFIGS.get(script, CONFIG)))  # JSON is YAML
    return root


def environment(cwd: Path, token: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "ACCELERATE_USE_CPU": "true", "TOKENIZERS_PARALLELISM": "false", "PADFREE_TEST_LAUNCH": token,
            "HF_DATASETS_CACHE": str(cwd / "datasets-cache")}


def command(how: str) -> list[str]:
    """``padfree-plugins`` (the console script installed beside this Python) or ``python -m padfree_plugins``."""
    if how == "console":
        script = Path(sys.executable).with_name("padfree-plugins")
        if not script.exists():
            pytest.skip("the padfree-plugins console script is not installed beside this Python")
        return [str(script)]
    return [sys.executable, "-m", "padfree_plugins"]


def script_arguments(assets: Path, script: str, output_dir: Path) -> list[str]:
    _, _, model, dataset, extra, _ = SCRIPTS[script]
    return ["--model_name_or_path", str(assets / model), "--dataset_name", str(assets / dataset), *extra, *COMMON,
            "--output_dir", str(output_dir)]


def history(output_dir: Path) -> list[dict]:
    """The log entries of the optimizer steps, from the last checkpoint's trainer state."""
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


def in_process(script: str, args: list[str], monkeypatch) -> tuple[list[dict], object]:
    """TRL's script run in this process (one thread, as the subprocess), its trainer given
    ``padfree_plugins.accelerate(trainer, config)`` (the launch's config) before ``train()``, as for a trainer one
    builds oneself. Returns the step log entries and the acceleration (undone)."""
    import torch
    import trl

    from padfree_plugins import accelerate

    module = importlib.import_module(f"trl.scripts.{script}")
    parsed = module.make_parser().parse_args_and_config(args)
    trainer_class = getattr(trl, SCRIPTS[script][0])
    original, applied = trainer_class.train, []

    def train(self, *a, **k):
        applied.append(accelerate(self, CONFIGS.get(script, CONFIG)))
        return original(self, *a, **k)

    monkeypatch.setattr(trainer_class, "train", train)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the GRPO / RLOO scripts put the working directory first
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.main(*parsed)
    finally:
        torch.set_num_threads(threads)
    acceleration, = applied
    acceleration.undo()
    return history(Path(parsed[1].output_dir)), acceleration


def assert_same_logs(got: list[dict], want: list[dict]) -> None:
    """Every logged value of every step equal within 1e-5 (relative to its size, at least 1e-5 absolute)."""
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        assert set(a) == set(b), (step, set(a) ^ set(b))
        for key in b:
            if key in NOT_COMPARED or key.startswith(NOT_COMPARED_PREFIXES):
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (step, key, a[key], b[key])


@dataclass
class Launch:
    process: subprocess.Popen
    log: Any
    token: str
    output_dir: Path


@pytest.fixture(scope="module")
def launches(assets, tmp_path_factory, request) -> Iterator[dict[str, Launch]]:
    """``padfree-plugins trl <script> … --acceleration_config <script>.yaml`` for every script a selected test
    compares, all started at once (the console script for some, ``python -m padfree_plugins`` for the others); any
    still running at the end is killed."""
    from tests.test_distributed import kill_launch

    selected = {item.callspec.params["script"] for item in request.session.items
                if item.originalname == "test_the_launcher_trains_each_trl_script_as_accelerate_does"}
    started = {}
    for script, (*_, how) in SCRIPTS.items():
        if script not in selected:
            continue
        cwd, token = tmp_path_factory.mktemp(f"launched-{script}"), uuid.uuid4().hex
        log = tempfile.TemporaryFile("w+")
        process = subprocess.Popen(
            [*command(how), "trl", script, *script_arguments(assets, script, cwd / "out"),
             "--acceleration_config", str(assets / f"{script}.yaml")],
            cwd=cwd, env=environment(cwd, token), stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        started[script] = Launch(process, log, token, cwd / "out")
    try:
        yield started
    finally:
        for launch in started.values():
            kill_launch(launch.process, launch.token)
            launch.log.close()


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_launcher_trains_each_trl_script_as_accelerate_does(assets, launches, tmp_path, script, monkeypatch):
    """``padfree-plugins trl <script> … --acceleration_config padfree.yaml`` (a subprocess, the console script or
    ``python -m padfree_plugins``) logs, step by step, every value the same script logs in this process with
    ``accelerate()`` applied to its trainer; the launched trainer runs on its own plugin, and every fused
    log-probability call it made ran packed (its log: ``padfree/padded_calls`` 0) — the reward script, which has
    none, under a token budget that only the plugin's planner keeps (a padded launch fails both checks)."""
    from tests.test_distributed import finish_launches

    trainer, plugin, *_ = SCRIPTS[script]
    want, acceleration = in_process(script, script_arguments(assets, script, tmp_path / "in-process"), monkeypatch)
    launch = launches[script]
    log, launch.log = launch.log, tempfile.TemporaryFile("w+")  # finish_launches closes the one it reads
    output, = finish_launches([launch.process], [log], launch.token, 240)
    assert acceleration.trainer_plugin == plugin
    assert f"padfree-plugins: {trainer} trained padding-free on 1 process(es), plugin {plugin}" in output, \
        output[-3000:]
    got = history(launch.output_dir)
    assert_same_logs(got, want)
    if script == "reward":  # no fused calls: the pairs are packed by the plugin's collator, batched by its planner
        from padfree_plugins.integrations.trl_reward import PreferenceCollator

        assert isinstance(acceleration.trainer_patch.pairs, PreferenceCollator)
        assert "fused calls" not in output
        tokens = [0] + [entry["num_tokens"] for entry in got]  # TRL's running count of real tokens
        steps = [after - before for before, after in zip(tokens, tokens[1:])]
        assert all(0 < step <= BUDGET for step in steps), steps  # 4 pairs a step (TRL's batches) held 560
    else:
        assert all(entry["padfree/packed_calls"] > 0 and entry["padfree/padded_calls"] == 0 for entry in got), got
        said = re.search(r"\(fused calls: (\d+) packed[^,]*, 0 padded", output)
        assert said and int(said[1]) == got[-1]["padfree/packed_calls"], output[-3000:]


@pytest.mark.parametrize("where", ["padfree.yaml", "TRL's --config"])
def test_an_unknown_key_is_refused_with_the_nearest_key_before_anything_is_launched(assets, tmp_path, where,
                                                                                     monkeypatch):
    """A misspelt key in ``padfree.yaml`` (or in the ``acceleration_config:`` mapping of TRL's ``--config`` YAML):
    ``padfree-plugins trl`` exits non-zero with the key it likely meant, and launches nothing (no output directory,
    no training)."""
    import accelerate.commands.launch as accelerate_launch
    from typer.testing import CliRunner

    from padfree_plugins.cli.app import app

    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: pytest.fail("launched"))
    if where == "padfree.yaml":
        (tmp_path / "typo.yaml").write_text("atention: exact\n")
        acceleration = ["--acceleration_config", str(tmp_path / "typo.yaml")]
    else:
        (tmp_path / "kto.yaml").write_text("acceleration_config:\n  atention: exact\n")
        acceleration = ["--config", str(tmp_path / "kto.yaml")]
    result = CliRunner().invoke(app, ["trl", "kto", *script_arguments(assets, "kto", tmp_path / "out"),
                                      *acceleration])
    assert result.exit_code == 2, result.output  # the command's error exit, not a crash
    assert "unknown key 'atention'. Did you mean 'attention'?" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_script_that_trains_no_trainer_says_so(monkeypatch):
    """A script whose ``main()`` trains no ``transformers.Trainer`` (nothing to make padding-free): an error that
    says so, and the launched process exits non-zero with it."""
    from padfree_plugins.recipes import trl_run

    module = trl_run.script_module("kto")
    monkeypatch.setattr(module, "main", lambda *args: None)
    argv = ["kto", "--use_cpu", "--model_name_or_path", "m", "--output_dir", "o", "--acceleration_config",
            json.dumps(CONFIG)]
    with pytest.raises(PadfreeError, match="trained no transformers Trainer, so nothing was made padding-free"):
        trl_run.run_script(argv)
    with pytest.raises(SystemExit) as exited:
        trl_run.main(argv)
    assert "error: padfree-plugins trl kto: the script trained no transformers Trainer" in str(exited.value.code)
