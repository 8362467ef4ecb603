"""``bench``: side-by-side benchmarks (sft, dpo, grpo, vlm, embedding, collator, batching, scale), each ratio
measured in one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.table import Table

from padfree_plugins.cli.common import JsonFlag, console, fail, positive, positive_ints, progress_lines
from padfree_plugins.errors import PadfreeError

app = typer.Typer(help="Benchmarks: side-by-side ratios measured in one run. Without a subcommand: all of "
                       "them with their defaults (the README's main job). Progress goes to stderr, a line a step "
                       "([bench sft] ...; none with --json); the results to stdout.")


#: The hybrid configs ``bench`` runs after the Llama SFT rows (shipped in ``configs/bench``): file -> title.
HYBRID_CONFIGS = {"qwen3_5_hybrid.json": "Qwen3.5-shaped: 3 gated DeltaNet layers per attention layer",
                  "granite4h_hybrid.json": "Granite-4.0-H-shaped: Mamba2 layers and one attention layer"}


def hybrid_config_dir() -> Path:
    """``configs/bench`` of the checkout this package runs from (or of the working directory)."""
    shipped = Path(__file__).resolve().parents[2] / "configs" / "bench"
    return shipped if shipped.is_dir() else Path("configs/bench")


def bench_hybrids() -> None:
    """``bench sft`` on every shipped hybrid config: bs16, lognormal law; padded, unpad and padfree timed, HF
    flattening checked."""
    for name, title in HYBRID_CONFIGS.items():
        path = hybrid_config_dir() / name
        console().rule(f"bench sft, hybrid: {title}")
        if not path.is_file():
            console().print(f"skipped: {path} is not here (run from a checkout of padfree-plugins)", highlight=False)
            continue
        shown = path.resolve().relative_to(Path.cwd()) if path.resolve().is_relative_to(Path.cwd()) else path
        bench_sft(model_config=str(shown), laws="lognormal", batch_sizes="16",
                  out=Path("out/bench-sft-hybrid") / path.stem)


#: The prompt share of ``bench``'s prompt-light DPO / GRPO runs.
PROMPT_LIGHT = 0.1


@app.callback(invoke_without_command=True)
def bench_all(ctx: typer.Context) -> None:
    """Run every benchmark with its defaults: collator, sft, sft on the hybrid configs, dpo, grpo (each also with
    prompts of 10%, where sharing them must cost nothing, and on image-text batches), vlm, embedding, batching."""
    if ctx.invoked_subcommand is not None:
        return
    for title, command in (("collator", bench_collator), ("sft (causal LM)", bench_sft),
                           ("dpo (TRL DPOTrainer)", bench_dpo), ("grpo (TRL GRPOTrainer)", bench_grpo),
                           ("vlm (image-text SFT)", bench_vlm), ("embedding and reranker", bench_embedding),
                           ("batching", bench_batching)):
        console().rule(f"bench {title}")
        command()
        if command is bench_sft:
            bench_hybrids()
        if command in (bench_dpo, bench_grpo):
            name = "dpo" if command is bench_dpo else "grpo"
            console().rule(f"bench {name}, prompt-light (prompts 10%)")
            command(prompt_share=PROMPT_LIGHT, out=Path(f"out/bench-{name}-prompt-light"))
            console().rule(f"bench {name} --vision (image-text batches)")
            command(vision=True, out=Path(f"out/bench-{name}-vision"))


@app.command("collator")
def bench_collator(
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "4,16,64",
    batches: Annotated[int, positive("Batches per round.")] = 200,
    as_json: JsonFlag = False,
) -> None:
    """Our packing collator vs transformers.DataCollatorWithFlattening on identical batches."""
    from padfree_plugins.benchmarks.collator import run_collator_benchmark

    sizes = positive_ints(batch_sizes, "--batch-sizes")
    try:
        results = [run_collator_benchmark(bs, batches, progress=progress_lines("bench collator", not as_json))
                   for bs in sizes]
    except PadfreeError as error:
        fail(error)
    if as_json:
        print(json.dumps([{**r.__dict__, "ratio": r.ratio} for r in results], indent=2))
        return
    table = Table(title="collator time per batch (lognormal lengths, median 120): ours vs HF flattening")
    for column in ("batch size", "ours ms", "HF ms", "ours / HF"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r.batch_size), f"{r.ours_ms:.3f}", f"{r.hf_ms:.3f}", f"{r.ratio:.2f}")
    stdout = console()
    stdout.print(table)


@app.command("embedding")
def bench_embedding(
    device: Annotated[str, typer.Option(help="cpu or cuda (cuda fails loudly without a GPU).")] = "cpu",
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 … (default: float32 on cpu, bfloat16 "
                                                      "on cuda).")] = None,
    workload: Annotated[Optional[list[str]], typer.Option(
        help="task:model:batch_size:median, repeatable (task embedding or reranker; model minilm, bert-base or "
             "tiny). Default: the real all-MiniLM-L6-v2 on cpu, BERT-base shapes on cuda.")] = None,
    batches: Annotated[int, positive("Timed batches per round.")] = 3,
    rounds: Annotated[int, positive("Interleaved rounds (the fastest round of each side counts).")] = 3,
    attention: Annotated[str, typer.Option(help="Attention backend of the padding-free side.")] = "auto",
    threads: Annotated[Optional[int], positive("torch intra-op threads (1 on a busy shared machine).")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Draw every workload's batches from the lengths of your "
                                                       "data: a local file or save_to_disk directory with "
                                                       "*input_ids columns, or text columns (with --tokenizer; "
                                                       "each text is one example).")] = None,
    dataset_split: Annotated[str, typer.Option(help="Split of a saved DatasetDict.")] = "train",
    tokenizer: Annotated[Optional[str], typer.Option(help="Local tokenizer directory for a --dataset of text.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Embedding and reranker training steps, padded vs padding-free, interleaved in one run."""
    from padfree_plugins.benchmarks.embedding import (
        DEFAULT_WORKLOADS,
        parse_workload,
        run_embedding_benchmark,
        with_dataset_lengths,
    )
    from padfree_plugins.benchmarks.lengths import dataset_lengths

    try:
        workloads = tuple(parse_workload(w) for w in workload) if workload else None
        if dataset is not None:
            lengths = dataset_lengths(dataset, split=dataset_split, tokenizer=tokenizer, texts="each")
            workloads = with_dataset_lengths(workloads or DEFAULT_WORKLOADS.get(device, ()), lengths)
        results = run_embedding_benchmark(workloads, device=device, dtype=dtype, batches=batches, rounds=rounds,
                                          attention=attention, threads=threads,
                                          progress=progress_lines("bench embedding", not as_json))
    except PadfreeError as error:
        fail(error)
    if as_json:
        print(json.dumps([{k: v for k, v in r.as_dict().items() if k != "losses"} for r in results], indent=2))
        return
    table = Table(title="training step (fwd + bwd), padded vs padding-free, same weights and batches; "
                        "real (non-pad) tokens/s")
    for column in ("task", "model", "batch", "padding", "padded tok/s", "padfree tok/s", "speedup", "ideal",
                   "of ideal", "padded MiB", "padfree MiB", "max |loss diff|", "max |out diff|", "backend"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.task, r.model, f"{r.batch_size} (median {r.median:g})", f"{r.padding_fraction:.0%}",
                      f"{r.padded_tokens_per_s:,.0f}", f"{r.padfree_tokens_per_s:,.0f}", f"{r.speedup:.2f}x",
                      f"{r.ideal_speedup:.2f}x", f"{r.of_ideal:.0%}", f"{r.padded_memory_mib:,.0f}",
                      f"{r.padfree_memory_mib:,.0f}", f"{r.max_loss_diff:.1e}", f"{r.max_output_diff:.1e}",
                      f"{r.backend} {r.device} {r.dtype}")
    stdout = console()
    stdout.print(table)
    if results:
        stdout.print(f"memory: {results[0].memory_kind}; ideal = 1 / (1 - padding fraction).", highlight=False)


