"""Scale benchmark: one long packed row trained by 2 processes (``--world``: N), three ways (five with
``--allgather``), side by side in one run.

Variants, each on N CPU processes (gloo), launched by :func:`run_scale_benchmark` with ``torch.distributed.run``
(a subprocess with a timeout; this module is also its worker):

* ``ddp`` — SP = 1: every rank trains its own packed row of ``tokens`` tokens (the same examples on both ranks),
  model under ``DistributedDataParallel``;
* ``fsdp2`` — SP = 1 as ``ddp``, the model sharded by ``torch.distributed.fsdp.fully_shard`` (every decoder layer,
  then the root);
* ``sp2`` — SP = 2 (``sequence_parallel: {size: 2}``): both ranks train ONE row of ``tokens`` tokens, each rank
  handing in its half of the examples and computing half of the tokens; under DDP for the gradient all-reduce
  (``sp<N>`` with N processes; attention by ``sequence_parallel.attention: auto``). A hybrid's sequence mixers run
  split (each rank its slice, the state passed across the cut: :mod:`padfree_plugins.modeling.split_mixers`);
* ``sp<N>-allgather`` (``allgather``) — the same with ``sequence_parallel.attention: allgather``: each rank gathers
  the row's keys and values instead of exchanging heads, its causal work balanced (``sequence_parallel.balance:
  auto``, zigzag);
* ``sp<N>-allgather-contiguous`` (``allgather``) — the same with ``sequence_parallel.balance: off``: each rank
  attends its own slice's queries;
* ``sp<N>-gather`` (on request, ``variants``) — ``sp<N>`` with ``sequence_parallel.mixers: gather``: every rank runs
  the mixers on the whole row.

What a step trains (``steps``): ``sft``, the row's causal-LM loss (below); ``dpo`` / ``grpo``, a TRL DPO or GRPO
trainer step's log-probability, loss and backward work on a group of pairs / completions totalling ``tokens`` tokens
(:mod:`.scale_rl`; variants ``ddp`` and ``sp<N>``, not ``fsdp2``). Memory targets (:data:`MEMORY_TARGETS`): peak
memory per rank at SP = 2 at most 0.55x ddp's, at SP = 4 at most 0.30x, for every model's ``sft`` row.

The row's examples are the same in every variant (lognormal lengths, median ``tokens / 8``, the last one cut so
that the row holds ``tokens`` tokens exactly), as are the weights; no optimizer step, so the variants' losses must
agree (checked: ``loss rel. diff`` from ``ddp``). Each step is forward + backward, the loss normalised by the global
label count and multiplied by the number of processes (docs/scaling.md, "The loss across ranks").

Measured per variant:

* **peak memory per rank** — ``torch.profiler`` with ``profile_memory=True`` on one untimed step: the CPU
  allocator reports every allocation and free, and the figure is the highest running total of bytes allocated
  during the step and still alive (activations, transients, gradients, FSDP's gathered weights, the exchanged
  slices), above what existed before it (the weights, DDP's buckets); the largest over the ranks;
* **saved for backward** — the distinct storages autograd saves during the forward
  (:func:`~padfree_plugins.benchmarks.measure.saved_activation_bytes`, as ``bench sft`` reports on CPU);
* **weights per rank** — the parameter bytes a rank holds (its local shard under FSDP2);
* **real tokens/s** — the tokens of all rows trained in a step (``2 x tokens`` for ``ddp`` / ``fsdp2``, ``tokens``
  for ``sp2``) over the step time (the slowest rank's), median over interleaved rounds; per rank: half of it.

Communication of SP = N (:func:`communication`), computed from the model config: per attention layer four
all-to-alls (q, k, v in: ``[T/N, H, D]`` each, k and v with their heads repeated when ``N`` does not divide them;
the output back: ``[T/N, H, D]``), the same again in the backward; per sequence-mixer layer, split: one state per
cut (the recurrent state and the conv taps transformers' cache keeps, sent point to point, its gradient back in the
backward; ``N - 1`` cuts; without shared prefixes a rank sends at most one state per layer, whatever ``T`` and
``N``); gathered: one all-gather of ``[T, hidden]``, an all-to-all of the same size in the backward.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from padfree_plugins.benchmarks.scale_rl import (
    DPO_PAIRS,
    GRPO_GENERATIONS,
    GRPO_GROUPS,
    RL_STEPS,
    RLVariant,
    check_world,
)
from padfree_plugins.benchmarks.sft import MODEL_SIZES
from padfree_plugins.errors import PadfreeError

VARIANTS = ("ddp", "fsdp2", "sp2")
#: What a step trains: the row's causal-LM loss (``sft``), or a TRL DPO / GRPO step on a group (:mod:`.scale_rl`).
STEPS = ("sft", *RL_STEPS)
#: Processes of every variant by default (sequence-parallel group size of ``sp2``).
WORLD = 2


def variants(world: int = WORLD, allgather: bool = False) -> tuple[str, ...]:
    """The variants of a run on ``world`` processes; ``allgather``: with all-gather sequence parallelism too
    (balanced and contiguous)."""
    return ("ddp", "fsdp2", f"sp{world}") + (
        (f"sp{world}-allgather", f"sp{world}-allgather-contiguous") if allgather else ())
#: Targets: peak memory per rank at SP = N over SP = 1 (``ddp``), by N, for every model (the Llama; the hybrids with
#: their mixers split, so that their activations are split too). No target at other sizes.
MEMORY_TARGETS = {2: 0.55, 4: 0.30}
PROGRESS = "[bench scale] "
#: The models: name -> (model type, overrides of :func:`~padfree_plugins.testing.models.tiny_model`). Both at
#: bench sft's tiny scale (d=256, 4 layers, vocab 4096): its tiny Llama, and the shape of
#: configs/bench/qwen3_5_hybrid.json.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {k: v for k, v in MODEL_SIZES["tiny"].items() if k != "max_position_embeddings"}),
    "qwen3_5_text": ("qwen3_5_text", dict(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})),
    "granite4h": ("granitemoehybrid", dict(  # configs/bench/granite4h_hybrid.json
        vocab_size=4096, hidden_size=256, shared_intermediate_size=688, num_local_experts=0, num_hidden_layers=6,
        layer_types=["mamba", "mamba", "mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
        num_key_value_heads=1, position_embedding_type="nope", mamba_n_heads=8, mamba_d_head=64, mamba_expand=2,
        mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=64, tie_word_embeddings=False)),
}
TITLES = {"llama": "Llama (4 layers, d=256, GQA 8/2)",
          "qwen3_5_text": "Qwen3.5-shaped: 3 gated DeltaNet + 1 attention layer, d=256",
          "granite4h": "Granite-4.0-H-shaped (Mamba2 hybrid): 5 Mamba2 + 1 attention layer, d=256"}
#: What the DPO and GRPO steps' groups hold (:mod:`.scale_rl`).
STEP_TITLES = {"dpo": f"{DPO_PAIRS} pairs, chosen and rejected each after its prompt, every sequence whole",
               "grpo": f"{GRPO_GROUPS} prompts x {GRPO_GENERATIONS} completions, every sequence whole"}
QUICK = dict(tokens=1024, rounds=1, warmup=0)
#: ``layer_types`` entries of attention layers (the others are sequence mixers: gated DeltaNet, Mamba, conv).
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "attention")


@dataclass
class ScaleSettings:
    tokens: int = 16384
    models: tuple[str, ...] = tuple(MODELS)
    rounds: int = 2
    warmup: int = 1
    seed: int = 0
    threads: int = 1
    timeout: float = 1800.0
    world: int = WORLD
    allgather: bool = False
    #: The variants to run (``ddp`` always among them); empty: :func:`variants`.
    chosen: tuple[str, ...] = ()
    #: The steps measured: ``sft`` (the row's causal-LM loss), ``dpo``, ``grpo`` (:mod:`.scale_rl`).
    steps: tuple[str, ...] = ("sft",)


@dataclass
class ScaleRow:
    model: str
    variant: str
    sequence_parallel: int
    rows_per_step: int
    tokens_per_step: int
    tokens_per_s: float
    step_s: float
    peak_bytes: int
    peak_bytes_by_rank: list[int]
    saved_bytes: int
    weight_bytes: int
    loss: float
    loss_rel_diff: float = 0.0
    memory_vs_ddp: float = 1.0
    speed_vs_ddp: float = 1.0
    processes: int = WORLD
    step: str = "sft"

    @property
    def tokens_per_s_per_rank(self) -> float:
        return self.tokens_per_s / self.processes


@dataclass
class ScaleResult:
    settings: ScaleSettings
    rows: list[ScaleRow]
    communication: dict[str, dict[str, Any]]
    environment: dict[str, Any] = field(default_factory=dict)

    def row(self, model: str, variant: str, step: str = "sft") -> ScaleRow:
        return next(r for r in self.rows if r.model == model and r.variant == variant and r.step == step)

    def memory_target(self, model: str = "llama") -> bool | None:
        """Whether peak memory per rank at SP = N is within its target (:func:`target_of`) of SP = 1 (``None``: not
        run)."""
        sp = f"sp{self.settings.world}"
        if not any(r.model == model and r.variant == sp and r.step == "sft" for r in self.rows):
            return None
        target = target_of(self.settings.world)
        return None if target is None else self.row(model, sp).memory_vs_ddp <= target

    def as_dict(self) -> dict[str, Any]:
        return {"settings": asdict(self.settings), "environment": self.environment,
                "communication": self.communication, "memory_target": target_of(self.settings.world),
                "memory_target_met": self.memory_target(),
                "rows": [{**asdict(r), "tokens_per_s_per_rank": r.tokens_per_s_per_rank} for r in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


# -- what the model implies -------------------------------------------------------------------------------------


def target_of(world: int) -> float | None:
    """The memory target of an ``sp<world>`` row (:data:`MEMORY_TARGETS`; ``None``: none at that size)."""
    return MEMORY_TARGETS.get(world)


def model_config(name: str, tokens: int) -> Any:
    """The transformers config of the named model of :data:`MODELS` (positions up to ``tokens``)."""
    from padfree_plugins.testing.models import tiny_config

    model_type, overrides = MODELS[name]
    return tiny_config(model_type, max_position_embeddings=max(tokens, 2048), use_cache=False, **overrides)


def build_model(name: str, tokens: int) -> torch.nn.Module:
    """The named model of :data:`MODELS`, seeded (the same weights in every variant), in training mode."""
    from padfree_plugins.testing.models import tiny_model

    return tiny_model(model_config(name, tokens), "causal_lm").train()


def row_lengths(tokens: int, seed: int) -> list[int]:
    """Example lengths of one packed row of exactly ``tokens`` tokens: lognormal, median ``tokens / 8``, the last
    one cut."""
    from padfree_plugins.benchmarks.lengths import lognormal_lengths

    drawn = lognormal_lengths(4 * 8 + 64, tokens / 8, 0.6, 16, tokens, seed)
    lengths, total = [], 0
    for length in drawn:
        length = min(length, tokens - total)
        lengths.append(length)
        total += length
        if total == tokens:
            return lengths
    raise PadfreeError(f"could not fill a row of {tokens} tokens")  # pragma: no cover - 96 draws of median T/8


def communication(config: Any, tokens: int, size: int = WORLD, element_bytes: int = 4) -> dict[str, Any]:
    """What sequence parallelism over ``size`` ranks exchanges per layer of ``config`` for a row of ``tokens``
    tokens, per rank and direction (forward; the backward exchanges as much again). Bytes are the tensors that go
    through the collectives; ``(size - 1) / size`` of them leave the rank. ``allgather bytes per layer``: the same
    for all-gather attention (the row's keys and values gathered on every rank; their gradients reduce-scattered
    back in the backward)."""
    from padfree_plugins.modeling.attention.ulysses import kv_repeats

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    repeat = kv_repeats(heads, kv_heads, size)
    local = tokens // size
    attention = local * (2 * heads + 2 * kv_heads * repeat) * head_dim * element_bytes
    allgather = tokens * 2 * kv_heads * head_dim * element_bytes
    gathered = tokens * text.hidden_size * element_bytes
    recurrent, conv = mixer_state(text)
    split = (recurrent + conv) * element_bytes
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    attentions = sum(t in ATTENTION_LAYERS for t in types)
    mixers = len(types) - attentions
    return {"attention layers": attentions, "mixer layers": mixers, "heads q / kv": f"{heads} / {kv_heads}",
            "kv repeat": repeat, "head dim": head_dim, "hidden": text.hidden_size,
            "attention bytes per layer": attention, "allgather bytes per layer": allgather,
            "mixer bytes per layer": gathered,
            "mixer state bytes per cut": split, "mixer state elements (recurrent, conv)": [recurrent, conv],
            "bytes per step forward": attentions * attention + mixers * split,
            "bytes per step forward, mixers gathered": attentions * attention + mixers * gathered,
            "off-rank share": (size - 1) / size}


def mixer_state(text: Any) -> tuple[int, int]:
    """Elements of one sequence-mixer state that a split mixer passes across a cut: (recurrent, conv taps) — a
    gated delta rule's ``[value heads, key dim, value dim]`` and conv cache ``[2 x keys + values, K]``; a Mamba2
    scan's ``[heads, head dim, state]`` and conv cache ``[intermediate + 2 x groups x state, K]``; (0, 0) for a
    model without such mixers."""
    if getattr(text, "linear_num_value_heads", None):
        keys = text.linear_num_key_heads * text.linear_key_head_dim
        values = text.linear_num_value_heads * text.linear_value_head_dim
        return (text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim,
                (2 * keys + values) * text.linear_conv_kernel_dim)
    if getattr(text, "mamba_n_heads", None):
        inner = text.mamba_expand * text.hidden_size
        return (text.mamba_n_heads * text.mamba_d_head * text.mamba_d_state,
                (inner + 2 * text.mamba_n_groups * text.mamba_d_state) * text.mamba_d_conv)
    return 0, 0


# -- output -------------------------------------------------------------------------------------------------------

#: What the memory figures are, printed with them.
MEMORY_NOTE = ("peak MiB: the highest total of CPU bytes allocated during one forward + backward and alive at the "
               "time (torch.profiler profile_memory: the allocator's events), above what existed before the step "
               "(weights, DDP buckets): activations, transients, gradients, FSDP's gathered weights; the largest "
               "rank. saved MiB: distinct storages autograd saved for backward (weights a layer saves included).")
COLUMNS = ("variant", "SP", "rows / step", "real tok/s", "tok/s per rank", "step s", "speed vs ddp",
           "peak MiB per rank", "vs ddp",
           "target " + ", ".join(f"SP={n} <= {t}x" for n, t in MEMORY_TARGETS.items()),
           "saved MiB", "weights MiB per rank",
           "loss rel. diff")


def verdict(row: ScaleRow) -> str:
    """The memory target's verdict beside SP = N's ratio (:func:`target_of`): pass / FAIL; none with the mixers
    gathered."""
    if row.variant.startswith("sp") and row.variant.endswith("-gather"):
        return "none (mixers: whole row)"
    if not row.variant.startswith("sp"):
        return "-"
    if row.step != "sft":
        return f"none ({row.step} step)"
    target = target_of(row.sequence_parallel)
    if target is None:
        return f"none (SP={row.sequence_parallel})"
    return "pass" if row.memory_vs_ddp <= target else "FAIL"


def cells(row: ScaleRow) -> tuple[str, ...]:
    """A row of the table (:data:`COLUMNS`)."""
    return (row.variant, str(row.sequence_parallel), str(row.rows_per_step), f"{row.tokens_per_s:,.0f}",
            f"{row.tokens_per_s_per_rank:,.0f}", f"{row.step_s:.2f}", f"{row.speed_vs_ddp:.2f}x",
            f"{row.peak_bytes / 2**20:,.1f}", f"{row.memory_vs_ddp:.2f}x", verdict(row),
            f"{row.saved_bytes / 2**20:,.1f}", f"{row.weight_bytes / 2**20:,.1f}", f"{row.loss_rel_diff:.1e}")


def communication_line(model: str, volume: dict[str, Any], tokens: int, world: int = WORLD,
                       allgather: bool = False) -> str:
    """SP = N's exchange per layer of ``model`` in words (``allgather``: all-gather attention's too)."""
    mib = 2**20
    parts = []
    if volume["attention layers"]:
        kv = (f", k and v heads x{volume['kv repeat']}" if volume["kv repeat"] > 1 else "")
        parts.append(f"{volume['attention layers']} attention layer(s): 4 all-to-alls per layer (q, k, v in: "
                     f"[T/N={tokens // world}, H, D={volume['head dim']}], H = {volume['heads q / kv']}{kv}; "
                     f"output back) = {volume['attention bytes per layer'] / mib:.2f} MiB per rank per layer")
        if allgather:
            parts.append(f"all-gather attention: 2 all-gathers per layer (k, v: [T={tokens}, H_kv, "
                         f"D={volume['head dim']}]) = {volume['allgather bytes per layer'] / mib:.2f} MiB per rank "
                         "per layer")
    if volume["mixer layers"]:
        recurrent, conv = volume["mixer state elements (recurrent, conv)"]
        parts.append(f"{volume['mixer layers']} mixer layer(s), split: one state per cut ({world - 1} cut(s), a rank "
                     f"sends at most one state to the next; recurrent {recurrent:,} + "
                     f"conv taps {conv:,} elements) = {volume['mixer state bytes per cut'] / 2**10:.1f} KiB per layer "
                     f"(gathered: 1 all-gather of [T={tokens}, hidden={volume['hidden']}] = "
                     f"{volume['mixer bytes per layer'] / mib:.2f} MiB per rank per layer)")
    return (f"{model}: " + "; ".join(parts) + f"; forward total {volume['bytes per step forward'] / mib:.2f} MiB "
            f"per rank (fp32), as much again in the backward, {volume['off-rank share']:.0%} of it leaves the rank")


def write_outputs(result: ScaleResult, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_scale.json"
    path.write_text(result.to_json())
    return path


# -- the launcher ---------------------------------------------------------------------------------------------------


def run_scale_benchmark(settings: ScaleSettings, progress: Callable[[str], None] | None = None) -> ScaleResult:
    """Run every model's variants in one ``torch.distributed.run`` of ``settings.world`` CPU processes; see the
    module docstring."""
    unknown = [m for m in settings.models if m not in MODELS]
    if unknown or not settings.models:
        raise PadfreeError(f"unknown model(s) {', '.join(unknown) or '(none given)'} for bench scale; choose from "
                           f"{', '.join(MODELS)}")
    if settings.world < 2:
        raise PadfreeError(f"--world must be at least 2 processes, got {settings.world}")
    if settings.tokens < 64 or settings.tokens % settings.world:
        raise PadfreeError(f"--tokens must be a multiple of the {settings.world} processes (an even number for 2) "
                           f"of at least 64, got {settings.tokens}")
    if settings.rounds < 1:
        raise PadfreeError(f"--rounds must be at least 1 (the timed steps), got {settings.rounds}")
    wrong = [s for s in settings.steps if s not in STEPS]
    if wrong or not settings.steps:
        raise PadfreeError(f"--steps: {', '.join(wrong) or '(none given)'}; choose from {', '.join(STEPS)}")
    for step in settings.steps:
        if step in RL_STEPS:
            check_world(step, settings.world)
    known = (*variants(settings.world, True), f"sp{settings.world}-gather")
    wrong = [v for v in settings.chosen if v not in known]
    if wrong or (settings.chosen and "ddp" not in settings.chosen):
        raise PadfreeError(f"--variants: {', '.join(wrong) or 'ddp missing'}; choose from {', '.join(known)} "
                           "(ddp, the baseline, always among them)")
    say = progress or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="padfree-bench-scale-") as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={settings.world}",
                   "-m", __name__, json.dumps(asdict(settings)), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads), "TOKENIZERS_PARALLELISM": "false"}
        say(f"launching {settings.world} processes (gloo): {', '.join(settings.models)}, a row of {settings.tokens} "
            f"tokens, timeout {settings.timeout:.0f} s")
        _launch(command, env, settings.timeout, say, settings.world, result=out)
        raw = json.loads(out.read_text())
    rows = [ScaleRow(**row) for row in raw["rows"]]
    for model in settings.models:
        for step in settings.steps:
            base = next(r for r in rows if r.model == model and r.step == step and r.variant == "ddp")
            for r in rows:
                if r.model != model or r.step != step:
                    continue
                r.memory_vs_ddp = r.peak_bytes / base.peak_bytes
                r.speed_vs_ddp = r.tokens_per_s / base.tokens_per_s
                r.loss_rel_diff = abs(r.loss - base.loss) / abs(base.loss)
    volumes = {m: communication(model_config(m, settings.tokens), settings.tokens, settings.world)
               for m in settings.models}
    environment = {**raw["environment"]}
    try:
        environment["load average (1, 5, 15 min)"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        pass
    return ScaleResult(settings, rows, volumes, environment)


#: Seconds a launch may linger after its result is written (torch's gloo teardown can deadlock) before it is killed.
TEARDOWN_GRACE_S = 30.0
#: How long :func:`_kill_launch` waits for the processes it killed to die.
KILL_WAIT_S = 10.0
#: The environment variable that marks a launch's processes (torch elastic starts its workers in sessions of their
#: own, outside the launcher's process group, so killing the group alone would leave them running).
LAUNCH_TOKEN = "PADFREE_BENCH_LAUNCH"


def _launch(command: list[str], env: dict, timeout: float, say: Callable[[str], None], world: int = WORLD,
            result: Path | None = None) -> None:
    """Run the workers; their progress lines go to ``say``, the rest is kept for an error. A run past ``timeout``
    is killed, and so is one that lingers :data:`TEARDOWN_GRACE_S` after writing ``result`` (judged on it, with a
    note); either way every process of the launch goes: the launcher, its group and its workers."""
    token = uuid.uuid4().hex
    process = subprocess.Popen(command, env={**env, LAUNCH_TOKEN: token}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail: deque[str] = deque(maxlen=40)

    def read() -> None:
        for line in process.stdout:
            if line.startswith(PROGRESS):
                say(line[len(PROGRESS):].rstrip())
            else:
                tail.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline, written_at = time.monotonic() + timeout, None
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if written_at is None and result is not None and result.exists():
                written_at = time.monotonic()
            if written_at is not None and time.monotonic() - written_at > TEARDOWN_GRACE_S:
                break
            time.sleep(0.2)
    finally:
        lingering = process.poll() is None
        _kill_launch(process, token)
    reader.join(timeout=10)
    if lingering and written_at is None:
        raise PadfreeError(f"bench scale: the {world} processes did not finish within {timeout:.0f} s (killed); "
                           "use fewer --tokens or a longer --timeout. Last output:\n" + "\n".join(tail))
    if lingering:
        say(f"the workers wrote their results but had not exited {TEARDOWN_GRACE_S:.0f} s later (torch's gloo "
            "teardown); killed them, the results stand")
        return
    if process.returncode:
        raise PadfreeError(f"bench scale: the workers failed (exit status {process.returncode}). Last output:\n"
                           + "\n".join(tail))


def _kill_launch(process: subprocess.Popen, token: str) -> None:
    """SIGKILL the launcher's process group and every process whose environment carries ``token`` (Linux's
    ``/proc``; elsewhere the group alone), and wait (up to :data:`KILL_WAIT_S`) until each of them has died: a
    killed process dies when the kernel next schedules it, which on a loaded machine is not at once."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    marker = f"{LAUNCH_TOKEN}={token}".encode()
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(entry)
    process.wait()
    deadline = time.monotonic() + KILL_WAIT_S
    while any(_running(entry) for entry in killed) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(entry: Path) -> bool:
    """Whether the process of ``/proc/<pid>`` still runs (neither gone nor a zombie waiting to be reaped)."""
    try:
        return (entry / "stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


# -- the worker (one per rank, under torch.distributed.run) ---------------------------------------------------------


def peak_step_bytes(step: Callable[[], None]) -> int:
    """The highest total of bytes allocated on the CPU during ``step()`` and alive at the time, from the
    allocator's events that ``torch.profiler`` records (``profile_memory``): frees of older tensors do not count."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = sorted((e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    total = peak = 0
    for event in events:
        if event.device_type() == DeviceType.CPU:
            total += event.nbytes()
            peak = max(peak, total)
    return peak


class Variant:
    """One variant's model on this rank: built, assembled, wrapped; ``step()`` runs forward + backward."""

    def __init__(self, model_name: str, variant: str, examples: list[dict], tokens: int) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from padfree_plugins import assemble
        from padfree_plugins.batching.distributed import num_label_tokens

        self.name, self.variant = model_name, variant
        world, rank = dist.get_world_size(), dist.get_rank()
        model = build_model(model_name, tokens)
        config: dict[str, Any] = {"task": "causal_lm"}
        if variant.startswith("sp"):
            scheme = "allgather" if "-allgather" in variant else "auto"
            mixers = "gather" if variant.endswith("-gather") and not variant.endswith("-allgather") else "split"
            balance = "off" if variant.endswith("-contiguous") else "auto"
            config["sequence_parallel"] = {"size": world, "attention": scheme, "mixers": mixers, "balance": balance}
            half = _halves(examples, world)
            examples = half[rank]
        self.assembly = assemble(model, config)
        self.batch = self.assembly.collator(examples)
        count = num_label_tokens(self.batch).clone()
        dist.all_reduce(count)
        self.count, self.world = count, world
        self.rows, self.tokens = (1, tokens) if variant.startswith("sp") else (world, world * tokens)
        if variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            self.module = self.wrapped = model
        else:
            self.module, self.wrapped = model, DistributedDataParallel(model)
        self.weight_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())

    def loss(self) -> torch.Tensor:
        """The forward: this rank's loss (gradients cleared first)."""
        self.module.zero_grad(set_to_none=True)
        return self.assembly.forward(self.wrapped, self.batch, num_items_in_batch=self.count).loss * self.world

    def step(self) -> None:
        self.loss().backward()


