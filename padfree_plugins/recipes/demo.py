"""The embedded end-to-end demonstration: pack a batch, run a tiny model padded and padding-free, compare.

No downloads: the models are built from configs with random weights. For each model it reports the largest
per-example difference between the padded and the padding-free outputs, and the forward+backward speed of both,
measured the way the benchmarks measure (:mod:`padfree_plugins.benchmarks.measure`):

* one batch of lognormal lengths (an SFT set such as Alpaca: median 120, sigma 0.6), whose padding share is stated
  with the speed-up it allows at best, ``1 / (1 - padding share)`` (the *ideal*: padding-free computes only the real
  tokens, padded computes them all);
* one torch intra-op thread by default: on a shared CPU, OpenMP barriers across contended cores dominate small
  kernels and would time the scheduler (as ``padfree-plugins bench``);
* interleaved rounds (each runs one step of each variant, order rotating), the ratio taken within each round, then
  its median and its range over the rounds.

On a 2-core machine under a load of about 8, the default batch (49% padding, ideal 1.97x) timed 1.05x for the tiny
Llama and 0.64x for the tiny BERT with two threads, 2.15x and 2.04x with one: contended OpenMP barriers, not
padding, decided the two-thread figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from padfree_plugins.assembly import assemble
from padfree_plugins.benchmarks.lengths import lognormal_lengths
from padfree_plugins.benchmarks.measure import Ratio, interleaved_rounds, round_ratio, torch_threads
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.packing.padded import pad_examples

#: The demo's configuration of the model (the task that returns the base model's hidden states).
CONFIG = {"task": "hidden_states"}


@dataclass
class DemoResult:
    model: str
    batch_size: int
    real_tokens: int
    padding_fraction: float
    max_abs_diff: float
    padded_tokens_per_s: float
    padfree_tokens_per_s: float
    speedup: Ratio
    backend: str
    threads: int

    @property
    def ideal(self) -> float:
        """The speed-up padding-free reaches at best: the padded batch's tokens over its real tokens."""
        return 1 / (1 - self.padding_fraction)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in vars(self).items() if k != "speedup"}, "speedup": self.speedup.median,
                "speedup_low": self.speedup.low, "speedup_high": self.speedup.high, "rounds": self.speedup.rounds,
                "ideal": self.ideal}


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


def _step(model, inputs: dict) -> Callable[[], None]:
    """A forward+backward of the mean square of the hidden states, gradients cleared after."""
    def step() -> None:
        model(**inputs).last_hidden_state.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def run_demo(batch_size: int = 16, median: float = 120, sigma: float = 0.6, repeats: int = 5,
             seed: int = 0, threads: int | None = 1,
             progress: Callable[[str], None] | None = None) -> list[DemoResult]:
    """Run the demonstration for every demo model; see the module docstring. ``repeats``: interleaved rounds (one
    timed step of each variant each); ``threads``: torch intra-op threads (``None``: as they are);
    ``progress`` gets a line per stage."""
    say = progress or (lambda _: None)
    say("building a tiny Llama and a tiny BERT (random weights)...")
    host = PluginHost()
    lengths = lognormal_lengths(batch_size, median, sigma, 8, 1000, seed)
    real = sum(lengths)
    padding = 1 - real / (batch_size * max(lengths))
    results = []
    with torch_threads(threads):
        for name, model in demo_models().items():
            say(f"{name}: {batch_size} examples, {real} real tokens, {padding:.0%} of the padded batch is padding "
                f"(ideal speed-up {1 / (1 - padding):.2f}x): padded vs padding-free outputs...")
            generator = torch.Generator().manual_seed(seed)
            examples = [{"input_ids": torch.randint(5, model.config.vocab_size, (n,), generator=generator).tolist()}
                        for n in lengths]
            padded = pad_examples(examples)
            with torch.no_grad():
                reference = model(**padded).last_hidden_state
            assembly = assemble(model, CONFIG, host=host)
            backend = assembly.plan.backend.name
            patched = {"padfree": assembly}
            try:
                batch = assembly.collator(examples)
                inputs = batch.model_inputs()
                with torch.no_grad():
                    packed = model(**inputs).last_hidden_state
                cu = batch["cu_seq_lens_q"].tolist()
                diff = max((packed[0, cu[i]: cu[i + 1]] - reference[i, :n]).abs().max().item()
                           for i, n in enumerate(lengths))
                model.train()

                def enter(variant: str) -> None:  # padding-free runs the patched model, padded the model as it was
                    if variant == "padfree" and patched["padfree"] is None:
                        patched["padfree"] = assemble(model, CONFIG, host=host)
                    elif variant == "padded" and patched["padfree"] is not None:
                        patched["padfree"].undo()
                        patched["padfree"] = None

                steps = {"padfree": _step(model, inputs), "padded": _step(model, padded)}
                say(f"{name}: warming up, then {repeats} interleaved rounds of padding-free and padded "
                    f"(forward + backward, {torch.get_num_threads()} thread(s))...")
                interleaved_rounds(steps, 1, enter)  # warm-up: one untimed step of each
                times = interleaved_rounds(steps, repeats, enter)
            finally:
                if patched["padfree"] is not None:
                    patched["padfree"].undo()
                model.eval()
            speedup = round_ratio(times["padded"], times["padfree"])
            results.append(DemoResult(
                model=name, batch_size=batch_size, real_tokens=real, padding_fraction=padding, max_abs_diff=diff,
                padded_tokens_per_s=real / statistics.median(times["padded"]),
                padfree_tokens_per_s=real / statistics.median(times["padfree"]),
                speedup=speedup, backend=backend, threads=torch.get_num_threads()))
    return results