@app.command("sft")
def bench_sft(
    device: Annotated[str, typer.Option(help="cpu, or cuda / cuda:N (fails if CUDA is missing).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    model_size: Annotated[str, typer.Option(help="tiny (4 layers, d=256), 1b (TinyLlama 1.1B shape), micro "
                                                   "(2 layers, d=64: smoke tests).")] = "tiny",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "4,16",
    laws: Annotated[Optional[str], typer.Option(help="Comma-separated length laws: lognormal (median 120, sigma "
                                                     "0.6), mix (80% median 40, 20% median 600), dataset (lengths "
                                                     "of --dataset). Default: lognormal,mix; dataset with "
                                                     "--dataset.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Measure on the lengths of your data: a local .json / "
                                                       ".jsonl / .parquet / .csv file or a save_to_disk directory "
                                                       "with input_ids (or text, with --tokenizer).")] = None,
    dataset_split: Annotated[str, typer.Option(help="Split of a saved DatasetDict.")] = "train",
    tokenizer: Annotated[Optional[str], typer.Option(help="Local tokenizer directory for a --dataset of text or "
                                                         "prompt + completion rows.")] = None,
    model_config: Annotated[Optional[str], typer.Option(help="A config.json (or a directory holding one) of any "
                                                            "supported decoder, randomly initialised, instead of "
                                                            "--model-size.")] = None,
    batches: Annotated[int, positive("Distinct batches per (law, batch size).")] = 8,
    rounds: Annotated[int, positive("Interleaved rounds; figures are medians over rounds.")] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up steps per variant.")] = 1,
    max_length: Annotated[int, positive("Longest example (lengths are clipped).")] = 2048,
    prompt_share: Annotated[float, typer.Option(help="Share of each example that is prompt (labels -100), as in "
                                                     "completion-only SFT.")] = 0.0,
    best_of: Annotated[int, positive("Best-of-N SFT: every N consecutive examples answer one prompt (--prompt-share "
                                     "of the first one's length), and padfree+shared (each prompt once, as "
                                     "prefix_sharing runs HF Trainer / SFTTrainer) is timed beside the others.")] = 1,
    peak_tflops: Annotated[Optional[float], positive("MFU denominator in TFLOP/s. Default: 790 on CUDA (as "
                                                      "gpu_anchor.py), the measured matmul rate on CPU.")] = None,
    threads: Annotated[Optional[int], positive("torch intra-op threads. Default on CPU: 1 (on a shared machine, "
                                                "OpenMP barriers on contended cores otherwise dominate small "
                                                "kernels); on CUDA: torch's choice.")] = None,
    out: Annotated[Path, typer.Option(help="Directory for bench_sft.json and bench_sft.png.")] = Path("out/bench-sft"),
    compile_: Annotated[bool, typer.Option("--compile", help="Time torch.compile instead: eager padfree vs compiled "
                                                            "padfree, compiled padded and compiled HF native, with "
                                                            "graphs, breaks, recompiles and compile seconds.")] = False,
    compile_backend: Annotated[str, typer.Option(help="torch.compile backend of --compile (inductor; aot_eager "
                                                      "traces without code generation).")] = "inductor",
    as_json: JsonFlag = False,
) -> None:
    """Causal-LM training step: padded vs HF native packing vs padfree-plugins (its collator, and unpad: the padded
    batch packed inside the model), same model and batches, one run; with --compile, compiled vs eager."""
    sizes = positive_ints(batch_sizes, "--batch-sizes")
    import torch

    from padfree_plugins.benchmarks.sft import BenchSettings, run_sft_benchmark, write_outputs

    previous_threads = torch.get_num_threads()
    if threads is not None or device == "cpu":
        torch.set_num_threads(threads or 1)
    default_laws = "dataset" if dataset else "lognormal,mix"
    settings = BenchSettings(device=device, dtype=dtype, model_size=model_size, batch_sizes=sizes,
                             laws=tuple(law.strip() for law in (laws or default_laws).split(",")),
                             batches=batches, rounds=rounds, warmup=warmup, max_length=max_length,
                             peak_tflops=peak_tflops, model_config=model_config, dataset=dataset,
                             dataset_split=dataset_split, tokenizer=tokenizer, prompt_share=prompt_share,
                             best_of=best_of)
    if compile_:
        try:
            bench_compiled(settings, compile_backend, out, as_json)
        finally:
            torch.set_num_threads(previous_threads)
        return
    stdout = console()
    try:
        result = run_sft_benchmark(settings, progress=progress_lines("bench sft", not as_json))
    except PadfreeError as error:
        fail(error)
    finally:
        torch.set_num_threads(previous_threads)
    paths = write_outputs(result, out)
    if as_json:
        print(result.to_json())
        return
    kind = result.rows[0].memory_kind if result.rows else ""
    model = model_config or f"Llama {model_size}"
    prompts = f", {prompt_share:.0%} of each example is prompt" if prompt_share else ""
    prompts += f", best of {best_of} (answers per prompt)" if best_of > 1 else ""
    table = Table(title=f"SFT step (fwd + bwd), {model}, {dtype}, {result.environment['device']}{prompts}: "
                        "real tokens/s, medians of interleaved rounds")
    notes = any(r.note for r in result.rows)
    for column in ("law", "batch", "padding", "variant", "tokens/s", "step ms", "vs padded", "of ideal",
                   "vs HF native", f"memory MiB ({kind})", "MFU", "loss rel. diff", "attention",
                   *((("HF flattening (not timed)" if any(not r.timed for r in result.rows) else "note"),)
                     if notes else ())):
        table.add_column(column, justify="right")

    def figure(value: float, form: str, unit: str = "") -> str:
        return "-" if value != value else format(value, form) + unit  # NaN: not measured for this row

    for r in result.rows:
        table.add_row(r.law, str(r.batch_size), f"{r.padding_fraction:.0%}", r.variant,
                      figure(r.tokens_per_s, ",.0f"), figure(r.step_ms, ",.1f"),
                      figure(r.speedup_vs_padded, ".2f", "x"), figure(r.of_ideal, ".0%"),
                      figure(r.speedup_vs_hf, ".2f", "x") if r.variant in ("unpad", "padfree") else "-",
                      f"{r.memory_bytes / 2**20:,.1f}" if r.timed else "-", figure(r.mfu, ".0%"),
                      "refuses" if r.note.startswith("refuses") else figure(r.loss_rel_diff, ".1e"),
                      r.backend, *((r.note,) if notes else ()))
    stdout.print(table)
    if any(r.variant == "unpad" for r in result.rows):
        stdout.print("unpad: padded's own batch given to the patched model, as a Trainer with its own compute_loss "
                     "(or TRL, or a hand-written loop) calls it; the layers run on real tokens only (packed inside "
                     "the model, every step checked), but the LM head and the loss on the padded [B, L, V] logits, "
                     "hence below padfree (logits only where a label counts).", highlight=False)
    if any(r.variant == "padfree+shared" for r in result.rows):
        stdout.print("padfree+shared: its speedup over padfree beside two ideals: the tokens padfree computes over "
                     "those shared computes, and that ratio weighted by measured cost (the LM head + loss, on the same "
                     "labelled tokens in both, timed alone after each step in the same rounds; the rest of padfree's "
                     "step per computed token).", highlight=False)
    if result.environment.get("hybrid (sequence mixers)"):
        stdout.print("hybrid model: HF flattening runs its sequence mixers across the examples of the packed row "
                     "(or refuses to), so it is checked (loss vs padded, forward only), not timed; of ideal = "
                     "speedup over 1 / (1 - padding).", highlight=False)
    stdout.print(f"environment: {result.environment}", highlight=False)
    stdout.print(f"wrote {paths['json']} and {paths['png']}", highlight=False)


