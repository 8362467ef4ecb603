"""SFT benchmark: padded vs HF native packing vs padfree-plugins, same model, same batches, one run.

Four ways to run a causal-LM training step (forward + backward of the loss) on the same examples:

* ``padded``: right-padded ``[n, L_max]`` batch with ``attention_mask``, labels -100 on padding, sdpa attention;
* ``hf_native``: ``transformers.DataCollatorWithFlattening`` (one ``[1, T]`` row, ``position_ids`` restarting per
  example) on the unpatched sdpa model with ``use_cache=False``, so that transformers' own packed-sequence mask is
  used (a block-diagonal ``[T, T]`` mask for sdpa);
* ``padfree``: :func:`~padfree_plugins.assemble` with its collator, ``cu_seq_lens`` computed once, attention
  backend ``auto`` (``exact`` on CPU, ``varlen`` / ``flash_attn`` on CUDA in 16-bit), and — as ``accelerate``
  runs HF ``Trainer`` — logits only for positions whose next token has a label
  (:func:`~padfree_plugins.builtin.tasks.causal_lm.keep_labelled_logits`);
* ``unpad``: the ``padded`` variant's very batch (right-padded, ``attention_mask``, labels -100 on padding) given to
  the model as :func:`~padfree_plugins.assemble` patched it for ``padfree``, called as the model's own forward —
  what a ``Trainer`` subclass with its own ``compute_loss``, TRL or a hand-written loop does (the generic path).
  :mod:`~padfree_plugins.modeling.unpad` packs the real tokens at the entry of the base model and scatters its
  output back to ``[B, L, hidden]``: the layers run on real tokens only, but the LM head and the cross-entropy still
  run on the padded ``[B, L, V]`` logits, which is why it lands between ``padded`` and ``padfree``. Every ``unpad``
  step checks that its forward really was packed (:class:`UnpadRefused` otherwise; a batch without a pad, which
  has nothing to unpad, is the one exception), so the row cannot be a padded run in disguise.

``prompt_share`` masks the first share of every example's labels (completion-only SFT) in all variants.
``best_of`` (N > 1): best-of-N SFT, every N consecutive examples of a batch answer one prompt (``prompt_share`` of
their mean drawn length; each answer the rest of its example's drawn length, at least one token); a fifth
variant, ``padfree+shared``, packs them with each prompt once (HF Trainer's / SFTTrainer's ``prefix_sharing``:
:func:`~padfree_plugins.packing.prefixes.share_unlabelled`). It counts the same real tokens (every example whole);
its row gives its speedup over ``padfree`` beside two ideals. The *token ideal* (``ideal_vs_padfree``): the tokens
``padfree`` computes over those the shared row computes. The *cost-weighted ideal* (``weighted_ideal_vs_padfree``):
the LM head and the loss run on the same labelled answer tokens in both variants, which sharing cannot save, so after
each timed step of ``padfree`` and of ``padfree+shared`` (outside its time, in the same rounds) the LM head's call of
that step is run again alone on its inputs, forward and backward through the model's own loss on the step's
``shift_labels`` (:func:`~padfree_plugins.benchmarks.measure.seconds_alone`, as ``bench grpo --vision`` times its
vision tower). Per round, a labelled position then costs ``padfree``'s head-and-loss time over its labelled positions
and a computed token the rest of ``padfree``'s step over its computed tokens; the ideal is ``padfree``'s time over
what the shared row's tokens and labelled positions cost at those rates
(:func:`~padfree_plugins.benchmarks.measure.cost_weighted_ideal`), the median over rounds. The labelled positions
being the same in both, it lies between 1 and the token ideal. ``head_loss_ms``: the head and loss alone per step.

Batches are collated and moved to the device beforehand (collator speed is ``bench collator``'s job); each timed
step is the model's forward + backward, gradients cleared in between, no optimizer step (so every variant sees
the same weights and the losses can be compared). Variants are interleaved — every batch runs all of them, in an
order that rotates each round — so that machine noise hits them alike; figures are medians over rounds, and ratios
are taken within a round before the median.

Reported per (length law, batch size, variant): real (non-pad) tokens/s, step time, memory, loss parity (largest
relative loss difference from ``padded`` over the batches), padding share of the padded batch, the speedup over
``padded`` and its share of the ideal ``1 / (1 - padding share)`` (``of_ideal``), and MFU.

MFU counts ``6 × N`` FLOPs per real token (forward + backward, attention left out), ``N`` being the parameters
that multiply: all of them except the input embedding table (a lookup), unless it is tied to the LM head.
The reference GPU harness that ``scripts/gpu_check.sh`` can run beside this one counts every parameter, which reads
~6% higher on the 1.1B shape. The peak: on CUDA ``--peak-tflops`` (default 790, for an H100 / H200 in bf16); on CPU
the fp32 matrix-multiply rate measured on the spot at the benchmark's thread count, so that the figure says how
close a step runs to what this CPU's matmuls can do.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` during the timed steps (weights + gradients + activations +
transients). On CPU there is no allocator counter (RSS keeps freed memory, ``tracemalloc`` does not see torch), so
the figure is the activation memory a step keeps for backward: the bytes of every distinct tensor storage saved by
autograd during the forward (``torch.autograd.graph.saved_tensors_hooks``), measured on one untimed step. It is
the part padding inflates; weights and gradients are the same for all variants.

Threads: on CPU, ``padfree-plugins bench sft`` runs with one intra-op thread unless ``--threads`` says otherwise.
On a shared machine, OpenMP barriers across contended cores cost milliseconds per parallel region and then
dominate every small kernel, so the comparison would measure the scheduler (and punish the variant with more,
smaller kernels: per-example attention). The thread count and the load average are reported with the results.

Hybrid models (attention beside sequence mixers: gated DeltaNet, Mamba2, Mamba1, KDA; see
:mod:`padfree_plugins.modeling.mixers`) have no valid ``hf_native`` baseline: transformers' flattening restarts
the positions (and hands attention the boundaries) but its mixers, on their torch code, either run straight across
the examples of the packed row (the state of one example flows into the next) or refuse the boundaries they cannot
honour without the CUDA packages. For them ``hf_native`` is not timed; it is a check, run once per batch
(forward only): the loss relative difference from ``padded``, or ``refuses`` with the model's error, for two
flavours of the collator — :data:`HF_FLATTENING` ``hf_native`` (``position_ids``, as timed for other models) and
``hf_native+cu_seq_lens`` (``return_flash_attn_kwargs=True``, what flash-attention users pass). The timed variants
are ``padded``, ``unpad`` and ``padfree``; ``of_ideal`` says how close each comes to the ideal speedup
``1 / (1 - padding fraction)``. ``configs/bench`` ships a tiny Qwen3.5-shaped and a tiny Granite-4.0-H-shaped
config, which ``padfree-plugins bench`` (``make bench``) runs at bs16 on the lognormal law.

Length laws: ``lognormal`` and ``mix`` (:data:`~padfree_plugins.benchmarks.lengths.SFT_LAWS`, every law in
:mod:`padfree_plugins.benchmarks.lengths`). Your own data: ``dataset`` (a local file or ``save_to_disk``
directory) gives the law ``"dataset"``, whose batches are drawn at random from the dataset's example lengths;
``model_config`` times any supported decoder's shape.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from padfree_plugins.benchmarks.lengths import DATASET_LAW, dataset_lengths, draw_lengths, sample_lengths
from padfree_plugins.benchmarks.measure import (
    calls_seen,
    cost_weighted_ideal,
    saved_activation_bytes,
    seconds_alone,
    synchronize,
)
from padfree_plugins.errors import PadfreeError
from padfree_plugins.modeling.mixers import PackedMixer, mixer_chunk
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from padfree_plugins.packing.padded import pad_examples
from padfree_plugins.packing.prefixes import on_device, share_unlabelled

VARIANTS = ("padded", "hf_native", "unpad", "padfree")
#: The variants timed for a hybrid model (see the module docstring) and the HF flattening checks reported beside them.
HYBRID_VARIANTS = ("padded", "unpad", "padfree")
#: Variants that run on the model as :func:`~padfree_plugins.assemble` patched it (the others on the unpatched one).
PATCHED_VARIANTS = ("unpad", "padfree", "padfree+shared")
#: The variant of ``best_of`` batches that shares each prompt once.
SHARED_VARIANT = "padfree+shared"
#: ``DataCollatorWithFlattening`` options of each HF flattening flavour (``hf_native`` is the timed baseline of
#: models without sequence mixers; for hybrids both are loss checks).
HF_FLATTENING = {"hf_native": dict(return_position_ids=True),
                 "hf_native+cu_seq_lens": dict(return_position_ids=True, return_flash_attn_kwargs=True)}
#: A loss relative difference from ``padded`` above this is examples mixed, not float32 rounding (which is ~1e-7).
MIXING_THRESHOLD = 1e-5
MODEL_SIZES = {
    # smoke tests
    "micro": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
    # CPU default: 4 layers, d=256, GQA 8 / 2
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048),
    # TinyLlama 1.1B shape (the GPU run; scripts/gpu_check.sh runs it beside a reference harness you pass in)
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
}


@dataclass
class BenchSettings:
    device: str = "cpu"
    dtype: str = "float32"
    model_size: str = "tiny"
    batch_sizes: tuple[int, ...] = (4, 16)
    laws: tuple[str, ...] = ("lognormal", "mix")
    batches: int = 8
    rounds: int = 3
    warmup: int = 1
    seed: int = 0
    min_length: int = 8
    max_length: int = 2048
    peak_tflops: float | None = None  # MFU denominator; None: 790 on CUDA, the measured matmul rate on CPU
    model_config: str | None = None  # a config.json (any supported decoder) instead of model_size
    dataset: str | None = None  # lengths of the law "dataset" come from this local dataset
    dataset_split: str = "train"
    tokenizer: str | None = None  # local tokenizer for a dataset of text / prompt + completion rows
    prompt_share: float = 0.0  # share of each example whose labels are -100 (completion-only SFT)
    best_of: int = 1  # N > 1: every N consecutive examples answer one prompt, and padfree+shared is timed


@dataclass
class BenchRow:
    law: str
    batch_size: int
    variant: str
    real_tokens: int
    padding_fraction: float
    tokens_per_s: float
    step_ms: float
    memory_bytes: int
    memory_kind: str
    loss_rel_diff: float
    speedup_vs_padded: float = 1.0
    speedup_vs_hf: float = float("nan")
    backend: str = ""
    mfu: float = float("nan")
    of_ideal: float = float("nan")  # speedup_vs_padded over the ideal 1 / (1 - padding_fraction)
    # best-of-N (see the module docstring): on padfree+shared, its speedup over padfree, the token ideal and the
    # cost-weighted ideal; on padfree and padfree+shared, the LM head + loss timed alone (ms per step, median)
    speedup_vs_padfree: float = float("nan")
    ideal_vs_padfree: float = float("nan")
    weighted_ideal_vs_padfree: float = float("nan")
    head_loss_ms: float = float("nan")
    timed: bool = True  # False: an HF flattening check on a hybrid model (loss only; no speed, no memory)
    note: str = ""  # for a check: "mixes examples", "matches padded" or "refuses: <the model's error>"


@dataclass
class BenchResult:
    settings: BenchSettings
    rows: list[BenchRow]
    environment: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"settings": asdict(self.settings), "environment": self.environment,
                           "rows": [asdict(r) for r in self.rows]}, indent=2)


# -- data -------------------------------------------------------------------------------------------------------


def make_examples(lengths: list[int], vocab: int, seed: int, prompt_share: float = 0.0, best_of: int = 1
                  ) -> list[dict]:
    """Random token ids; the first ``prompt_share`` of each example is a prompt (labels -100, no loss). ``best_of``
    > 1: every ``best_of`` consecutive examples share one prompt (``prompt_share`` of their mean drawn length), each
    followed by an answer of its own (the rest of its drawn length, at least one token): prompts stay about
    ``prompt_share`` of the tokens."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    prompt: list[int] = []
    for index, n in enumerate(lengths):
        if best_of > 1:
            if index % best_of == 0:
                group = lengths[index:index + best_of]
                prompt = torch.randint(3, vocab, (round(prompt_share * sum(group) / len(group)),),
                                       generator=generator).tolist()
            answer = torch.randint(3, vocab, (max(1, round((1 - prompt_share) * n)),), generator=generator).tolist()
            out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
            continue
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        prompt_length = round(prompt_share * n)
        out.append({"input_ids": ids, "labels": [-100] * prompt_length + ids[prompt_length:]})
    return out