def rl_variant(model_name: str, step: str, variant: str, settings: ScaleSettings) -> RLVariant:
    """A DPO or GRPO step's variant on this rank (:mod:`.scale_rl`), ``sp<N>`` variants as :class:`Variant`'s."""
    import torch.distributed as dist

    sequence_parallel = None
    if variant.startswith("sp"):
        scheme = "allgather" if variant.endswith("-allgather") else "auto"
        mixers = "gather" if variant.endswith("-gather") and not variant.endswith("-allgather") else "split"
        sequence_parallel = {"size": dist.get_world_size(), "attention": scheme, "mixers": mixers}
    return RLVariant(step, build_model(model_name, settings.tokens), variant, settings.tokens,
                     MODELS[model_name][1]["vocab_size"], settings.seed, sequence_parallel)


def _local(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def _halves(examples: list[dict], parts: int) -> list[list[dict]]:
    """``examples`` cut into ``parts`` consecutive runs of about equal tokens (the ranks' micro-batches of SP)."""
    total = sum(len(e["input_ids"]) for e in examples)
    out: list[list[dict]] = [[] for _ in range(parts)]
    seen = 0
    for example in examples:
        out[min(parts - 1, seen * parts // total)].append(example)
        seen += len(example["input_ids"])
    return out


def worker(settings: ScaleSettings, out: str) -> None:
    """Every model, every variant on this rank: untimed steps (warm-up, memory), then interleaved timed rounds;
    rank 0 writes the rows to ``out``."""
    import torch.distributed as dist

    from padfree_plugins.benchmarks.measure import saved_activation_bytes
    from padfree_plugins.testing.models import random_examples

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(settings.threads)

    def say(line: str) -> None:
        if rank == 0:
            print(PROGRESS + line, file=sys.stderr, flush=True)

    def gathered(value: float) -> list[float]:
        values: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    rows = []
    for name, step in [(name, step) for name in settings.models for step in settings.steps]:
        lengths = row_lengths(settings.tokens, settings.seed)
        examples = random_examples(lengths, MODELS[name][1]["vocab_size"], seed=settings.seed, low=3)
        names = list(settings.chosen or variants(dist.get_world_size(), settings.allgather))
        if step == "sft":
            say(f"{name}: building {', '.join(names)} ({len(lengths)} examples in the row, longest {max(lengths)})")
            built: dict[str, Any] = {v: Variant(name, v, examples, settings.tokens) for v in names}
        else:
            names = [v for v in names if v != "fsdp2"]  # a TRL trainer's model under DDP only
            say(f"{name} {step} step: building {', '.join(names)} (a group of {settings.tokens} tokens)")
            built = {v: rl_variant(name, step, v, settings) for v in names}
        label = name if step == "sft" else f"{name} {step}"
        peaks: dict[str, list[int]] = {}
        saved: dict[str, int] = {}
        losses: dict[str, float] = {}
        for v, variant in built.items():
            for _ in range(settings.warmup):
                variant.step()
            measured: list = []  # one untimed step: its loss, its peak, what it saved for backward

            def forward() -> torch.Tensor:
                measured.append(variant.loss())
                return measured[-1]

            dist.barrier()
            peak = peak_step_bytes(lambda: measured.append(saved_activation_bytes(forward)))
            peaks[v] = [int(p) for p in gathered(peak)]
            saved[v] = max(gathered(measured[1]))
            loss = measured[0].detach().clone()  # the same on every step: no optimizer step
            dist.all_reduce(loss)
            losses[v] = float(loss) / dist.get_world_size()
            if step != "sft":
                variant.check_packed()
            say(f"{label} {v}: peak {max(peaks[v]) / 2**20:,.1f} MiB per rank, loss {losses[v]:.6f}")
        times: dict[str, list[float]] = {v: [] for v in names}
        for r in range(settings.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:
                dist.barrier()
                start = time.perf_counter()
                built[v].step()
                times[v].append(max(gathered(time.perf_counter() - start)))  # a step lasts as its slowest rank
            say(f"{label} round {r + 1}/{settings.rounds}: "
                + ", ".join(f"{v} {built[v].tokens / times[v][-1]:,.0f} tok/s" for v in names))
        for v, variant in built.items():
            step_s = statistics.median(times[v])
            world = dist.get_world_size()
            rows.append(dict(model=name, step=step, variant=v,
                             sequence_parallel=world if v.startswith("sp") else 1,
                             rows_per_step=variant.rows, tokens_per_step=variant.tokens,
                             tokens_per_s=variant.tokens / step_s, step_s=step_s, peak_bytes=max(peaks[v]),
                             peak_bytes_by_rank=peaks[v], saved_bytes=saved[v], weight_bytes=variant.weight_bytes,
                             loss=losses[v], processes=world))
        del built
    if rank == 0:
        environment = {"torch": torch.__version__, "processes": dist.get_world_size(), "backend": "gloo",
                       "threads per process": torch.get_num_threads(), "cpus": os.cpu_count(),
                       "examples in the row": len(row_lengths(settings.tokens, settings.seed))}
        Path(out).write_text(json.dumps({"rows": rows, "environment": environment}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    raw = json.loads(sys.argv[1])
    worker(ScaleSettings(**{**raw, "models": tuple(raw["models"]), "chosen": tuple(raw["chosen"]),
                            "steps": tuple(raw["steps"])}), sys.argv[2])
    # The figures are on disk and every rank is past its last collective: leave without the interpreter's teardown,
    # where a thread of the process group can still abort the process (SIGABRT after a finished run, seen under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
