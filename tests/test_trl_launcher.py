"""``padfree-plugins trl <script>``: TRL's own scripts, launched as ``trl`` launches them, trained padding-free.

Every run is a subprocess on a tiny Llama and datasets saved to disk; the padding-free loss curve is compared with
the same ``trl`` command without padfree (padded), 1 and 2 CPU processes, SFT and DPO.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest

from padfree_plugins.errors import ConfigError, PadfreeError
from tests.test_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the a cat dog runs sleeps over under quickly slowly red blue green big small house tree river "
         "stone bird sings far near").split()
STEPS = 3
#: What both the padded and the padding-free runs are given (fp32: TRL's configs default to bf16).
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--logging_steps", "1",
          "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(STEPS), "--seed", "0",
          "--learning_rate", "1e-4", "--bf16", "false", "--use_cpu"]


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A tiny Llama with its tokenizer, an SFT text dataset and a DPO preference dataset, saved to disk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from padfree_plugins.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("trl_launcher")
    rng = random.Random(0)
    texts = [sentence(rng, 1, 30) for _ in range(32)]  # 1-word to 30-word rows: much padding in a batch
    tokenizer = train_tokenizer(texts + list(WORDS), vocab_size=200)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    for name, rows in (("sft", [{"text": text} for text in texts]),
                       ("dpo", [{"prompt": sentence(rng, 1, 12), "chosen": sentence(rng, 1, 15),
                                 "rejected": sentence(rng, 1, 15)} for _ in range(32)])):
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "padfree.yaml").write_text("attention: exact\n")
    return root


def run_together(commands: list[list[str]], cwd: Path, timeout: float = 300) -> list[str]:
    """Run command lines side by side (a timeout, 300 s unless told, so that a hang fails; every process they
    started is killed at the end) and return their outputs; a failure shows its output."""
    from tests.test_distributed import finish_launches

    token = uuid.uuid4().hex
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "ACCELERATE_USE_CPU": "true", "TOKENIZERS_PARALLELISM": "false", "PADFREE_TEST_LAUNCH": token}
    logs = [tempfile.TemporaryFile("w+") for _ in commands]
    # each run its own datasets cache: two runs mapping the same dataset at once would share its cache files
    processes = [subprocess.Popen(command, cwd=cwd, env={**env, "HF_DATASETS_CACHE": str(cwd / f"datasets-{i}")},
                                  stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for i, (command, log) in enumerate(zip(commands, logs))]
    return finish_launches(processes, logs, token, timeout)


def losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


TRL = [sys.executable, "-m", "trl.cli.main"]
PADFREE = [sys.executable, "-c", "from padfree_plugins.cli import main; main()"]
TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer"}


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_trl_script_padding_free_equals_the_padded_trl_command(assets, tmp_path, script, processes):
    """``padfree-plugins trl <script> … --acceleration_config`` trains TRL's own script padding-free; its loss
    curve equals the same ``trl <script>`` command's (padded) within 1e-5, on 1 and 2 processes (the 2-process
    launch takes accelerate's ``--config_file`` and ``--main_process_port`` among TRL's flags, as ``trl`` does;
    the two commands run side by side). One run gives the config as an
    ``acceleration_config:`` mapping of TRL's ``--config`` YAML instead of the flag."""
    launch = [] if processes == 1 else ["--config_file", str(ROOT / "configs/accelerate/ddp_cpu.yaml")]
    args = [script, "--model_name_or_path", str(assets / "model"), "--dataset_name", str(assets / script),
            *COMMON, *launch]
    if script == "sft" and processes == 1:  # an acceleration_config: mapping in TRL's --config YAML
        (tmp_path / "sft.yaml").write_text(json.dumps({"acceleration_config": {"attention": "exact"},
                                                       "output_dir": str(tmp_path / "padfree")}))
        acceleration = ["--config", str(tmp_path / "sft.yaml")]
    else:
        acceleration = ["--output_dir", str(tmp_path / "padfree"), "--acceleration_config",
                        str(assets / "padfree.yaml")]
    ports = [[] if processes == 1 else ["--main_process_port", str(free_port())] for _ in range(2)]
    padded, packed = run_together([[*TRL, *args, *ports[0], "--output_dir", str(tmp_path / "padded")],
                                   [*PADFREE, "trl", *args, *ports[1], *acceleration]], tmp_path)
    # the trainer TRL's script built was made padding-free, on as many processes as launched
    assert (f"padfree-plugins: {TRAINERS[script]} trained padding-free on {processes} process(es), "
            f"plugin trl_{script}") in packed
    assert "padfree-plugins:" not in padded
    expected, got = losses(tmp_path / "padded"), losses(tmp_path / "padfree")
    assert len(got) == len(expected) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-5, (got, expected)


@pytest.mark.parametrize("script", ["sft", "dpo", "grpo", "rloo", "kto", "reward"])
def test_every_script_parses_trls_own_arguments_and_ours(script):
    """Each script's parser is TRL's (its ``make_parser``: every dataclass, so every TRL flag) plus
    ``AccelerationArguments``; TRL's flags and ours parse together."""
    import importlib

    from padfree_plugins.integrations.arguments import AccelerationArguments
    from padfree_plugins.recipes.trl_run import script_parser

    trls = importlib.import_module(f"trl.scripts.{script}").make_parser().dataclass_types
    parser = script_parser(script)
    assert list(parser.dataclass_types) == [*trls, AccelerationArguments]
    *parsed, acceleration = parser.parse_args_and_config(
        ["--use_cpu", "--model_name_or_path", "m", "--learning_rate", "3e-4", "--acceleration_config",
         '{"attention": "exact"}'])
    assert parsed[1].learning_rate == 3e-4 and parsed[2].model_name_or_path == "m"
    assert acceleration.config.attention == "exact"