def bench_compiled(settings: Any, backend: str, out: Path, as_json: bool) -> None:
    """``bench sft --compile``: run :mod:`padfree_plugins.benchmarks.compiled`, print its table, write its JSON."""
    from padfree_plugins.benchmarks.compiled import run_compile_benchmark
    from padfree_plugins.benchmarks.lengths import DATASET_LAW

    if settings.dataset is not None or DATASET_LAW in settings.laws:
        fail("--compile times the built-in length laws (lognormal, mix); drop --dataset")
    try:
        result = run_compile_benchmark(settings, backend, progress=progress_lines("bench sft --compile", not as_json))
    except PadfreeError as error:
        fail(error)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_sft_compile.json"
    path.write_text(json.dumps(result.as_dict(), indent=2))
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
    table = Table(title=f"SFT step (fwd + bwd) under torch.compile ({result.backend}), "
                        f"{settings.model_config or 'Llama ' + settings.model_size}, {settings.dtype}, "
                        f"{result.environment['device']}: real tokens/s, medians of interleaved rounds")
    for column in ("law", "batch", "variant", "tokens/s", "step ms", "vs eager padfree", "graphs", "breaks",
                   "recompiles", "compile s", "loss rel. diff"):
        table.add_column(column, justify="right")
    for r in result.rows:
        compiled = r.variant.endswith("+compile")
        table.add_row(r.law, str(r.batch_size), r.variant, f"{r.tokens_per_s:,.0f}", f"{r.step_ms:,.1f}",
                      f"{r.speedup_vs_eager:.2f}x", *((str(r.graphs), str(r.breaks), str(r.recompiles),
                                                       f"{r.compile_s:.1f}") if compiled else ("-",) * 4),
                      f"{r.loss_rel_diff:.1e}")
    stdout = console()
    stdout.print(table)
    for r in result.rows:
        for reason, count in r.break_reasons.items():
            stdout.print(f"{r.variant} {r.law} bs{r.batch_size}: {count} graph break(s): {reason}", highlight=False)
    stdout.print(f"environment: {result.environment}", highlight=False)
    stdout.print(f"wrote {path}", highlight=False)


