"""Distributed padding-free training on accelerate: 2-process DDP equals one process; the Trainer contract.

The DDP run is ``examples/accelerate_loop.py`` under ``accelerate launch`` (2 CPU processes, gloo). The reference
is computed here, literally: one process, each step's global batch (the micro-batches of both ranks) packed into
one row, the plain mean token loss.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from padfree_plugins import assemble, load_config
from padfree_plugins.batching.distributed import num_label_tokens
from padfree_plugins.batching.sampler import token_budget_sampler, trainer_train_dataloader
from tests.conftest import make_examples
from tests.shared_launch import launch_once, selected

ROOT = Path(__file__).resolve().parents[1]
LOOP_ARGS = ["--examples", "96", "--median-length", "20", "--max-tokens", "192", "--epochs", "2"]


def load_example():
    spec = importlib.util.spec_from_file_location("accelerate_loop", ROOT / "examples" / "accelerate_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: How long a launch may go on once every result file is written: then only interpreter teardown is left.
TEARDOWN_GRACE_S = 45


def run_group(command: list[str], env: dict, timeout: float, results: list[Path]) -> tuple[int, str]:
    """Run an ``accelerate launch`` ``command`` that writes ``results``; return its exit status and output.

    Never hangs: the output goes to a file (a worker that outlives the launcher would hold a pipe open), and when
    the launch ends, times out, or lingers past :data:`TEARDOWN_GRACE_S` after every result file is written, all
    its processes are killed — the workers too, found by a token in their environment (torch elastic starts them
    outside the launcher's process group). A launch that lingers after writing its results hit torch's gloo teardown
    deadlock (``~ProcessGroupGloo`` joins its worker thread while holding the GIL that thread waits for, when DDP's
    reducer is freed): the run is judged on its results, with a warning. A launch with missing results fails.
    """
    token = uuid.uuid4().hex
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, cwd=ROOT, env={**env, "PADFREE_TEST_LAUNCH": token}, stdout=log,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline, written_at = time.monotonic() + timeout, None
        try:
            while process.poll() is None and time.monotonic() < deadline:
                if written_at is None and all(path.exists() for path in results):
                    written_at = time.monotonic()
                if written_at is not None and time.monotonic() - written_at > TEARDOWN_GRACE_S:
                    break
                time.sleep(0.5)
        finally:
            lingering = process.poll() is None
            kill_launch(process, token)
        log.seek(0)
        output = log.read()
    if lingering and written_at is None:
        pytest.fail(f"accelerate launch did not finish in {timeout} s:\n{output[-6000:]}")
    if lingering:
        warnings.warn(f"accelerate launch wrote its results but hung in teardown for {TEARDOWN_GRACE_S} s (torch's "
                      "gloo teardown deadlock); killed, judged on its results", RuntimeWarning, stacklevel=2)
        return 0, output
    return process.returncode, output


def rank_files(out: Path) -> list[Path]:
    """The result files of tests/ddp_per_example_run.py: one per rank."""
    return [out.with_name(f"{out.name}.{rank}") for rank in (0, 1)]


def kill_launch(process: subprocess.Popen, token: str) -> None:
    """SIGKILL the launcher's process group and every process carrying the launch's token."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for other in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if other.environ().get("PADFREE_TEST_LAUNCH") == token:
                other.kill()
    process.wait()


def finish_launches(processes: list[subprocess.Popen], logs: list, token: str, timeout: float) -> list[str]:
    """Wait for every launch (``timeout`` s, so that a hang fails), kill what is left (:func:`kill_launch`) and return
    the outputs written to ``logs`` (files open for reading and writing, closed here); a hang or a failed launch fails
    with its output."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        hung = any(p.poll() is None for p in processes)
        for process in processes:
            kill_launch(process, token)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    assert not hung, f"a launch did not finish in {timeout} s:\n" + "\n".join(o[-3000:] for o in outputs)
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-6000:]
    return outputs


def reference_training(ranks: int = 2, per_rank_mean: bool = False) -> dict:
    """One process on the same global batches: losses, token counts per rank, final weights. ``per_rank_mean``:
    what a broken normalisation trains instead (each rank's micro-batch divided by its own token count, the ranks'
    gradients averaged), to show that the comparison tells the two apart."""
    loop = load_example()
    args = loop.parse_args(LOOP_ARGS)
    config = load_config(args.config)
    config.batching.max_tokens_per_batch = args.max_tokens
    model = loop.tiny_llama()
    assembly = assemble(model, config)
    dataset = loop.synthetic_dataset(args.examples, args.median_length, model.config.vocab_size)
    sampler = token_budget_sampler(dataset, config, num_replicas=ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    losses, tokens = [], []
    for epoch in range(args.epochs):
        plan = sampler.plan(epoch)
        for step in range(len(plan) // ranks):
            micro = plan[step * ranks : (step + 1) * ranks]
            if per_rank_mean:
                loss = sum(assembly.forward(model, assembly.collator([dataset[i] for i in b])).loss
                           for b in micro) / ranks
            else:
                batch = assembly.collator([dataset[i] for b in micro for i in b])
                loss = assembly.forward(model, batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            tokens.append([int(sampler.lengths[b].sum()) for b in micro])
    assembly.undo()
    return {"losses": losses, "tokens": tokens,
            "state": {name: p.detach().clone() for name, p in model.named_parameters()}}


def reference_run(ranks: int = 2) -> tuple[list[float], list[list[int]]]:
    """Single process, same model, data and plan: each step's global batch packed into one row, mean loss."""
    run = reference_training(ranks)
    return run["losses"], run["tokens"]


def test_ddp_two_processes_equals_single_process(tmp_path):
    out = tmp_path / "ddp.json"
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "ddp_cpu.yaml"), "--main_process_port", str(free_port()),
               str(ROOT / "examples" / "accelerate_loop.py"), *LOOP_ARGS, "--out", str(out)]
    returncode, output = run_group(command, env, timeout=180, results=[out])
    assert returncode == 0, output[-6000:]
    ddp = json.loads(out.read_text())
    assert ddp["processes"] == 2

    losses, tokens = reference_run(ranks=2)
    assert len(ddp["losses"]) == len(losses) >= 10  # two epochs
    assert ddp["tokens"] == tokens  # rank r trained micro-batch s*2 + r of the shared plan
    assert max(abs(a - b) for a, b in zip(ddp["losses"], losses)) < 1e-4
    assert losses[-1] < losses[0]  # it trains
    spread = max(max(t) / min(t) for t in tokens)
    assert spread <= 1.1, spread  # tiny budget (192 tokens): balanced to within a few tokens


