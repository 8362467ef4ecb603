"""Where torch.compile stood on packed rows before compile support (docs/compile.md): host reads in one eager
forward + backward of a patched 4-layer Llama on the exact backend, and graphs / graph breaks by cause over 12
compiled steps on rows of changing length and example count (``aot_eager``: dynamo's graphs as inductor gets them,
without its C++ compile time).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compile_baseline.py
"""

from __future__ import annotations

import logging
import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from padfree_plugins import assemble
from padfree_plugins.testing.compiled import compile_report, counting_backend, host_reads


def main(steps: int = 12) -> None:
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    torch.manual_seed(0)
    rng = random.Random(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact"})

    def batch():
        ids = [[rng.randrange(3, 128) for _ in range(rng.randint(5, 90))] for _ in range(rng.randint(2, 6))]
        return assembly.collator([{"input_ids": row, "labels": row} for row in ids])

    with host_reads() as seen:
        assembly.forward(model, batch()).loss.backward()
    print(f"eager forward + backward, 4 layers: {dict(seen.reads)} host reads, {dict(seen.data_shaped)} data-shaped")
    with compile_report() as report:
        compiled = torch.compile(model, backend=counting_backend(report))
        for _ in range(steps):
            assembly.forward(compiled, batch()).loss.backward()
    print(f"compiled, {steps} steps: {report.graphs} graphs, {report.break_count} graph breaks")
    for reason, count in report.breaks.most_common():
        print(f"  {count:3d}  {reason}")


if __name__ == "__main__":
    main()
