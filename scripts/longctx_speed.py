"""Tokens per CPU-second of the Qwen3.5 shape of ``bench longctx`` at one row length, in one process, variants in
interleaved rounds (the order rotated each round), each variant one untimed step then one timed step; the ratio to
checkpointing alone is the median of each round's. ``+ tiled mixers (before)``: the tiled mixers with their
checkpoint recompute scanning the row again (no stashes), as before the recompute took the scan's output.

    PYTHONPATH=. python scripts/longctx_speed.py --rounds 4 --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--example-tokens", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from padfree_plugins import assemble
    from padfree_plugins.benchmarks.longctx import VARIANTS, model_config
    from padfree_plugins.modeling.tiled_mixers import TiledMixer
    from padfree_plugins.packing.labelled_logits import keep_labelled_logits

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("qwen3_5", args.hidden, args.layers),
                                             attn_implementation="sdpa").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    variants = {"checkpointing": "checkpointing", "+ tiled loss": "+ tiled loss",
                "+ tiled mixers (before)": "+ tiled mixers", "+ tiled mixers": "+ tiled mixers"}
    names, samples = list(variants), []
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            memory = VARIANTS[variants[name]]
            assembly = assemble(model, {"task": "causal_lm", **({"memory": memory} if memory else {})})
            if name.endswith("(before)"):
                for module in model.modules():
                    if isinstance(vars(module).get("forward"), TiledMixer):
                        module.forward.stashes = None
            generator = torch.Generator().manual_seed(0)
            examples = [{"input_ids": torch.randint(5, model.config.vocab_size, (args.example_tokens,),
                                                    generator=generator).tolist()}
                        for _ in range(args.tokens // args.example_tokens)]
            batch = keep_labelled_logits(assembly.collator(examples))

            def step() -> float:
                model.zero_grad(set_to_none=False)
                loss = assembly.forward(model, batch).loss
                loss.backward()
                return float(loss.detach())

            step()
            load = os.getloadavg()[0]
            wall, cpu = time.perf_counter(), time.process_time()
            loss = step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            assembly.undo()
            samples.append(dict(round=round_, variant=name, loss=loss, tok_s=args.tokens / wall,
                                tok_cpu_s=args.tokens / cpu, load=load))
            print(json.dumps(samples[-1]), flush=True)
    for name in names:
        of = {s["round"]: s for s in samples if s["variant"] == name}
        base = {s["round"]: s for s in samples if s["variant"] == "checkpointing"}
        ratios = [of[r]["tok_cpu_s"] / base[r]["tok_cpu_s"] for r in sorted(of)]
        print(f"{name}: tok/s {statistics.median(s['tok_s'] for s in of.values()):,.0f}, tok/CPU-s "
              f"{statistics.median(s['tok_cpu_s'] for s in of.values()):,.0f}, loss {of[0]['loss']:.6f}, vs "
              f"checkpointing per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