def per_example_task(item) -> str | None:
    if item.originalname != "test_per_example_tasks_train_under_ddp_with_mixed_precision":
        return None
    return item.callspec.params["task"]


@pytest.mark.parametrize("task", ["seq_cls", "embedding"])
def test_per_example_tasks_train_under_ddp_with_mixed_precision(request, tmp_path_factory, task):
    """HF Trainer, 2 processes, bf16: accelerate wraps the model's forward for autocast, DDP wraps the model; the
    per-example heads run inside both (DDP's all-reduce keeps the ranks' weights equal). One launch trains every
    selected task, one after the other (tests/shared_launch.py)."""
    tasks = selected(request, per_example_task)

    def run(out, tasks):
        env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "accelerate" / "ddp_cpu.yaml"), "--main_process_port", str(free_port()),
                   "--mixed_precision", "bf16", str(ROOT / "tests" / "ddp_per_example_run.py"), ",".join(tasks),
                   str(out)]
        return run_group(command, env, timeout=120 + 60 * len(tasks), results=rank_files(out))

    def load(out) -> list[dict] | None:
        if not all(path.exists() for path in rank_files(out)):
            return None
        ranks = [json.loads(path.read_text()) for path in rank_files(out)]
        return [r[task] for r in ranks] if len(tasks) > 1 else ranks

    returncode, output, ranks = launch_once(request, tmp_path_factory, "per-example", tasks, run, load)
    assert returncode == 0 and ranks is not None, output[-6000:]
    assert all(r["processes"] == 2 and len(r["losses"]) == 4 for r in ranks)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9, abs=1e-9)


def test_trainer_contract_every_example_once_per_epoch(tmp_path):
    """What the trainer wrapper does in get_train_dataloader: HF Trainer + trainer_train_dataloader, on a
    datasets.Dataset with a length column and a text column the model does not take."""
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = load_config({"batching": {"strategy": "tokens", "max_tokens_per_batch": 160}})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assembly = assemble(model, config)
    examples = make_examples([5 + (7 * i) % 40 for i in range(40)], seed=1)
    table = datasets.Dataset.from_list([{**ex, "length": len(ex["input_ids"]), "text": "x"} for ex in examples])
    seen: list[list[tuple]] = []

    def collate(rows):
        assert all(set(row) == {"input_ids"} for row in rows)  # Trainer's unused columns were removed
        seen.append([tuple(row["input_ids"]) for row in rows])
        return assembly.collator(rows).model_inputs("labels")

    class TokenBudgetTrainer(Trainer):
        def get_train_dataloader(self):
            loader = trainer_train_dataloader(self, config)
            return loader if loader is not None else super().get_train_dataloader()

    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=2, learning_rate=1e-3, report_to=[],
                             save_strategy="no", use_cpu=True, seed=3, logging_steps=50, disable_tqdm=True)
    trainer = TokenBudgetTrainer(model=model, args=args, train_dataset=table, data_collator=collate)
    loader = trainer.get_train_dataloader()
    steps = len(loader)
    seen.clear()
    trainer.train()
    assembly.undo()

    assert trainer.state.global_step == 2 * steps
    everything = sorted(tuple(ex["input_ids"]) for ex in examples)
    epochs = [seen[:steps], seen[steps:]]
    for epoch in epochs:
        assert sorted(row for batch in epoch for row in batch) == everything  # each example once per epoch
        assert all(sum(map(len, batch)) <= 160 for batch in epoch)
    assert epochs[0] != epochs[1]  # reshuffled: Trainer's set_epoch reached the sampler
    assert loader.batch_sampler.sampler.seed == 3  # batching.seed null: the trainer's seed