@app.command("batching")
def bench_batching(
    examples: Annotated[int, positive("Examples per length law (balance part).")] = 20000,
    max_tokens: Annotated[int, positive("Token budget per micro-batch (balance part).")] = 4096,
    ranks: Annotated[str, typer.Option(help="Comma-separated simulated rank counts.")] = "2,8",
    laws: Annotated[str, typer.Option(help="Comma-separated length laws: lognormal (median 120, sigma 0.6), mix "
                                           "(80% median 40, 20% median 1000), dpo-pairs (a DPO pair's packed "
                                           "tokens: token budget vs pair count).")] = "lognormal,mix,dpo-pairs",
    time_steps: Annotated[int, typer.Option(help="Steps timed per batching (throughput part; 0 skips it).")] = 8,
    time_max_tokens: Annotated[int, positive("Token budget of the timed micro-batches.")] = 2048,
    time_law: Annotated[str, typer.Option(help="Length law of the timed run.")] = "lognormal",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Example-count vs token-budget batching across simulated ranks: token spread, padding, real tokens/s."""
    from padfree_plugins.benchmarks.batching import gain, run_balance, run_throughput

    rank_counts = positive_ints(ranks, "--ranks")
    say = progress_lines("bench batching", not as_json)
    try:
        balance = run_balance(tuple(laws.split(",")), rank_counts, examples, max_tokens, progress=say)
        timed = (run_throughput(time_law, rank_counts, time_steps, time_max_tokens, progress=say) if time_steps > 0
                 else [])
    except (PadfreeError, ValueError) as error:
        fail(error)
    if as_json:
        print(json.dumps({"balance": [r.__dict__ for r in balance],
                          "throughput": [{**r.__dict__, "tokens_per_s": r.tokens_per_s} for r in timed],
                          "gain": gain(timed)}, indent=2, default=float))
        return
    table = Table(title=f"rank balance per step, one epoch of {examples:,} examples (budget {max_tokens} tokens)")
    for column in ("law", "ranks", "batching", "steps", "tokens / micro-batch", "spread mean", "spread max",
                   "padding if padded", "idle (sync wait)"):
        table.add_column(column, justify="right")
    for r in balance:
        table.add_row(r.law, str(r.ranks), r.batching, str(r.steps), f"{r.tokens_per_micro_batch:,.0f}",
                      f"{r.spread_mean:.3f}", f"{r.spread_max:.3f}", f"{r.padding:.1%}", f"{r.idle:.1%}")
    stdout = console()
    stdout.print(table)
    stdout.print("spread: max / min tokens over the ranks of a step. idle: rank time spent waiting for the slowest "
                     "rank of each step.", highlight=False)
    if timed:
        gains = gain(timed)
        table = Table(title=f"tiny Llama fwd+bwd per rank, step time = slowest rank ({time_law}, {time_steps} steps)")
        for column in ("ranks", "batching", "real tokens", "spread mean", "seconds", "real tok/s", "gain"):
            table.add_column(column, justify="right")
        for r in timed:
            mark = f"{gains[r.ranks]:.2f}x" if r.batching.startswith("tokens") and r.ranks in gains else ""
            table.add_row(str(r.ranks), r.batching, f"{r.real_tokens:,}", f"{r.spread_mean:.3f}",
                          f"{r.seconds:.2f}", f"{r.tokens_per_s:,.0f}", mark)
        stdout.print(table)


def preference_command(trainer: str) -> Callable[..., None]:
    """The ``bench dpo`` / ``bench grpo`` command: TRL padded vs the generic path vs the native plugin."""

    def command(
        quick: Annotated[bool, typer.Option("--quick", help="Seconds, not minutes: the micro model (or "
                                                            "--model-config's), one batch, one round (a smoke run; "
                                                            "its speeds mean little).")] = False,
        model_size: Annotated[str, typer.Option(help="tiny (4 layers, d=256, vocab 4096), micro (2 layers, d=64), "
                                                     "1b (TinyLlama 1.1B shape: slow on CPU).")] = "tiny",
        dtype: Annotated[str, typer.Option(help="float32, or float64: the transformer body exact to ~1e-16, which "
                                                "shows what of a loss difference is float32 rounding (TRL's fused "
                                                "head computes in float32 either way).")] = "float32",
        batch_size: Annotated[Optional[int], positive("DPO: preference pairs per batch (2 padded rows each; "
                                                       "default 8). GRPO: completions per batch, 8 per prompt "
                                                       "(default 16).")] = None,
        batches: Annotated[int, positive("Distinct batches.")] = 3,
        rounds: Annotated[int, positive("Interleaved timed rounds; figures are medians over rounds.")] = 3,
        seed: Annotated[int, typer.Option(help="Seed of the weights, the lengths and the tokens.")] = 0,
        threads: Annotated[int, positive("torch intra-op threads (1: on a shared machine, OpenMP barriers on "
                                         "contended cores otherwise dominate small kernels).")] = 1,
        prompt_share: Annotated[Optional[float], typer.Option(
            min=0.01, max=0.95, help="Share of each sequence that is prompt (default: DPO 0.6, GRPO 0.75); the "
                                     "shared variant holds each prompt once.")] = None,
        model_config: Annotated[Optional[str], typer.Option(
            help="A config.json (or a directory holding one) of any supported decoder, randomly initialised, instead "
                 "of --model-size (as bench sft's): configs/bench/qwen3_5_hybrid.json, granite4h_hybrid.json.")
        ] = None,
        law: Annotated[str, typer.Option(
            help="GRPO's batches: lognormal (each group of 8 completions under a prompt of its own) or tree (one "
                 "multi-turn episode per batch: turn 1, 2 alternatives at turns 2 and 3, the completions spread "
                 "over the 4 prompts; shared held to 85% of its ideal, the ideal of sharing whole prompts "
                 "only beside it).")] = "lognormal",
        vision: Annotated[bool, typer.Option(
            "--vision", help="Image-text batches on a Qwen2.5-VL-shaped model (prompts with 0-2 images of 16-96 "
                             "visual tokens; GRPO 1-2): TRL padded vs packed, real tokens/s and activation memory "
                             "(targets 2x and 0.5x). --model-size, --dtype and --prompt-share do not apply.")] = False,
        out: Annotated[Optional[Path], typer.Option(
            help="Directory for bench_dpo.json and bench_dpo.md (grpo: bench_grpo.*; --vision: "
                 "bench_dpo_vision.*). Default out/bench-dpo (out/bench-grpo, out/bench-dpo-vision …).")] = None,
        as_json: JsonFlag = False,
    ) -> None:
        if vision:
            vision_command(trainer, quick, batch_size, batches, rounds, seed, threads, out, as_json)
            return
        from padfree_plugins.benchmarks.preference import (
            COLUMNS,
            TARGETS,
            TREE_OF_IDEAL,
            PreferenceSettings,
            cells,
            run_preference_benchmark,
            shared_memory_target,
            shared_target,
            title,
            write_outputs,
        )

        settings = PreferenceSettings(trainer=trainer, model_size="micro" if quick else model_size, dtype=dtype,
                                      batch_size=batch_size, batches=1 if quick else batches,
                                      rounds=1 if quick else rounds, seed=seed, threads=threads,
                                      prompt_share=prompt_share, model_config=model_config, law=law)
        stdout = console()
        try:
            result = run_preference_benchmark(settings, progress=progress_lines(f"bench {trainer}", not as_json))
        except PadfreeError as error:
            fail(error)
        paths = write_outputs(result, out or Path(f"out/bench-{trainer}"))
        if as_json:
            print(result.to_json())
            return
        shared = next(row for row in result.rows if row.variant == "shared")
        speed_target = (f"{shared.shared_target:.2f}x ({TREE_OF_IDEAL:.0%} of its ideal)" if law == "tree"
                        else f"{shared_target(settings)}x")
        table = Table(title=title(result))
        for column in COLUMNS:
            table.add_column(column, justify="right")
        for row in result.rows:
            table.add_row(*cells(row))
        stdout.print(table)
        stdout.print(f"targets: real tokens/s over padded >= {TARGETS['of_ideal']:.0%} of the ideal 1 / (1 - padding) "
                     f"(speed), activation memory <= {TARGETS['memory_ratio']}x padded (memory), loss diff <= "
                     f"{TARGETS['loss_diff']:g} relative and absolute (loss). generic: the padded batch packed inside "
                     "the policy's body only, TRL's fused head then run on the padded hidden states (on CPU at every "
                     "position), and DPO's reference forward padded (any_trainer patches the trainer's model only). "
                     "native: every example whole in the packed row; shared: each prompt once (a tree: each common "
                     f"turn once), held to real tokens/s >= {speed_target} native's (vs native; ideal: the tokens "
                     "native computes / those shared computes, counted on the packed rows), activation memory <= "
                     f"{shared_memory_target(settings):g}x native's.", highlight=False)
        stdout.print(f"environment: {result.environment}", highlight=False)
        stdout.print(f"wrote {paths['json']} and {paths['markdown']}", highlight=False)

    command.__doc__ = (f"TRL {'DPOTrainer' if trainer == 'dpo' else 'GRPOTrainer'} compute_loss + backward: padded "
                       f"vs the generic path (plugin trl_{trainer} blocked) vs the native plugin, same batches, one "
                       "run.")
    return command


def vision_command(trainer: str, quick: bool, batch_size: int | None, batches: int, rounds: int, seed: int,
                   threads: int, out: Path | None, as_json: bool) -> None:
    """``bench dpo --vision`` / ``bench grpo --vision``."""
    from padfree_plugins.benchmarks.vision_preference import (
        QUICK,
        VisionPreferenceSettings,
        markdown,
        run_vision_preference_benchmark,
        write_outputs,
    )

    settings = VisionPreferenceSettings(trainer=trainer, batch_size=batch_size, batches=batches, rounds=rounds,
                                        seed=seed, threads=threads)
    if quick:
        settings = VisionPreferenceSettings(**{**vars(settings), **QUICK, "batch_size": batch_size})
    try:
        result = run_vision_preference_benchmark(settings, progress=progress_lines(f"bench {trainer} --vision",
                                                                                   not as_json))
    except PadfreeError as error:
        fail(error)
    paths = write_outputs(result, out or Path(f"out/bench-{trainer}-vision"))
    if as_json:
        print(result.to_json())
        return
    console().print(markdown(result), highlight=False)
    console().print(f"wrote {paths['json']} and {paths['markdown']}", highlight=False)


bench_dpo = app.command("dpo")(preference_command("dpo"))
bench_grpo = app.command("grpo")(preference_command("grpo"))


@app.command("vlm")
def bench_vlm(
    quick: Annotated[bool, typer.Option(help="A tiny size (the test suite's): 1 batch of 4, one round.")] = False,
    batch_size: Annotated[int, positive("Image-text examples per batch.")] = 16,
    batches: Annotated[int, positive("Distinct batches.")] = 3,
    rounds: Annotated[int, positive("Interleaved timed rounds; figures are medians over rounds.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the weights, the lengths, the tokens and the images.")] = 0,
    threads: Annotated[int, positive("torch intra-op threads.")] = 1,
    out: Annotated[Optional[Path], typer.Option(help="Directory for bench_vlm.json and bench_vlm.md.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Vision-language SFT steps (a tiny Qwen2.5-VL-shaped model, synthetic images of mixed sizes, lognormal text
    lengths): padded vs padding-free, same batches and weights, one run."""
    import dataclasses

    from padfree_plugins.benchmarks.vlm import QUICK, VLMSettings, markdown, run_vlm_benchmark, write_outputs

    settings = VLMSettings(batch_size=batch_size, batches=batches, rounds=rounds, seed=seed, threads=threads)
    if quick:
        settings = dataclasses.replace(settings, **QUICK)
    try:
        result = run_vlm_benchmark(settings, progress=progress_lines("bench vlm", not as_json))
    except PadfreeError as error:
        fail(error)
    paths = write_outputs(result, out or Path("out/bench-vlm"))
    if as_json:
        print(result.to_json())
        return
    stdout = console()
    stdout.print(markdown(result), highlight=False)
    stdout.print("target: padding-free real tokens/s >= 85% of the ideal 1 / (1 - padding) over padded; loss diff "
                 "<= 1e-6. The vision tower computes every image in both variants (it has no padding to drop), and "
                 "the ideal counts the text rows' padding only.", highlight=False)
    stdout.print(f"wrote {paths['json']} and {paths['markdown']}", highlight=False)


@app.command("scale")
def bench_scale(
    tokens: Annotated[int, positive("Tokens of the packed row (even).")] = 16384,
    quick: Annotated[bool, typer.Option(help="The test suite's size: a row of 1024 tokens, no warm-up, one "
                                             "round (seconds, not minutes; its speeds mean little).")] = False,
    models: Annotated[str, typer.Option(help="Comma-separated: llama, qwen3_5_text, granite4h (a Mamba2 "
                                             "hybrid).")] = "llama,qwen3_5_text",
    variants: Annotated[str, typer.Option(help="Comma-separated: ddp (always), fsdp2, sp<N> (hybrids: mixers "
                                               "split), sp<N>-allgather (causal work balanced), "
                                               "sp<N>-allgather-contiguous (not balanced), sp<N>-gather (mixers on "
                                               "the whole row); empty: ddp, fsdp2, sp<N> (and both all-gather ones "
                                               "with --allgather).")] = "",
    rounds: Annotated[int, positive("Interleaved timed rounds; figures are medians over rounds.")] = 2,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up steps per variant.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the lengths, the tokens and the weights.")] = 0,
    threads: Annotated[int, positive("torch intra-op threads per process.")] = 1,
    timeout: Annotated[float, positive("Seconds before the processes are killed.")] = 1800.0,
    world: Annotated[int, positive("Processes (and sequence-parallel group size): 2, or more.")] = 2,
    allgather: Annotated[bool, typer.Option(help="Also run sequence parallelism with all-gather attention "
                                                 "(sequence_parallel.attention: allgather), balanced and "
                                                 "not.")] = False,
    steps: Annotated[str, typer.Option(help="Comma-separated: sft (the row's causal-LM loss), dpo, grpo (a TRL "
                                            "DPO / GRPO step on a group of pairs / completions totalling --tokens; "
                                            "variants ddp and sp<N>).")] = "sft",
    out: Annotated[Path, typer.Option(help="Directory for bench_scale.json.")] = Path("out/bench-scale"),
    as_json: JsonFlag = False,
) -> None:
    """One long packed row on 2 CPU processes (gloo; --world N): sequence parallelism SP=N vs SP=1 (DDP), and FSDP2
    vs DDP (--allgather: all-gather attention too); peak memory per rank, real tokens/s and SP's communication per
    layer, one run."""
    import dataclasses

    from padfree_plugins.benchmarks.scale import (
        COLUMNS,
        MEMORY_NOTE,
        MEMORY_TARGETS,
        QUICK,
        STEP_TITLES,
        TITLES,
        ScaleSettings,
        cells,
        communication_line,
        run_scale_benchmark,
        write_outputs,
    )

    settings = ScaleSettings(tokens=tokens, models=tuple(m.strip() for m in models.split(",")), rounds=rounds,
                             warmup=warmup, seed=seed, threads=threads, timeout=timeout, world=world,
                             allgather=allgather, chosen=tuple(v.strip() for v in variants.split(",") if v.strip()),
                             steps=tuple(s.strip() for s in steps.split(",") if s.strip()))
    if quick:
        settings = dataclasses.replace(settings, **QUICK)
    try:
        result = run_scale_benchmark(settings, progress=progress_lines("bench scale", not as_json))
    except PadfreeError as error:
        fail(error)
    path = write_outputs(result, out)
    if as_json:
        print(result.to_json())
        return
    stdout = console()
    for model, step in [(model, step) for model in settings.models for step in settings.steps]:
        what = ("one row" if step == "sft" else
                f"a TRL {step.upper()} step on a group ({STEP_TITLES[step]}) of")
        table = Table(title=f"{TITLES[model]}: {what} {settings.tokens:,} tokens per step and SP group, fwd + "
                            f"bwd, {settings.world} CPU processes (gloo)")
        for column in COLUMNS:
            table.add_column(column, justify="right")
        for row in result.rows:
            if row.model == model and row.step == step:
                table.add_row(*cells(row))
        stdout.print(table)
    for model, volume in result.communication.items():
        line = communication_line(model, volume, settings.tokens, settings.world, settings.allgather)
        stdout.print(f"SP={settings.world} communication, {line}", highlight=False)
    stdout.print(f"{MEMORY_NOTE} real tok/s: the tokens of all rows of a step (ddp, fsdp2: one row per rank; "
                 f"sp{settings.world}: one row for all) over the slowest rank's step time. Targets: peak memory per rank at "
                 + ", ".join(f"SP={n} <= {t}x" for n, t in MEMORY_TARGETS.items())
                 + " ddp's, every model (the hybrids' mixers split; none for the DPO / GRPO steps' rows). On CPU the "
                 "exchanges cost time: no speed target.", highlight=False)
    stdout.print(f"environment: {result.environment}", highlight=False)
    stdout.print(f"wrote {path}", highlight=False)


@app.command("longctx")
def bench_longctx(
    shapes: Annotated[str, typer.Option(help="Comma-separated: llama, qwen3_5 (scaled down with Llama-8B's ratios: "
                                             "intermediate 3.5x hidden, vocabulary 31x hidden).")] = "llama,qwen3_5",
    lengths: Annotated[str, typer.Option(help="Comma-separated row lengths in tokens.")] = "4096,8192,16384,32768,65536",
    hidden: Annotated[int, positive("Hidden size of the scaled-down models (heads of 64).")] = 256,
    layers: Annotated[int, positive("Decoder layers.")] = 4,
    example_tokens: Annotated[int, positive("Tokens of each example packed into a row.")] = 4096,
    device: Annotated[str, typer.Option(help="auto (cuda when available), cpu or cuda.")] = "auto",
    budget_gib: Annotated[float, typer.Option(help="Activation budget for the longest-row estimate, GiB.")] = 4.0,
    threads: Annotated[int, positive("torch intra-op threads per process.")] = 1,
    steps: Annotated[int, positive("Training steps per measurement; memory and tokens/s are the last step's (1: the "
                                   "first step, warm-up included).")] = 2,
    variants: Annotated[str, typer.Option(help="Comma-separated variants to measure: checkpointing, mlp (+ tiled "
                                               "MLP), loss (+ tiled loss), mixers (+ tiled mixers, shapes with "
                                               "sequence mixers); all by default.")] = "all",
    rounds: Annotated[int, positive("Rounds of every measurement, interleaved; tokens/s: the medians, the ratio to "
                                    "checkpointing alone: the median of each round's.")] = 1,
    out: Annotated[Path, typer.Option(help="Directory for bench_longctx.json.")] = Path("out/bench-longctx"),
    as_json: JsonFlag = False,
) -> None:
    """Peak activation memory and real tokens/s of a checkpointed training step against the row's length:
    checkpointing alone, + tiled MLP, + tiled LM head and loss (memory.tile_tokens: auto); each in its own process."""
    from padfree_plugins.benchmarks.longctx import TITLES, LongContextSettings, run_longctx_benchmark

    if device == "auto":
        device = "cuda" if torch_cuda() else "cpu"
    settings = LongContextSettings(shapes=tuple(s.strip() for s in shapes.split(",")),
                                   lengths=positive_ints(lengths, "--lengths"), hidden=hidden, layers=layers,
                                   example_tokens=example_tokens, device=device, budget_gib=budget_gib,
                                   threads=threads, steps=steps, variants=longctx_variants(variants),
                                   rounds=rounds)
    try:
        result = run_longctx_benchmark(settings, progress=progress_lines("bench longctx", not as_json))
    except (PadfreeError, RuntimeError) as error:
        fail(error)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_longctx.json").write_text(result.to_json(), encoding="utf-8")
    if as_json:
        print(result.to_json())
        return
    stdout = console()
    for shape in settings.shapes:
        table = Table(title=f"{TITLES[shape]}, hidden {hidden}, {layers} layers, examples of {example_tokens:,} "
                            f"tokens, step {steps} of {steps}, {device}, {threads} thread(s), {rounds} round(s)")
        for column in ("tokens", "variant", "peak activations MiB", "real tok/s", "tok/CPU-s", "load avg"):
            table.add_column(column, justify="right")
        for row in result.rows:
            if row.shape == shape:
                table.add_row(f"{row.tokens:,}", row.variant, f"{row.peak_bytes / 2 ** 20:,.0f}",
                              f"{row.tokens_per_s:,.0f}", f"{row.tokens_per_cpu_s:,.0f}", f"{row.load:.1f}")
        stdout.print(table)
        for line in result.summary(shape):
            stdout.print(line, highlight=False)


def longctx_variants(names: str) -> tuple[str, ...]:
    """``--variants`` of ``bench longctx`` as the benchmark's variant names (empty: all)."""
    known = {"checkpointing": "checkpointing", "mlp": "+ tiled MLP", "loss": "+ tiled loss", "mixers": "+ tiled mixers"}
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    if chosen == ["all"]:
        return ()
    if unknown := [name for name in chosen if name not in known]:
        fail(f"--variants: unknown {', '.join(unknown)}; use all or some of {', '.join(known)}")
    return tuple(known[name] for name in chosen)


def torch_cuda() -> bool:
    """Whether CUDA is available (torch imported only when the bench command's defaults are built)."""
    import torch

    return torch.cuda.is_available()
