"""``bench sft --compile``: torch.compile on packed rows, beside eager padding-free and the compiled baselines, same
model weights, same batches, one run (docs/compile.md).

Variants (every batch runs all of them, in an order that rotates each round):

* ``padfree``: the model as :func:`~padfree_plugins.assemble` patches it, eager, its collator's packed row;
* ``padfree+compile``: the same model compiled (``torch.compile(model, backend=...)``) on the same rows;
* ``padded+compile``: an unpatched copy, compiled, on the right-padded batch (``attention_mask``, labels -100);
* ``hf_native+compile``: the unpatched copy, compiled, on ``DataCollatorWithFlattening``'s row (transformers'
  packed-sequence mask).

Each compiled variant first runs every batch once (the warm-up, untimed for speed): what that costs over one steady
pass is its compile time (``compile_s``). Graphs are counted by a counting backend around the real one, graph breaks
from dynamo's counters, both during the warm-up; ``recompiles`` counts the graphs compiled during the timed rounds
(0: every length of the epoch was covered by the warm-up's graphs). Figures are medians over rounds; the loss
difference is from eager ``padfree`` (the same model, so compiled and eager differ by float rounding only).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from padfree_plugins.benchmarks.lengths import draw_lengths
from padfree_plugins.benchmarks.measure import synchronize
from padfree_plugins.benchmarks.sft import BenchSettings, build_model, make_examples
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from padfree_plugins.packing.padded import pad_examples
from padfree_plugins.testing.compiled import CompileReport, compile_report, counting_backend

COMPILE_VARIANTS = ("padfree", "padfree+compile", "padded+compile", "hf_native+compile")


@dataclass
class CompileRow:
    law: str
    batch_size: int
    variant: str
    real_tokens: int
    tokens_per_s: float
    step_ms: float
    speedup_vs_eager: float  # vs eager padfree, median of per-round ratios
    loss_rel_diff: float  # largest over the batches, vs eager padfree
    graphs: int = 0
    breaks: int = 0
    recompiles: int = 0
    compile_s: float = 0.0
    break_reasons: dict = field(default_factory=dict)


@dataclass
class CompileResult:
    backend: str
    rows: list[CompileRow]
    environment: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "environment": self.environment, "rows": [asdict(r) for r in self.rows]}


class CompiledRunner:
    """The four variants' steps: one patched model (eager and compiled) and one unpatched copy (compiled twice)."""

    def __init__(self, model: torch.nn.Module, backend: str | Callable) -> None:
        from transformers import DataCollatorWithFlattening

        from padfree_plugins.assembly import assemble

        self.plain = copy.deepcopy(model)
        self.assembly = assemble(model, {"task": "causal_lm"})
        self.model = model
        self.flatten = DataCollatorWithFlattening(return_position_ids=True)
        self.reports = {v: CompileReport() for v in COMPILE_VARIANTS if v.endswith("+compile")}
        self.modules = {"padfree": model}
        for variant, report in self.reports.items():
            base = model if variant == "padfree+compile" else self.plain
            self.modules[variant] = torch.compile(base, backend=counting_backend(report, backend))

    def prepare(self, variant: str, examples: list[dict], device: torch.device) -> dict:
        if variant.startswith("padded"):
            inputs = pad_examples(examples, ("input_ids", "labels"))
        elif variant.startswith("hf_native"):
            inputs = dict(self.flatten(examples))
        else:  # as HF Trainer runs it: logits only where a label counts
            inputs = keep_labelled_logits(self.assembly.collator(examples))
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def loss(self, variant: str, inputs: dict) -> torch.Tensor:
        module = self.modules[variant]
        if variant.startswith("padfree"):
            return self.assembly.forward(module, inputs, use_cache=False).loss
        return module(**inputs, use_cache=False).loss