def build_model(settings: BenchSettings) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if settings.model_config is not None:
        from padfree_plugins.config.model_configs import load_model_config

        config = load_model_config(settings.model_config, "--model-config")
        config.use_cache = False
    elif settings.model_size not in MODEL_SIZES:
        raise PadfreeError(f"unknown model size {settings.model_size!r}; choose from {', '.join(MODEL_SIZES)}")
    else:
        config = LlamaConfig(**MODEL_SIZES[settings.model_size], use_cache=False)
    torch.manual_seed(settings.seed)
    dtype = getattr(torch, settings.dtype)
    with torch.device(settings.device):  # initialise on the device: a 1.1B model initialises in seconds on a GPU
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        except ValueError as error:  # not a causal LM (an encoder config), or no sdpa for it
            raise PadfreeError(f"cannot build a causal LM with sdpa attention from {config.model_type!r}: "
                               f"{str(error).splitlines()[0]}") from error
    return model.to(settings.device).train()


#: MFU peak on CUDA when none is given: bf16 on an H100 / H200 (the figure of the reference GPU harness).
CUDA_PEAK_TFLOPS = 790.0


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, size: int = 1024, repeats: int = 8) -> float:
    """The rate of one square ``size``-matrix multiply in ``dtype`` on ``device``, measured now (FLOP/s)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters that take part in matrix multiplies: all but an input embedding that is not the LM head."""
    total = sum(p.numel() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embedding is head else total - embedding.numel()


def peak_flops(settings: BenchSettings, device: torch.device) -> tuple[float, str]:
    """The MFU denominator and where it comes from."""
    if settings.peak_tflops is not None:
        return settings.peak_tflops * 1e12, "given"
    if device.type == "cuda":
        return CUDA_PEAK_TFLOPS * 1e12, "default for H100 / H200 bf16, as gpu_anchor.py"
    return matmul_flops_per_s(device, getattr(torch, settings.dtype)), f"measured {settings.dtype} matmul rate here"


class UnpadRefused(PadfreeError):
    """An ``unpad`` step whose padded forward was not packed inside the model: its row would time a padded run."""


class Runner:
    """Runs one variant's training step on prepared inputs; ``padfree`` and ``unpad`` patch the model only around
    their steps."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        from transformers import DataCollatorWithFlattening

        from padfree_plugins.assembly import assemble
        from padfree_plugins.contract.host import PluginHost

        self.model, self.device = model, device
        self.host = PluginHost()
        self.flatten = {name: DataCollatorWithFlattening(**options) for name, options in HF_FLATTENING.items()}
        assembly = assemble(model, {"task": "causal_lm"}, host=self.host)
        self.collator, self.forward, self.backend = assembly.collator, assembly.forward, assembly.plan.backend.name
        #: whether padfree-plugins routes sequence mixers of this model (a hybrid: HF flattening is no baseline)
        self.hybrid = any(isinstance(vars(module).get("forward"), PackedMixer) for module in model.modules())
        self.chunk = mixer_chunk(model)  # a shared prefix must save its mixers' chunks
        assembly.undo()
        self.assembly = None
        self.timed = HYBRID_VARIANTS if self.hybrid else VARIANTS
        self.checks = tuple(HF_FLATTENING) if self.hybrid else ()
        #: per forward of the patched base model since the last ``unpad`` step began: whether unpad packed it
        self.packed: list[bool] = []
        #: ``unpad`` steps packed inside the model; those on a batch without a pad (nothing to unpad: unpad runs it
        #: as the model's own code). Any other ``unpad`` step raises :class:`UnpadRefused`.
        self.unpad_steps = 0
        self.unpad_steps_without_pads = 0

    def prepare(self, variant: str, examples: list[dict]) -> dict:
        if variant in ("padded", "unpad"):  # unpad: the padded batch itself, as any Trainer's collator pads it
            inputs = pad_examples(examples, ("input_ids", "labels"))
        elif variant in self.flatten:
            inputs = dict(self.flatten[variant](examples))
        elif variant == SHARED_VARIANT:  # as HF Trainer / SFTTrainer run it with prefix_sharing
            inputs = keep_labelled_logits(share_unlabelled(self.collator(examples), self.chunk))
        else:  # as HF Trainer runs it: logits only where a label counts
            inputs = keep_labelled_logits(self.collator(examples))
        return on_device({k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
                         self.device)

    def enter(self, variant: str) -> None:
        from padfree_plugins.assembly import assemble

        if variant in PATCHED_VARIANTS and self.assembly is None:
            self.assembly = assemble(self.model, {"task": "causal_lm"}, host=self.host)
            self._watch_unpad(self.assembly)
        elif variant not in PATCHED_VARIANTS and self.assembly is not None:
            self.assembly.undo()
            self.assembly = None

    def _watch_unpad(self, assembly: Any) -> None:
        """Record, at each forward of the base model, whether unpad packed it: a pre-hook that runs after unpad's
        own (which is prepended and leaves the call's ``Unpadded``, or ``None``, in ``calls``); taken off with the
        assembly."""
        from padfree_plugins.modeling.unpad import UnpadPatch

        patch = next((h for h in assembly.patch.handles if isinstance(h, UnpadPatch)), None)
        if patch is None:
            return
        packed = self.packed

        def seen(module: Any, args: tuple, kwargs: dict) -> None:
            packed.append(bool(patch.calls) and patch.calls[-1] is not None)

        assembly.patch.handles.append(patch.base.register_forward_pre_hook(seen, with_kwargs=True))

    def loss(self, variant: str, inputs: dict) -> torch.Tensor:
        if variant in ("padfree", SHARED_VARIANT):
            return self.forward(self.model, inputs, use_cache=False).loss
        if variant != "unpad":
            return self.model(**inputs, use_cache=False).loss
        self.packed.clear()
        loss = self.model(**inputs, use_cache=False).loss
        if self.packed and all(self.packed):
            self.unpad_steps += 1
        elif not self.packed or bool((inputs["attention_mask"] == 0).any()):  # read only off the packed path
            raise UnpadRefused(f"the unpad variant's padded forward was not packed inside the model (packed: "
                               f"{self.packed or 'no unpad patch'}); its row would time a padded run")
        else:  # a batch without a pad: unpad leaves it to the model's own code, the same as padding-free
            self.unpad_steps_without_pads += 1
        return loss

    def check(self, variant: str, inputs: dict) -> tuple[float | None, str]:
        """The loss of an untimed forward (no gradients) of ``variant``, or ``None`` and the model's error."""
        self.enter(variant)
        try:
            with torch.no_grad():
                return float(self.loss(variant, inputs)), ""
        except Exception as error:  # noqa: BLE001 - whatever the unpatched model raises is its refusal
            return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def close(self) -> None:
        self.enter("padded")


def run_sft_benchmark(settings: BenchSettings, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure every (law, batch size) for all variants; see the module docstring."""
    if not re.fullmatch(r"(cpu|cuda)(:\d+)?", settings.device):
        raise PadfreeError(f"--device must be cpu, cuda or cuda:N, not {settings.device!r}")
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PadfreeError(f"--device {settings.device} was asked for, but CUDA is not available here "
                           f"(torch {torch.__version__}); run on a GPU machine or use --device cpu")
    if not 0 <= settings.prompt_share < 1:
        raise PadfreeError(f"--prompt-share must be in [0, 1), got {settings.prompt_share}")
    if settings.best_of < 1 or settings.best_of > 1 and not settings.prompt_share:
        raise PadfreeError(f"--best-of {settings.best_of}: N answers per prompt need N >= 1 and a prompt "
                           "(--prompt-share above 0, e.g. 0.6)")
    if settings.dtype not in ("float32", "bfloat16", "float16"):
        raise PadfreeError(f"--dtype must be float32, bfloat16 or float16, not {settings.dtype!r}")
    say = progress or (lambda _: None)
    say(f"building the model ({settings.model_config or settings.model_size}) on {settings.device}")
    model = build_model(settings)
    vocab = model.config.vocab_size
    high = min(settings.max_length, model.config.max_position_embeddings)
    if DATASET_LAW in settings.laws and settings.dataset is None:
        raise PadfreeError(f"the length law {DATASET_LAW!r} needs --dataset PATH")
    lengths = (dataset_lengths(settings.dataset, split=settings.dataset_split, tokenizer=settings.tokenizer,
                               seed=settings.seed) if settings.dataset is not None else None)
    runner = Runner(model, device)
    peak, peak_source = peak_flops(settings, device)
    flops_per_token = 6 * matmul_parameters(model)
    rows: list[BenchRow] = []
    try:
        for law in settings.laws:
            for batch_size in settings.batch_sizes:
                rows += _measure(runner, settings, law, batch_size, vocab, high, say, lengths)
    finally:
        runner.close()
    for row in rows:
        row.mfu = flops_per_token * row.tokens_per_s / peak
    environment = {"model": type(model).__name__, "hybrid (sequence mixers)": runner.hybrid,
                   "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "threads": torch.get_num_threads(), "padfree backend": runner.backend,
                   "MFU peak TFLOP/s": round(peak / 1e12, 3), "MFU peak source": peak_source,
                   "MFU FLOPs per token": flops_per_token}
    if "unpad" in runner.timed:  # every one was checked to be packed inside the model (UnpadRefused otherwise)
        environment["unpad steps packed"] = runner.unpad_steps
        if runner.unpad_steps_without_pads:
            environment["unpad steps on batches without a pad (nothing to unpad)"] = runner.unpad_steps_without_pads
    if lengths is not None:
        environment["dataset"] = {"path": settings.dataset, "examples": len(lengths),
                                  "median length": statistics.median(lengths), "longest": max(lengths)}
    try:
        environment["load average (1, 5, 15 min)"] = [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        pass
    return BenchResult(settings, rows, environment)


def _measure(runner: Runner, settings: BenchSettings, law: str, batch_size: int, vocab: int, high: int,
             say: Callable[[str], None], lengths: list[int] | None = None) -> list[BenchRow]:
    device = runner.device
    timed, checks = runner.timed, runner.checks
    if settings.best_of > 1:
        timed = (*timed, SHARED_VARIANT)
    batches = []
    for b in range(settings.batches):
        seed = settings.seed + 1000 * batch_size + b
        drawn = (sample_lengths(lengths, batch_size, seed, 1, high) if law == DATASET_LAW
                 else draw_lengths(law, batch_size, seed, settings.min_length, high))
        examples = make_examples(drawn, vocab, seed, settings.prompt_share, settings.best_of)
        prepared = {v: runner.prepare(v, examples) for v in (*timed, *checks) if v != "unpad"}
        if "unpad" in timed:  # the very tensors the padded variant runs on
            prepared["unpad"] = prepared["padded"]
        batches.append((examples, prepared))
    real = [sum(len(ex["input_ids"]) for ex in examples) for examples, _ in batches]
    computed = {v: sum(int(prepared[v]["input_ids"].shape[-1]) for _, prepared in batches)
                for v in ("padfree", SHARED_VARIANT) if v in timed}
    labelled = {v: sum(int(prepared[v]["logits_to_keep"].numel()) for _, prepared in batches) for v in computed}
    padded_tokens = [len(examples) * max(len(ex["input_ids"]) for ex in examples) for examples, _ in batches]
    times = {v: [] for v in timed}  # per round: seconds spent on all batches
    head_times: dict[str, list[float]] = {v: [] for v in computed if settings.best_of > 1}  # per round, head alone
    losses: dict[str, list] = {v: [] for v in (*timed, *checks)}  # first round: the loss of every batch
    refusals = {v: "" for v in checks}
    memory = {v: 0 for v in timed}
    model = runner.model

    def step(variant: str, inputs: dict) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        loss = runner.loss(variant, inputs)
        loss.backward()
        synchronize(device)
        return time.perf_counter() - start, float(loss.detach())

    say(f"{law} bs{batch_size}: untimed steps (warm-up, memory{', HF flattening checks' if checks else ''})")
    for variant in timed:  # warm-up, then the memory figure on untimed steps
        runner.enter(variant)
        for _ in range(settings.warmup):
            step(variant, batches[0][1][variant])
        for _, prepared in batches:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                step(variant, prepared[variant])
                memory[variant] = max(memory[variant], torch.cuda.max_memory_allocated(device))
            else:
                model.zero_grad(set_to_none=True)
                memory[variant] = max(memory[variant], saved_activation_bytes(
                    lambda: runner.loss(variant, prepared[variant])))
    for variant in checks:  # HF flattening on a hybrid: its loss (or its refusal), not its speed
        for _, prepared in batches:
            loss, refusal = runner.check(variant, prepared[variant])
            if loss is None:
                refusals[variant] = refusal
                break
            losses[variant].append(loss)
    for r in range(settings.rounds):
        shift = r % len(timed)
        order = timed[shift:] + timed[:shift]
        spent = {v: 0.0 for v in timed}
        head_spent = {v: 0.0 for v in head_times}
        for _, prepared in batches:
            for variant in order:
                runner.enter(variant)
                with calls_seen([model.get_output_embeddings()] if variant in head_times else []) as calls:
                    elapsed, loss = step(variant, prepared[variant])
                spent[variant] += elapsed
                if variant in head_times:  # outside the step's time
                    head_spent[variant] += head_and_loss_seconds(model, calls, prepared[variant])
                if r == 0:
                    losses[variant].append(loss)
        for v in timed:
            times[v].append(spent[v])
        for v in head_times:
            head_times[v].append(head_spent[v])
        say(f"{law} bs{batch_size} round {r + 1}/{settings.rounds}: "
            + ", ".join(f"{v} {sum(real) / spent[v]:,.0f} tok/s" for v in timed))
    model.zero_grad(set_to_none=True)
    total_real = sum(real)
    padding = 1 - total_real / sum(padded_tokens)
    nan = float("nan")

    def rel_diff(v: str) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(losses[v], losses["padded"])) if losses[v] else nan

    def ratio(baseline: str, v: str) -> float:
        return statistics.median(p / t for p, t in zip(times[baseline], times[v])) if baseline in times else nan

    rows = []
    for v in ("padded", *checks, *(t for t in timed if t != "padded")):  # a hybrid's HF checks after padded
        common = dict(law=law, batch_size=batch_size, variant=v, real_tokens=total_real, padding_fraction=padding,
                      loss_rel_diff=rel_diff(v), backend=runner.backend if v in PATCHED_VARIANTS else "sdpa",
                      memory_kind="cuda peak" if device.type == "cuda" else "saved activations")
        if v in checks:
            rel = common["loss_rel_diff"]
            note = (f"refuses: {refusals[v]}" if refusals[v] else
                    "mixes examples" if rel > MIXING_THRESHOLD else "matches padded")
            rows.append(BenchRow(**common, tokens_per_s=nan, step_ms=nan, memory_bytes=0, speedup_vs_padded=nan,
                                 timed=False, note=note))
            continue
        speedup = ratio("padded", v)
        if v in head_times:
            common["head_loss_ms"] = statistics.median(head_times[v]) / len(batches) * 1e3
        if v == SHARED_VARIANT:
            common.update(speedup_vs_padfree=ratio("padfree", v), ideal_vs_padfree=computed["padfree"] / computed[v],
                          weighted_ideal_vs_padfree=weighted_ideal(times["padfree"], head_times["padfree"],
                                                                   (computed["padfree"], computed[v]),
                                                                   (labelled["padfree"], labelled[v])))
            common["note"] = shared_note(common, computed["padfree"], computed[v],
                                         *(statistics.median(t["padfree"]) / len(batches) * 1e3
                                           for t in (times, head_times)))
        rows.append(BenchRow(
            **common, tokens_per_s=total_real / statistics.median(times[v]),
            step_ms=statistics.median(times[v]) / len(batches) * 1e3, memory_bytes=int(memory[v]),
            speedup_vs_padded=speedup, speedup_vs_hf=ratio("hf_native", v),
            of_ideal=speedup * (1 - padding) if v != "padded" else nan))
    return rows


def head_and_loss_seconds(model: torch.nn.Module, calls: list, inputs: dict) -> float:
    """Seconds of the LM head's calls of one step run again alone (:func:`seconds_alone`, gradients cleared first),
    forward and backward through the model's own loss on the step's ``shift_labels`` (the labelled positions, those
    of ``logits_to_keep``)."""
    model.zero_grad(set_to_none=True)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size,
                                   shift_labels=inputs["shift_labels"])

    seconds = sum(seconds_alone(call, trained=True, objective=loss) for call in calls)
    model.zero_grad(set_to_none=True)
    return seconds


def weighted_ideal(seconds: list[float], head_seconds: list[float], tokens: tuple[int, int],
                   labelled: tuple[int, int]) -> float:
    """The cost-weighted ideal of ``padfree+shared`` over ``padfree`` (see the module docstring): per round,
    :func:`cost_weighted_ideal` of ``padfree``'s time and its head-and-loss time alone, the tokens each computes and
    their labelled positions; the median over rounds."""
    return statistics.median(cost_weighted_ideal(step, head, tokens, labelled)
                             for step, head in zip(seconds, head_seconds, strict=True))


def shared_note(row: dict, native_tokens: int, shared_tokens: int, step_ms: float, head_ms: float) -> str:
    """The shared row's note: its speedup over ``padfree`` and the share it reaches of each ideal."""
    speedup, ideal, weighted = row["speedup_vs_padfree"], row["ideal_vs_padfree"], row["weighted_ideal_vs_padfree"]
    return (f"x{speedup:.2f} over padfree, ideal x{ideal:.2f} ({speedup / ideal:.0%}; {shared_tokens:,} of "
            f"{native_tokens:,} tokens computed), cost-weighted ideal x{weighted:.2f} ({speedup / weighted:.0%}; "
            f"LM head + loss alone {head_ms:,.0f} of padfree's {step_ms:,.0f} ms per step)")


# -- output -----------------------------------------------------------------------------------------------------


def plot(result: BenchResult, path: Path) -> Path:
    """Bar charts of real tokens/s and memory per (law, batch size) and variant, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r.law, r.batch_size) for r in result.rows))
    by = {(r.law, r.batch_size, r.variant): r for r in result.rows}
    variants = list(dict.fromkeys(r.variant for r in result.rows if r.timed))  # a hybrid's HF checks: no bars
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs = [c + (i - (len(variants) - 1) / 2) * width for c in range(len(configs))]
        axes[0].bar(xs, [by[(law, bs, variant)].tokens_per_s for law, bs in configs], width, label=variant)
        axes[1].bar(xs, [by[(law, bs, variant)].memory_bytes / 2**20 for law, bs in configs], width, label=variant)
    labels = [f"{law}, bs {bs}\n{by[(law, bs, 'padded')].padding_fraction:.0%} padding" for law, bs in configs]
    kind = result.rows[0].memory_kind if result.rows else ""
    for ax, title in zip(axes, ("real (non-pad) tokens / s", f"memory, MiB ({kind})")):
        ax.set_xticks(range(len(configs)), labels)
        ax.set_title(title)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # head room: the legend never covers a bar
        ax.legend(loc="upper left", ncols=len(variants))
    s = result.settings
    device = result.environment.get("device")
    model = s.model_config or f"Llama {s.model_size}"
    figure.suptitle(f"SFT step (forward + backward), {model}, {s.dtype}, {device}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_outputs(result: BenchResult, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_sft.json", "png": out / "bench_sft.png"}
    paths["json"].write_text(result.to_json())
    plot(result, paths["png"])
    return paths