def test_the_command_line_is_split_as_trl_splits_it(assets):
    """accelerate's flags (and TRL's ``--accelerate_config NAME``) go to ``accelerate launch``; TRL's and ours to
    the script, which every process runs through our module."""
    from padfree_plugins.recipes.trl_launch import RUN_MODULE, launch_arguments

    args = launch_arguments(["sft", "--use_cpu", "--model_name_or_path", "m", "--num_processes", "2",
                             "--dataset_name", "d",
                             "--acceleration_config", str(assets / "padfree.yaml"), "--main_process_port", "29511",
                             "--accelerate_config", "multi_gpu"])
    module = args.index("--module")
    assert args[module + 1:] == [RUN_MODULE, "sft", "--use_cpu", "--model_name_or_path", "m", "--dataset_name", "d",
                                 "--acceleration_config", str(assets / "padfree.yaml")]
    launch = args[:module]
    assert launch[:2] == ["--config_file", launch[1]] and launch[1].endswith("multi_gpu.yaml")
    assert launch[2:] == ["--num_processes", "2", "--main_process_port", "29511"]


@pytest.mark.parametrize(("argv", "message"), [
    (["sft", "--use_cpu", "--model_name_or_path", "m", "--acceleration_config", "{\"atention\": 1}"], "atention"),
    (["sft", "--use_cpu", "--model_name_or_path", "m", "--acceleration_config", "/no/such/padfree.yaml"],
     "padfree.yaml"),
    (["xyz"], "name a TRL script first"),
    ([], "name a TRL script first"),
])
def test_bad_input_is_refused_before_anything_is_launched(argv, message, monkeypatch):
    import accelerate.commands.launch as accelerate_launch

    from padfree_plugins.recipes.trl_launch import launch

    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: pytest.fail("launched"))
    with pytest.raises((ConfigError, OSError), match=message):
        launch(argv)


def test_without_the_flag_trls_script_runs_as_trl_runs_it_and_says_so(monkeypatch):
    """No ``--acceleration_config``: TRL's ``main()`` is called as it is (Trainer.train untouched), with a
    warning that the run is padded."""
    from transformers import Trainer

    from padfree_plugins.recipes import trl_run

    original = Trainer.__dict__["train"]
    calls = []
    module = trl_run.script_module("sft")
    monkeypatch.setattr(module, "main", lambda *args: calls.append((args, Trainer.__dict__["train"])))
    with pytest.warns(UserWarning, match="padded"):
        trl_run.run_script(["sft", "--use_cpu", "--model_name_or_path", "m", "--output_dir", "o"])
    (args, train), = calls
    assert train is original and args[2].model_name_or_path == "m"
    calls.clear()
    with warnings.catch_warnings(record=True) as caught, pytest.raises(PadfreeError, match="trained no"):
        warnings.simplefilter("always")  # this main() trains nothing: said after it returns
        trl_run.run_script(["sft", "--use_cpu", "--model_name_or_path", "m", "--acceleration_config",
                            '{"attention": "exact"}'])
    assert not [w for w in caught if "padded" in str(w.message)]
    (args, train), = calls
    assert train is not original and Trainer.__dict__["train"] is original  # hooked inside, restored after


def test_the_hook_is_undone_even_when_the_script_fails():
    from transformers import Trainer

    from padfree_plugins.config.schema import load_config
    from padfree_plugins.integrations.on_train import accelerating_on_train

    original = Trainer.__dict__["train"]
    with pytest.raises(RuntimeError, match="script failed"):
        with accelerating_on_train(load_config({"attention": "exact"})):
            assert Trainer.__dict__["train"] is not original
            raise RuntimeError("script failed")
    assert Trainer.__dict__["train"] is original


def test_dpo_in_bf16_packs_the_reference_model_inside_accelerates_autocast(packed_calls):
    """TRL's DPOConfig defaults to bf16: accelerate has then wrapped the reference model's fused forward for
    autocast in the trainer's ``__init__``. ``accelerate()`` packs its calls inside that wrapper (earlier it was
    refused: "no TRL fused LM head"), trains, and ``undo()`` puts accelerate's wrapper back."""
    import copy

    import trl

    from padfree_plugins import accelerate
    from tests.test_trl_preference import pairs, policy, tokenizer

    model = policy()
    with tempfile.TemporaryDirectory() as out:
        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), train_dataset=pairs(8),
                                 args=trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=True,
                                                    max_steps=1, per_device_train_batch_size=4),
                                 processing_class=copy.deepcopy(tokenizer()))
        wrapper = vars(trainer.ref_model)["forward"]
        assert "_original_forward" in vars(trainer.ref_model)  # accelerate's autocast wrapper
        acceleration = accelerate(trainer, {"attention": "exact"})
        assert vars(trainer.ref_model)["forward"] is not wrapper
        trainer.train()
    assert len(packed_calls) >= 2 and all(packed_calls)  # the policy's and the reference model's calls, packed
    acceleration.undo()
    assert vars(trainer.ref_model)["forward"] is wrapper


def test_help_of_the_command_and_of_a_script():
    """``padfree-plugins trl --help`` names the scripts; ``trl sft --help`` is TRL's help of the script, with
    ``--acceleration_config``."""
    from typer.testing import CliRunner

    from padfree_plugins.cli.app import app

    runner = CliRunner()
    command = runner.invoke(app, ["trl", "--help"])
    assert command.exit_code == 0 and "sft, dpo, grpo, rloo, kto, reward" in command.output
    script = runner.invoke(app, ["trl", "sft", "--help"])
    assert script.exit_code == 0, script.output
    assert "--acceleration_config" in script.output and "--dataset_name" in script.output