def run_compile_benchmark(settings: BenchSettings, backend: str = "inductor",
                          progress: Callable[[str], None] | None = None) -> CompileResult:
    """Measure every (law, batch size) for :data:`COMPILE_VARIANTS`; see the module docstring."""
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # recompile notices: counted, not printed
    say = progress or (lambda _: None)
    device = torch.device(settings.device)
    model = build_model(settings)
    high = min(settings.max_length, model.config.max_position_embeddings)
    rows: list[CompileRow] = []
    torch._dynamo.reset()
    runner = CompiledRunner(model, backend)
    try:
        for law in settings.laws:
            for batch_size in settings.batch_sizes:
                rows += _measure(runner, settings, law, batch_size, model.config.vocab_size, high, device, say)
    finally:
        runner.assembly.undo()
    environment = {"model": type(model).__name__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "padfree backend": runner.assembly.plan.backend.name}
    return CompileResult(backend if isinstance(backend, str) else getattr(backend, "__name__", "custom"), rows,
                         environment)


def _measure(runner: CompiledRunner, settings: BenchSettings, law: str, batch_size: int, vocab: int, high: int,
             device: torch.device, say: Callable[[str], None]) -> list[CompileRow]:
    batches = []
    for b in range(settings.batches):
        seed = settings.seed + 1000 * batch_size + b
        examples = make_examples(draw_lengths(law, batch_size, seed, settings.min_length, high), vocab, seed,
                                 settings.prompt_share)
        batches.append({v: runner.prepare(v, examples, device) for v in COMPILE_VARIANTS})
    real = sum(int((batch["padded+compile"]["attention_mask"]).sum()) for batch in batches)

    def one_pass(variant: str) -> tuple[float, list[float]]:
        spent, losses = 0.0, []
        for batch in batches:
            runner.model.zero_grad(set_to_none=True)
            runner.plain.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            loss = runner.loss(variant, batch[variant])
            loss.backward()
            synchronize(device)
            spent += time.perf_counter() - start
            losses.append(float(loss.detach()))
        return spent, losses

    warm, warm_reports, losses = {}, {}, {}
    graphs_before = {v: r.graphs for v, r in runner.reports.items()}
    for variant in COMPILE_VARIANTS:  # the warm-up pass: every compile happens here
        say(f"{law} bs{batch_size}: warm-up (compiling) {variant}")
        with compile_report() as seen:
            warm[variant], losses[variant] = one_pass(variant)
        warm_reports[variant] = seen
    graphs_after_warm_up = {v: r.graphs for v, r in runner.reports.items()}
    times = {v: [] for v in COMPILE_VARIANTS}
    for r in range(settings.rounds):
        shift = r % len(COMPILE_VARIANTS)
        for variant in COMPILE_VARIANTS[shift:] + COMPILE_VARIANTS[:shift]:
            times[variant].append(one_pass(variant)[0])
        say(f"{law} bs{batch_size} round {r + 1}/{settings.rounds}: "
            + ", ".join(f"{v} {real / times[v][-1]:,.0f} tok/s" for v in COMPILE_VARIANTS))
    rows = []
    for variant in COMPILE_VARIANTS:
        steady = statistics.median(times[variant])
        report, seen = runner.reports.get(variant), warm_reports[variant]
        rows.append(CompileRow(
            law=law, batch_size=batch_size, variant=variant, real_tokens=real, tokens_per_s=real / steady,
            step_ms=steady / len(batches) * 1e3,
            speedup_vs_eager=statistics.median(e / t for e, t in zip(times["padfree"], times[variant])),
            loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(losses[variant], losses["padfree"])),
            graphs=graphs_after_warm_up[variant] - graphs_before[variant] if report else 0,
            breaks=seen.break_count if report else 0,
            recompiles=report.graphs - graphs_after_warm_up[variant] if report else 0,
            compile_s=max(warm[variant] - steady, 0.0) if report else 0.0,
            break_reasons=dict(seen.breaks) if report else {}))
    return rows
