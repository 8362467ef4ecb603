"""A plain accelerate training loop (no Trainer): padding-free, token-budget batches, balanced ranks.

    # one process per GPU (DDP; FSDP / DeepSpeed through an accelerate config, see docs/scaling.md)
    accelerate launch --num_processes 8 examples/accelerate_loop.py
    # two CPU processes (gloo), as the test suite runs it
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/ddp_cpu.yaml examples/accelerate_loop.py
    # one process training on exactly the same global batches as 2 ranks would (the reference)
    python examples/accelerate_loop.py --ranks 2

The recipe:

1. ``assemble(model, config)`` patches the model and gives the packing collator;
2. ``token_budget_dataloader(..., num_replicas=accelerator.num_processes)`` packs micro-batches under the token
   budget, ``N`` balanced ones per step; ``accelerator.prepare`` hands micro-batch ``s*N + r`` to rank ``r``;
3. every step, the loss is the sum of token losses over the **global** token count, times ``N`` (DDP averages
   gradients), so the run equals single-process training on the same global batches
   (padfree_plugins.batching.distributed).

The model is a tiny Llama with random weights and the data random token sequences, so it runs anywhere without
downloads; swap in your own model and tokenized dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import LlamaConfig, LlamaForCausalLM

from padfree_plugins import assemble, load_config, patch_of
from padfree_plugins.batching.distributed import global_token_count, num_label_tokens
from padfree_plugins.batching.sampler import token_budget_dataloader

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "token_budget.yaml"), help="padfree.yaml")
    parser.add_argument("--max-tokens", type=int, default=None, help="override batching.max_tokens_per_batch")
    parser.add_argument("--ranks", type=int, default=None,
                        help="in one process: train on the global batches of this many ranks (the reference run)")
    parser.add_argument("--examples", type=int, default=256, help="synthetic examples")
    parser.add_argument("--median-length", type=float, default=60, help="median example length (lognormal)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=None, help="write the loss curve and tokens per rank here (JSON)")
    return parser.parse_args(argv)


def synthetic_dataset(n: int, median: float, vocab: int, seed: int = 0) -> list[dict]:
    """Tokenized examples with lognormal lengths (labels default to input_ids in the causal_lm collator)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=generator) * 0.6 + math.log(median)).round().clamp(4, 8 * median)
    return [{"input_ids": torch.randint(3, vocab, (int(length),), generator=generator).tolist()} for length in lengths]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    accelerator = Accelerator()
    losses = train(accelerator, args)
    # The process group is torn down once train() has returned, so DDP (whose reducer holds the group) is gone
    # first: destroying the group while DDP still holds it deadlocks gloo at DDP's release (torch 2.13).
    accelerator.end_training()
    return losses


def train(accelerator: Accelerator, args: argparse.Namespace, dataset: Any = None) -> list[float]:
    """Train; ``dataset`` (tokenized examples, a list or a ``datasets.Dataset``): the synthetic one by default."""
    ranks = accelerator.num_processes
    if args.ranks is not None and ranks > 1 and args.ranks != ranks:
        raise SystemExit(f"--ranks {args.ranks} is for a single process; this run has {ranks} processes")
    ranks = args.ranks or ranks
    per_step = ranks // accelerator.num_processes  # micro-batches this process trains per step

    config = load_config(args.config)
    if args.max_tokens is not None:
        config.batching.max_tokens_per_batch = args.max_tokens
    model = tiny_llama()
    assembly = assemble(model, config)
    if dataset is None:
        dataset = synthetic_dataset(args.examples, args.median_length, model.config.vocab_size)
    loader = token_budget_dataloader(dataset, assembly.collator, config, num_replicas=ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, tokens = [], []
    model.train()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // per_step):
            micro = [next(batches) for _ in range(per_step)]
            total = global_token_count(accelerator, sum(num_label_tokens(b) for b in micro))
            step_loss = torch.zeros((), device=accelerator.device)
            for i, batch in enumerate(micro):
                sync = contextlib.nullcontext() if i == len(micro) - 1 else accelerator.no_sync(model)
                with sync:
                    loss = assembly.forward(model, batch, num_items_in_batch=total).loss
                    accelerator.backward(loss * accelerator.num_processes)
                step_loss += loss.detach()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(step_loss, reduction="sum").item())
            local = torch.tensor([b.num_tokens for b in micro], device=accelerator.device)
            tokens.append(accelerator.gather(local).tolist())
            accelerator.print(f"epoch {epoch} step {len(losses)}: loss {losses[-1]:.6f}, tokens per rank "
                              f"{tokens[-1]}")
    groups = sequence_groups(accelerator, assembly)
    if args.out and accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"processes": accelerator.num_processes, "ranks": ranks,
                                              "distributed_type": accelerator.distributed_type.value,
                                              "sequence_groups": groups,
                                              "losses": losses, "tokens": tokens}))
    return losses


def sequence_groups(accelerator: Accelerator, assembly) -> list[dict]:
    """Every rank's node (torchrun's ``GROUP_RANK``) and the ranks it trains rows with (its sequence-parallel
    group; itself alone without sequence parallelism)."""
    sequence = getattr(patch_of(assembly.model), "sequence", None)
    if sequence is None:
        together = [accelerator.process_index]
    elif sequence.group is None:
        together = list(range(accelerator.num_processes))
    else:
        together = torch.distributed.get_process_group_ranks(sequence.group)
    mine = {"rank": accelerator.process_index, "node": int(os.environ.get("GROUP_RANK", 0)), "rows_with": together}
    return gather_object([mine]) if accelerator.num_processes > 1 else [mine]


if __name__ == "__main__":
    main()