def test_trainer_keeps_its_own_dataloader_for_example_count_batching():
    assert trainer_train_dataloader(object(), {"batching": {"strategy": "examples"}}) is None


def test_num_label_tokens_counts_what_the_shifted_loss_counts():
    from padfree_plugins.packing.collator import PackingCollator

    batch = PackingCollator(token_keys=("labels",), masked_first_keys=("labels",))(
        [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, -100]}])
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100]]
    assert num_label_tokens(batch).item() == 2
    assert num_label_tokens(batch, shift=False).item() == 2


@pytest.mark.parametrize("name", ["ddp_cpu.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed_zero2.yaml",
                                  "deepspeed_zero3.yaml"])
def test_accelerate_configs_are_valid(name):
    """The accelerate config examples in configs/accelerate load with accelerate's own parser. A DeepSpeed one sets
    no ``mixed_precision`` (accelerate refuses to launch it beside a DeepSpeed JSON, which sets the precision)."""
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(ROOT / "configs" / "accelerate" / name))
    deepspeed = (loaded.deepspeed_config or {}).get("deepspeed_config_file")
    assert loaded.num_processes >= 2
    if deepspeed:
        assert loaded.mixed_precision is None and (ROOT / "configs" / "accelerate" / Path(deepspeed).name).is_file()
    else:
        assert loaded.mixed_precision in ("no", "bf16")


def test_accelerate_trainer_with_token_budget(tmp_path):
    """The one call: padfree_plugins.accelerate(trainer, cfg) with batching.strategy: tokens — micro-batches within
    the budget, every example once per epoch, training runs, undo() restores the trainer's own dataloader."""
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from padfree_plugins import accelerate

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    examples = make_examples([5 + (7 * i) % 40 for i in range(40)], seed=2)
    table = datasets.Dataset.from_list(examples)
    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1, learning_rate=1e-3, report_to=[],
                             save_strategy="no", use_cpu=True, seed=3, logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=table)
    acceleration = accelerate(trainer, {"batching": {"strategy": "tokens", "max_tokens_per_batch": 160}})
    loader = trainer.get_train_dataloader()
    batches = list(loader.batch_sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(40))
    assert all(sum(len(examples[i]["input_ids"]) for i in batch) <= 160 for batch in batches)
    assert all(batch["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in batch for batch in loader)
    trainer.train()
    assert trainer.state.global_step == len(batches)
    acceleration.undo()
    assert "get_train_dataloader" not in trainer.__dict__


def test_reward_trainer_under_ddp_matches_trls_padded_run(tmp_path):
    """TRL RewardTrainer, 2 processes (fp32): padded, then padding-free, in the same launch; both ranks log the
    same loss curve, metrics (gathered across ranks) and evaluation as TRL's padded run."""
    out = tmp_path / "run.json"
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "ddp_cpu.yaml"), "--main_process_port", str(free_port()),
               "--mixed_precision", "no", str(ROOT / "tests" / "ddp_per_example_run.py"), "reward", str(out)]
    returncode, output = run_group(command, env, timeout=180, results=rank_files(out))
    assert returncode == 0, output[-6000:]
    from tests.test_reward import assert_accuracies

    runs = [json.loads((tmp_path / f"run.json.{rank}").read_text()) for rank in (0, 1)]
    # the logged accuracies are the ranks' means: rounding could move them by the ranks' mean share of near-ties
    flips = {part: [sum(shares) / 2 for shares in zip(*(run["flips"][part] for run in runs))]
             for part in ("train", "eval")}
    for run in runs:
        assert run["processes"] == 2 and len(run["padded"]["log"]) == len(run["packed"]["log"]) == 4
        for want, got in zip(run["padded"]["log"], run["packed"]["log"]):
            assert got["num_tokens"] == want["num_tokens"]
            for key in ("loss", "margin", "min_reward", "mean_reward", "max_reward"):
                assert got[key] == pytest.approx(want[key], abs=1e-4), key
        assert_accuracies([entry["accuracy"] for entry in run["packed"]["log"]],
                          [entry["accuracy"] for entry in run["padded"]["log"]], flips["train"])
        for key in ("eval_loss", "eval_margin", "eval_mean_reward"):
            assert run["packed"]["eval"][key] == pytest.approx(run["padded"]["eval"][key], abs=1e-4), key
        assert_accuracies([run["packed"]["eval"]["eval_accuracy"]], [run["padded"]["eval"]["eval_accuracy"]],
                          flips["eval"])
