"""The embedded end-to-end demonstration: pack a batch, run a tiny model padded and padding-free, compare.

No downloads: the models are built from configs with random weights. For each model it reports the largest
per-example difference between the padded and the padding-free outputs, and forward+backward throughput in real
(non-pad) tokens per second for both, measured side by side in one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from padfree_plugins.assembly import assemble
from padfree_plugins.benchmarks.lengths import lognormal_lengths
from padfree_plugins.packing.padded import pad_examples


@dataclass
class DemoResult:
    model: str
    batch_size: int
    real_tokens: int
    padding_fraction: float
    max_abs_diff: float
    padded_tokens_per_s: float
    padfree_tokens_per_s: float
    backend: str

    @property
    def speedup(self) -> float:
        return self.padfree_tokens_per_s / self.padded_tokens_per_s


def demo_models() -> dict[str, torch.nn.Module]:
    """A tiny Llama (4 layers, d=256, GQA 8/2) and a tiny BERT (4 layers, d=256), random weights."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    torch.manual_seed(0)
    llama = LlamaModel(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024),
                       ).eval()
    bert = BertModel(BertConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                num_attention_heads=4, max_position_embeddings=1024), add_pooling_layer=False).eval()
    for model in (llama, bert):
        model.set_attn_implementation("sdpa")
    return {"llama": llama, "bert": bert}


def _time_step(model, inputs: dict, repeats: int) -> float:
    """Median seconds of a forward+backward of the summed hidden states."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(**inputs).last_hidden_state.float().pow(2).mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def run_demo(batch_size: int = 16, median: float = 120, sigma: float = 0.6, repeats: int = 5,
             seed: int = 0, progress: Callable[[str], None] | None = None) -> list[DemoResult]:
    """Run the demonstration for every demo model; see the module docstring. ``progress`` gets a line per stage."""
    say = progress or (lambda _: None)
    say("building a tiny Llama and a tiny BERT (random weights)...")
    results = []
    for name, model in demo_models().items():
        lengths = lognormal_lengths(batch_size, median, sigma, 8, 1000, seed)
        say(f"{name}: {batch_size} examples, {sum(lengths)} real tokens: padded vs padding-free outputs...")
        generator = torch.Generator().manual_seed(seed)
        examples = [{"input_ids": torch.randint(5, model.config.vocab_size, (n,), generator=generator).tolist()}
                    for n in lengths]
        padded = pad_examples(examples)
        with torch.no_grad():
            reference = model(**padded).last_hidden_state
        assembly = assemble(model, {"task": "hidden_states"})
        try:
            batch = assembly.collator(examples)
            inputs = batch.model_inputs()
            with torch.no_grad():
                packed = model(**inputs).last_hidden_state
            cu = batch["cu_seq_lens_q"].tolist()
            diff = max((packed[0, cu[i] : cu[i + 1]] - reference[i, :n]).abs().max().item()
                       for i, n in enumerate(lengths))
            model.train()
            padfree_s, padded_s = [], []
            for round_ in range(2):  # interleaved, so that machine noise hits both sides alike
                say(f"{name}: timing padding-free vs padded, round {round_ + 1}/2 ({repeats} steps each)...")
                padfree_s.append(_time_step(model, inputs, repeats))
                assembly.undo()
                padded_s.append(_time_step(model, padded, repeats))
                assembly = assemble(model, {"task": "hidden_states"})
            model.eval()
        finally:
            assembly.undo()
        real = sum(lengths)
        results.append(DemoResult(
            model=name, batch_size=batch_size, real_tokens=real,
            padding_fraction=1 - real / (batch_size * max(lengths)), max_abs_diff=diff,
            padded_tokens_per_s=real / min(padded_s), padfree_tokens_per_s=real / min(padfree_s),
            backend=assembly.plan.backend.name,
        ))
    return results
