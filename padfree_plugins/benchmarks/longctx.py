"""``bench longctx``: peak activation memory and real tokens/s of one training step against the row's length, with
gradient checkpointing alone, + the tiled MLP, + the tiled LM head and loss (``memory.tile_tokens``).

Models are scaled down with Llama-8B's ratios (intermediate = 3.5 x hidden, vocabulary = 31 x hidden): a Llama
shape and a Qwen3.5 shape (three gated-DeltaNet layers per attention layer). A row is packed from examples of
``example_tokens`` tokens (long-context SFT rows; attention cost stays linear in the row), every label counts.

Peak activation memory: on CUDA ``max_memory_allocated`` during the step minus what was allocated before it
(weights, gradients); on CPU, where no allocator counts, the growth of the process's peak resident memory
(``ru_maxrss``) over the step, each measurement in a fresh process with glibc returning large blocks at once
(``MALLOC_MMAP_THRESHOLD_``) — an upper bound that includes allocator slack.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: Variant -> its ``memory`` section (every variant runs with gradient checkpointing).
VARIANTS = {
    "checkpointing": None,
    "+ tiled MLP": {"tile_tokens": "auto", "tile_loss": False, "tile_mixers": False},
    "+ tiled loss": {"tile_tokens": "auto", "tile_mixers": False},
    "+ tiled mixers": {"tile_tokens": "auto"},
}
#: The variant with everything tiled (the targets' "tiling"); a shape without sequence mixers has no
#: ``+ tiled mixers`` row, its ``+ tiled loss`` tiles everything it has.
ALL_TILED = ("+ tiled mixers", "+ tiled loss")
#: Shapes scaled down from Llama-8B's ratios at ``hidden`` (intermediate 3.5x, vocabulary 31x).
SHAPES = ("llama", "qwen3_5")
TITLES = {"llama": "Llama-shaped", "qwen3_5": "Qwen3.5-shaped (3 gated-DeltaNet layers per attention layer)"}
#: The shapes whose layers include sequence mixers (a ``+ tiled mixers`` row).
WITH_MIXERS = ("qwen3_5",)


def variants_of(shape: str) -> list[str]:
    """The variants measured for ``shape``: ``+ tiled mixers`` only where it has sequence mixers."""
    return [variant for variant in VARIANTS if variant != "+ tiled mixers" or shape in WITH_MIXERS]


def model_config(shape: str, hidden: int, layers: int) -> Any:
    """The scaled-down config of ``shape``: ``hidden`` wide, ``layers`` deep, heads of 64."""
    from transformers import AutoConfig

    common = dict(hidden_size=hidden, intermediate_size=int(3.5 * hidden), vocab_size=31 * hidden,
                  num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                  max_position_embeddings=1 << 20, tie_word_embeddings=False)
    if shape == "llama":
        return AutoConfig.for_model("llama", **common)
    if shape == "qwen3_5":
        kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        return AutoConfig.for_model("qwen3_5_text", **common, head_dim=64,
                                    layer_types=[kinds[i % 4] for i in range(layers)],
                                    linear_num_key_heads=max(1, hidden // 128), linear_num_value_heads=hidden // 64,
                                    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
    raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")


@dataclass
class Measurement:
    shape: str
    variant: str
    tokens: int
    peak_bytes: int
    tokens_per_s: float
    loss: float
    device: str
    #: Tokens per second of the process's own CPU time over the step (``time.process_time``): on a shared machine
    #: less sensitive to other jobs than ``tokens_per_s`` (wall clock); on CUDA the host's time only.
    tokens_per_cpu_s: float = 0.0
    #: The round it was measured in (``--rounds``), and the machine's 1-minute load average as it started.
    round: int = 0
    load: float = 0.0


def measure(shape: str, variant: str, tokens: int, hidden: int, layers: int, example_tokens: int,
            device: str, steps: int = 2, threads: int | None = None) -> Measurement:
    """One packed row of ``tokens`` through a checkpointed training step of ``shape`` with ``variant``'s tiling:
    peak activation bytes (of the last step) and real tokens/s (of the last step), on ``threads`` torch threads."""
    if threads is not None:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    from padfree_plugins import assemble
    from padfree_plugins.packing.labelled_logits import keep_labelled_logits

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(shape, hidden, layers), attn_implementation="sdpa")
    model = model.to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    memory = VARIANTS[variant]
    assembly = assemble(model, {"task": "causal_lm", **({"memory": memory} if memory else {})})
    generator = torch.Generator().manual_seed(0)
    lengths = [example_tokens] * (tokens // example_tokens) + ([tokens % example_tokens] if tokens % example_tokens
                                                               else [])
    examples = [{"input_ids": torch.randint(5, model.config.vocab_size, (n,), generator=generator).tolist()}
                for n in lengths]
    batch = keep_labelled_logits(assembly.collator(examples))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def step() -> float:
        model.zero_grad(set_to_none=False)
        loss = assembly.forward(model, batch).loss
        loss.backward()
        return float(loss)

    step_loss, seconds, peak = 0.0, 0.0, 0
    for index in range(steps):
        last = index == steps - 1
        if last and device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        elif last:
            before = _resident_bytes()
        start, cpu_start = time.perf_counter(), time.process_time()
        step_loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if last:
            peak = (torch.cuda.max_memory_allocated() if device == "cuda" else _peak_resident_bytes()) - before
    assembly.undo()
    return Measurement(shape, variant, tokens, max(peak, 0), tokens / seconds, step_loss, device,
                       tokens / max(cpu_seconds, 1e-9))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class LongContextSettings:
    shapes: tuple[str, ...] = SHAPES
    lengths: tuple[int, ...] = (4096, 8192, 16384)
    hidden: int = 256
    layers: int = 4
    example_tokens: int = 4096
    device: str = "cpu"
    budget_gib: float = 4.0
    threads: int = 1
    #: Training steps per measurement; memory and tokens/s are the last step's (1: the first step, warm-up included).
    steps: int = 2
    #: The variants measured (of each shape's :func:`variants_of`); empty: all.
    variants: tuple[str, ...] = ()
    #: Rounds of every measurement, interleaved (each round measures every shape, length and variant once).
    rounds: int = 1


@dataclass
class LongContextResult:
    """``rows``: one per shape, variant and length (over rounds: the medians of tokens/s, the largest peak);
    ``samples``: every measurement of every round."""

    settings: LongContextSettings
    rows: list[Measurement] = field(default_factory=list)
    samples: list[Measurement] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"settings": asdict(self.settings), "rows": [asdict(r) for r in self.rows],
                           "samples": [asdict(r) for r in self.samples]}, indent=1)

    def cpu_ratio(self, shape: str, variant: str, tokens: int) -> float | None:
        """Tokens per CPU-second of ``variant`` over checkpointing alone's: the median over the rounds of each
        round's ratio (interleaved: both measured under the same load), or of the rows without samples."""
        def of(name: str) -> dict[int, float]:
            return {r.round: r.tokens_per_cpu_s for r in self.samples
                    if (r.shape, r.variant, r.tokens) == (shape, name, tokens) and r.tokens_per_cpu_s}

        tiled, base = of(variant), of("checkpointing")
        ratios = sorted(tiled[k] / base[k] for k in tiled if k in base)
        if not ratios:
            row, base_row = self.of(shape, variant, tokens), self.of(shape, "checkpointing", tokens)
            if not (row and base_row and row.tokens_per_cpu_s and base_row.tokens_per_cpu_s):
                return None
            return row.tokens_per_cpu_s / base_row.tokens_per_cpu_s
        middle = len(ratios) // 2
        return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2

    def of(self, shape: str, variant: str, tokens: int) -> Measurement | None:
        return next((r for r in self.rows if (r.shape, r.variant, r.tokens) == (shape, variant, tokens)), None)

    def tiled_variant(self, shape: str) -> str:
        """The variant of ``shape`` with everything tiled that was measured (see :data:`ALL_TILED`)."""
        return next((v for v in ALL_TILED if any((r.shape, r.variant) == (shape, v) for r in self.rows)), ALL_TILED[-1])

    def summary(self, shape: str) -> list[str]:
        """The targets: memory at the longest row against checkpointing alone, growth from a quarter of it, cost in
        tokens/s, and the longest row that fits the budget (a linear fit of the measured peaks)."""
        lines = []
        longest = max(self.settings.lengths)
        full = self.tiled_variant(shape)
        base, tiled = self.of(shape, "checkpointing", longest), self.of(shape, full, longest)
        if base and tiled and base.peak_bytes:
            lines.append(f"at {longest:,} tokens: tiled peak = {tiled.peak_bytes / base.peak_bytes:.2f} x "
                         "checkpointing alone (target <= 0.35)")
        quarter = self.of(shape, full, longest // 4)
        if tiled and quarter and quarter.peak_bytes:
            lines.append(f"growth {longest:,} / {longest // 4:,} tokens, tiled: "
                         f"{tiled.peak_bytes / quarter.peak_bytes:.2f} x (linear: 4; target <= 4.3)")
        middle = 16384 if 16384 in self.settings.lengths else sorted(self.settings.lengths)[len(self.settings.lengths) // 2]
        base_m, tiled_m = self.of(shape, "checkpointing", middle), self.of(shape, full, middle)
        if base_m and tiled_m:
            ratio = self.cpu_ratio(shape, full, middle)
            cpu = f"; per CPU-second {ratio:.2f} x" if ratio is not None else ""
            lines.append(f"tokens/s at {middle:,}: tiled {tiled_m.tokens_per_s / base_m.tokens_per_s:.2f} x "
                         f"checkpointing alone{cpu} (target >= 0.90)")
        budget = self.settings.budget_gib * 2 ** 30
        for variant in ("checkpointing", full):
            points = [(r.tokens, r.peak_bytes) for r in self.rows if (r.shape, r.variant) == (shape, variant)]
            if len(points) >= 2:
                (t0, b0), (t1, b1) = min(points), max(points)
                per_token = (b1 - b0) / (t1 - t0) if t1 != t0 else b1 / t1
                fits = int((budget - (b1 - per_token * t1)) / per_token) if per_token > 0 else 0
                lines.append(f"longest row in {self.settings.budget_gib:g} GiB of activations, {variant}: "
                             f"~{fits:,} tokens (linear fit of the measured peaks)")
        return lines


def run_one(argv: list[str]) -> None:
    """``python -m padfree_plugins.benchmarks.longctx SHAPE VARIANT TOKENS HIDDEN LAYERS EXAMPLE DEVICE THREADS
    [STEPS]``: one measurement as JSON on stdout (a fresh process per measurement: peak resident memory is per
    process)."""
    shape, variant, tokens, hidden, layers, example, device, threads, *steps = argv
    result = measure(shape, variant, int(tokens), int(hidden), int(layers), int(example), device,
                     steps=int(steps[0]) if steps else 2, threads=int(threads))
    print(json.dumps(asdict(result)))


def run_longctx_benchmark(settings: LongContextSettings, progress: Any = None) -> LongContextResult:
    """Every shape x variant x length, each in its own process, ``settings.rounds`` times interleaved."""
    result = LongContextResult(settings)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    plan = [(shape, tokens, variant) for shape in settings.shapes for tokens in settings.lengths
            for variant in variants_of(shape) if not settings.variants or variant in settings.variants]
    for round_ in range(settings.rounds):
        for shape, tokens, variant in plan:
            load = os.getloadavg()[0]
            command = [sys.executable, "-m", "padfree_plugins.benchmarks.longctx", shape, variant, str(tokens),
                       str(settings.hidden), str(settings.layers), str(settings.example_tokens), settings.device,
                       str(settings.threads), str(settings.steps)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"bench longctx {shape} {variant} {tokens}: {done.stderr[-2000:]}")
            row = Measurement(**{**json.loads(done.stdout.strip().splitlines()[-1]), "round": round_,
                                 "load": load})
            result.samples.append(row)
            if progress is not None:
                progress(f"round {round_ + 1}/{settings.rounds}: {shape} {tokens:,} tokens {variant}: "
                         f"{row.peak_bytes / 2 ** 20:,.0f} MiB, {row.tokens_per_s:,.0f} tok/s, "
                         f"{row.tokens_per_cpu_s:,.0f} tok/CPU-s (load {load:.1f})")
    result.rows = [medians([r for r in result.samples if (r.shape, r.tokens, r.variant) == key]) for key in plan]
    return result


def medians(samples: list[Measurement]) -> Measurement:
    """One row for the rounds of a measurement: the median tokens/s (real, per CPU-second) and load, the largest
    peak."""
    def median(values: list[float]) -> float:
        ordered, middle = sorted(values), len(values) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    first = samples[0]
    return Measurement(first.shape, first.variant, first.tokens, max(r.peak_bytes for r in samples),
                       median([r.tokens_per_s for r in samples]), first.loss, first.device,
                       median([r.tokens_per_cpu_s for r in samples]), 0, median([r.load for r in samples]))


if __name__ == "__main__":
    run_one(sys.argv[1:])
