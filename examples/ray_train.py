"""Ray Train: the padding-free loop of ``examples/accelerate_loop.py`` on Ray workers (``TorchTrainer``).

    python examples/ray_train.py --workers 2            # 2 CPU workers (gloo); --gpu: one GPU per worker

Each worker builds its Hugging Face ``datasets.Dataset`` inside ``train_func`` (so no dataset is pickled to the
workers) and trains with accelerate on the process group Ray Train started: token-budget micro-batches
(``token_budget_dataloader``), the packing collator, the loss over the global token count. Rank 0 reports the loss
curve. With the same arguments it equals ``python examples/accelerate_loop.py --ranks 2`` (one process on the same
global batches): ``tests/test_ray_train.py``.

HF ``Trainer`` works the same way: build the trainer in ``train_func``, ``padfree_plugins.accelerate(trainer,
cfg)``, then ``ray.train.huggingface.transformers.prepare_trainer(trainer)``, which only replaces the dataloader
getters. Do not feed it Ray Data (``ray.train.get_dataset_shard``): Ray's ``iter_torch_batches`` collates with
``lambda x: x[0]``, bypassing the padding-free collator and the token-budget sampler. Load the data with
``datasets`` inside ``train_func`` (docs/launchers.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_loop():
    """examples/accelerate_loop.py as a module (examples are not a package)."""
    spec = importlib.util.spec_from_file_location("accelerate_loop", ROOT / "examples" / "accelerate_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_func(config: dict) -> None:
    """What every Ray worker runs: a ``datasets.Dataset`` built here, the padding-free loop, a report."""
    import datasets
    import ray.train
    from accelerate import Accelerator

    loop = load_loop()
    args = loop.parse_args(config["loop_args"])
    vocab = loop.tiny_llama().config.vocab_size
    dataset = datasets.Dataset.from_list(loop.synthetic_dataset(args.examples, args.median_length, vocab))
    accelerator = Accelerator(cpu=not config["gpu"])
    losses = loop.train(accelerator, args, dataset=dataset)
    metrics = {"losses": losses, "processes": accelerator.num_processes}
    # Ray Train keeps the metrics of reports that carry a checkpoint: rank 0 saves the loss curve as one
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            Path(directory, "losses.json").write_text(json.dumps(metrics))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint)


def run(workers: int, loop_args: list[str], gpu: bool = False) -> dict:
    """Train on ``workers`` Ray Train workers; the metrics rank 0 reported (``losses``, ``processes``)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not ray.is_initialized():  # workers import padfree_plugins and the examples from this checkout
        ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                      os.environ.get("PYTHONPATH")])),
                                           "OMP_NUM_THREADS": "1"}})
    trainer = TorchTrainer(train_func, train_loop_config={"loop_args": loop_args, "gpu": gpu},
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu,
                                                        resources_per_worker={"CPU": 1}),
                           torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
                           run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="padfree-ray-")))
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return result.metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL)")
    parser.add_argument("--out", default=None, help="write the loss curve here (JSON)")
    known, loop_args = parser.parse_known_args(argv)
    metrics = run(known.workers, loop_args, known.gpu)
    print(f"{metrics['processes']} workers, losses: {', '.join(f'{x:.4f}' for x in metrics['losses'])}")
    if known.out:
        Path(known.out).write_text(json.dumps({"losses": metrics["losses"], "processes": metrics["processes"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
