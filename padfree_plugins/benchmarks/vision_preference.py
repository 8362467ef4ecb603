"""``bench dpo --vision`` / ``bench grpo --vision``: TRL's DPO and GRPO ``compute_loss`` + backward on image-text
batches, padded vs padding-free, on the same Qwen2.5-VL-shaped model (the language model of ``bench vlm``, 4 layers
d=256, beside a tiny vision tower), the same batches and weights, measured in one run.

* ``padded``: TRL as it is: every log-probability forward on TRL's padded batch, the rows' images together;
* ``native``: ``accelerate(trainer)`` (plugins ``trl_dpo`` / ``trl_grpo``, ``prefix_sharing: off``): every fused
  call split into its rows, each row's images with it, and packed by the family's multimodal collator;
* ``shared``: the same with ``prefix_sharing: on``: each pair's / group's prompt once in the packed row, its images
  once (the vision tower encodes each distinct prompt's images once). Its speed over ``native`` is printed beside the
  ideal: the tokens and pixel rows (the vision tower's patches) ``native``'s policy computes over those ``shared``'s
  computes, and beside it the ideal weighted by what a pixel row and a token cost (:func:`measured_costs`: the vision
  towers timed alone in the same rounds, :class:`TowerTimed`).

Batches are built as TRL's trainers hand them to ``compute_loss``:

* DPO: what ``DataCollatorForVisionPreference`` returns — prompt + chosen and prompt + rejected (``2 × pairs`` rows,
  right-padded after TRL's ``flush_left``), ``completion_mask``, ``mm_token_type_ids``, the prompts' images once per
  row (chosen rows, then rejected rows);
* GRPO: what ``_generate_and_score_completions`` returns — left-padded prompts, ``num_generations`` right-padded
  completions each (ending in EOS), group-normalised advantages, the images of each completion's prompt,
  ``num_images``, ``mm_token_type_ids`` over prompt and completion, and the reference model's log-probabilities
  (TRL's ``_get_per_token_logps_and_entropies``, padded, images and all) as ``ref_per_token_logps`` and
  ``old_per_token_logps``.

The length law (:data:`PROMPT_TEXT`, :data:`ANSWERS`, :data:`IMAGE_SIZES`): prompts of lognormal text with 0, 1 or 2
images of 16 to 96 visual tokens (DPO; GRPO prompts 1 or 2 images — TRL cannot mix prompts without images into a
generation batch), answers lognormal with a long tail (median 48 tokens; a few hundred at most), as in image-text
preference and visual-reasoning data. Real tokens are the padded batch's non-pad tokens (image placeholders
included). Memory is the activations autograd keeps for backward
(:func:`~padfree_plugins.benchmarks.measure.saved_activation_bytes`). Every ``native`` forward is checked packed
(:class:`~padfree_plugins.benchmarks.preference.NotPacked` stops the benchmark otherwise); the checked step, the
interleaved rounds and the medians are ``bench dpo`` / ``bench grpo``'s own
(:func:`~padfree_plugins.benchmarks.preference.measure_batches`). Targets: at least 2× the padded run's real
tokens/s, activation memory at most 0.5×.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from padfree_plugins.benchmarks.lengths import Mixture, mixture_lengths
from padfree_plugins.benchmarks.measure import calls_seen, cost_weighted_ideal, seconds_alone, torch_threads
from padfree_plugins.benchmarks.preference import (
    GRPO_GENERATIONS,
    PreferenceRow,
    PreferenceSettings,
    Variant,
    drifted,
    measure_batches,
)
from padfree_plugins.benchmarks.vlm import TEXT_SHAPE
from padfree_plugins.errors import PadfreeError
from padfree_plugins.testing.vision import image_text_processor, synthetic_image, tiny_vision_language_model

VARIANTS = ("padded", "native", "shared")
MODEL_TYPE = "qwen2_5_vl"
#: Prompt text tokens (besides the images'), and answer tokens (chosen, rejected, or a GRPO completion).
PROMPT_TEXT: Mixture = ((1.0, 40, 0.8),)
ANSWERS: Mixture = ((1.0, 48, 1.0),)
LONGEST_ANSWER = 384
#: Image sizes in pixels (height, width): 16 to 96 visual tokens each (28-pixel merged cells).
IMAGE_SIZES = ((112, 112), (112, 224), (168, 224), (224, 224), (224, 336))
#: The targets: real tokens/s over padded, activation memory over padded.
TARGETS = {"speedup": 2.0, "memory_ratio": 0.5}
#: ``--quick``: the test suite's size.
QUICK = dict(batch_size=None, batches=1, rounds=1, text=dict(num_hidden_layers=1), longest_answer=64)


@dataclass
class VisionPreferenceSettings:
    trainer: str = "dpo"  # dpo or grpo
    batch_size: int | None = None  # DPO: pairs (default 8), GRPO: completions (default 16, 8 per prompt)
    batches: int = 3
    rounds: int = 3
    seed: int = 0
    threads: int | None = 1
    longest_answer: int = LONGEST_ANSWER
    #: The language model's shape (the vision tower stays tiny).
    text: dict = field(default_factory=lambda: dict(TEXT_SHAPE))

    def preference(self) -> PreferenceSettings:
        """The text benchmark's settings these rounds are measured with."""
        return PreferenceSettings(trainer=self.trainer, batch_size=self.batch_size, batches=self.batches,
                                  rounds=self.rounds, seed=self.seed, threads=self.threads)


@dataclass
class VisionPreferenceResult:
    settings: VisionPreferenceSettings
    rows: list[PreferenceRow]
    images: int  # over all batches, as often as the forwards compute them
    environment: dict[str, Any] = field(default_factory=dict)
    #: Per variant: the pixel rows (patches) its policy's vision tower encodes in one pass over the batches.
    tower_rows: dict[str, int] = field(default_factory=dict)
    #: What the components cost, measured in the timed rounds (:func:`measured_costs`): the vision tower alone per
    #: step (``native``, ``shared``), a pixel row's cost over a token's, and the ideal so weighted.
    costs: dict[str, Any] = field(default_factory=dict)

    def targets(self) -> dict[str, bool]:
        native = self.rows[1]
        return {"speed": native.speedup_vs_padded >= TARGETS["speedup"],
                "memory": native.memory_ratio <= TARGETS["memory_ratio"]}

    def to_json(self) -> str:
        return json.dumps({"settings": asdict(self.settings), "environment": self.environment, "targets": TARGETS,
                           "targets met": self.targets(), "images": self.images, "tower_rows": self.tower_rows,
                           "costs": self.costs, "rows": [asdict(row) for row in self.rows]}, indent=2)


# -- batches ---------------------------------------------------------------------------------------------------------


def _prompt(processor: Any, config: Any, generator: torch.Generator, seed: int, images: int) -> dict[str, Any]:
    """A prompt: random text tokens with ``images`` synthetic images at random places (their placeholders between
    ``<|vision_start|>`` and ``<|vision_end|>``), and their pixels and grids."""
    length = mixture_lengths(PROMPT_TEXT, 1, seed, 4, 512)[0]
    ids = torch.randint(3, config.vision_start_token_id, (length,), generator=generator).tolist()
    prompt: dict[str, Any] = {"images": images}
    if images:
        sizes = [IMAGE_SIZES[int(torch.randint(0, len(IMAGE_SIZES), (1,), generator=generator))]
                 for _ in range(images)]
        pixels = processor.image_processor(images=[synthetic_image(h, w, seed=seed + k)
                                                   for k, (h, w) in enumerate(sizes)], return_tensors="pt")
        prompt.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        merge = config.vision_config.spatial_merge_size ** 2
        places = sorted(torch.randint(0, len(ids) + 1, (images,), generator=generator).tolist())
        for where, grid in reversed(list(zip(places, pixels["image_grid_thw"]))):
            ids[where:where] = [config.vision_start_token_id, *[config.image_token_id] * (int(grid.prod()) // merge),
                                config.vision_end_token_id]
    prompt["ids"] = ids
    return prompt


def _answer(length: int, config: Any, eos: int, generator: torch.Generator) -> list[int]:
    return [*torch.randint(3, config.vision_start_token_id, (length - 1,), generator=generator).tolist(), eos]


def _right_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = torch.tensor(tokens), 1
    return ids, mask


def _media(prompts: list[dict]) -> dict[str, torch.Tensor]:
    """The prompts' images concatenated in row order (one prompt per row)."""
    with_images = [prompt for prompt in prompts if prompt["images"]]
    if not with_images:
        return {}
    return {key: torch.cat([prompt[key] for prompt in with_images]) for key in ("pixel_values", "image_grid_thw")}


def dpo_batch(processor: Any, config: Any, settings: VisionPreferenceSettings, index: int) -> dict[str, torch.Tensor]:
    """A batch as ``DataCollatorForVisionPreference`` returns it (see the module docstring)."""
    seed = settings.seed * 1000 + index
    generator = torch.Generator().manual_seed(seed)
    pairs = settings.batch_size or 8
    eos, pad = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    prompts = [_prompt(processor, config, generator, seed + 10 * k, k % 3) for k in range(pairs)]
    chosen, rejected = (mixture_lengths(ANSWERS, pairs, seed + offset, 2, settings.longest_answer)
                        for offset in (1, 2))
    rows = [prompt["ids"] + _answer(n, config, eos, generator) for prompt, n in zip(prompts, chosen)]
    rows += [prompt["ids"] + _answer(n, config, eos, generator) for prompt, n in zip(prompts, rejected)]
    ids, mask = _right_padded(rows, pad)
    completion = mask.clone()
    for row, prompt in enumerate(prompts * 2):
        completion[row, :len(prompt["ids"])] = 0
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion,
            "mm_token_type_ids": (ids == config.image_token_id).long(), **_media(prompts * 2)}


def grpo_batch(processor: Any, config: Any, settings: VisionPreferenceSettings, index: int) -> dict[str, Any]:
    """A generated GRPO batch as ``_generate_and_score_completions`` returns it, without the reference model's
    log-probabilities (:func:`with_reference_logps`)."""
    from trl.trainer.utils import pad

    seed = settings.seed * 1000 + index
    generator = torch.Generator().manual_seed(seed)
    completions = settings.batch_size or 16
    groups = completions // GRPO_GENERATIONS
    eos = processor.tokenizer.eos_token_id
    prompts = [prompt for k in range(groups)
               for prompt in [_prompt(processor, config, generator, seed + 10 * k, 1 + k % 2)] * GRPO_GENERATIONS]
    lengths = mixture_lengths(ANSWERS, completions, seed + 1, 2, settings.longest_answer)
    answers = [torch.tensor(_answer(n, config, eos, generator)) for n in lengths]
    prompt_ids = pad([torch.tensor(prompt["ids"]) for prompt in prompts], processor.tokenizer.pad_token_id, "left")
    prompt_mask = pad([torch.ones(len(prompt["ids"]), dtype=torch.long) for prompt in prompts], 0, "left")
    completion_ids = pad(answers, processor.tokenizer.pad_token_id, "right")
    completion_mask = pad([torch.ones(n, dtype=torch.long) for n in lengths], 0, "right")
    rewards = torch.randn(groups, GRPO_GENERATIONS, generator=generator)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    types = torch.cat([(prompt_ids == config.image_token_id).long(), torch.zeros_like(completion_ids)], dim=1)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages.reshape(-1),
            "num_items_in_batch": completion_mask.sum(), "num_images": [prompt["images"] for prompt in prompts],
            "mm_token_type_ids": types, **_media(prompts)}


def with_reference_logps(trainer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with the reference model's per-token log-probabilities as TRL's generation step computes them
    (padded, with the images), also as the old policy's."""
    media = {key: batch[key] for key in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
             if key in batch}
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.ref_model, input_ids, mask,
                                                           batch["completion_ids"].size(1), **media)[0]
    return {**batch, "ref_per_token_logps": logps, "old_per_token_logps": logps}


# -- trainers ----------------------------------------------------------------------------------------------------------


def build_trainer(settings: VisionPreferenceSettings, policy: Any, reference: Any, processor: Any,
                  reference_dir: str, output_dir: str) -> Any:
    """A TRL trainer on a copy of ``policy``, its dataset a stand-in with an image (the batches are given to
    ``compute_loss`` directly); DPO's reference a copy of ``reference``, GRPO's loaded from ``reference_dir``."""
    import datasets
    import trl

    model = copy.deepcopy(policy).train()
    common = dict(output_dir=output_dir, report_to=[], bf16=False, use_cpu=True, save_strategy="no",
                  seed=settings.seed)
    image = synthetic_image(56, 56)
    if settings.trainer == "dpo":
        pairs = datasets.Dataset.from_list([{"images": [image], "prompt": "a", "chosen": "b", "rejected": "c"}] * 2)
        return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(reference).eval(), train_dataset=pairs,
                              args=trl.DPOConfig(**common, per_device_train_batch_size=settings.batch_size or 8,
                                                 max_length=None, beta=0.1),
                              processing_class=copy.deepcopy(processor))
    model.config._name_or_path = reference_dir  # GRPO builds its reference model from the policy's path
    prompts = datasets.Dataset.from_list([{"images": [image], "prompt": "a"}] * GRPO_GENERATIONS)
    args = trl.GRPOConfig(**common, per_device_train_batch_size=settings.batch_size or 16,
                          num_generations=GRPO_GENERATIONS, max_completion_length=settings.longest_answer,
                          num_iterations=2, beta=0.04)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=prompts, processing_class=copy.deepcopy(processor))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def run_vision_preference_benchmark(settings: VisionPreferenceSettings,
                                    progress: Callable[[str], None] | None = None) -> VisionPreferenceResult:
    """Padded vs packed ``compute_loss`` + backward on the same image-text batches; see the module docstring."""
    from padfree_plugins.integrations.accelerate import accelerate

    if settings.trainer not in ("dpo", "grpo"):
        raise PadfreeError(f"unknown trainer {settings.trainer!r}; choose dpo or grpo")
    if settings.trainer == "grpo" and (settings.batch_size or 16) % GRPO_GENERATIONS:
        raise PadfreeError(f"--batch-size {settings.batch_size}: GRPO batches hold {GRPO_GENERATIONS} completions "
                           f"per prompt: give a multiple of {GRPO_GENERATIONS}")
    say = progress or (lambda _: None)
    with torch_threads(settings.threads), tempfile.TemporaryDirectory() as scratch:
        processor = image_text_processor(MODEL_TYPE, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 96)
        reference = tiny_vision_language_model(MODEL_TYPE, processor, seed=settings.seed, **settings.text).eval()
        policy = drifted(reference, 0.05, settings.seed + 1).train()
        reference.save_pretrained(Path(scratch) / "reference")
        variants: list[Variant] = []
        say(f"{settings.trainer} --vision: building the trainers ({', '.join(VARIANTS)})")
        try:
            for name in VARIANTS:
                trainer = build_trainer(settings, policy, reference, processor, str(Path(scratch) / "reference"),
                                        str(Path(scratch) / name))
                sharing = "on" if name == "shared" else "off"
                acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": sharing}) \
                    if name != "padded" else None
                variants.append((TowerTimed if acceleration is not None else Variant)(name, trainer, acceleration))
            config = policy.config
            if settings.trainer == "dpo":
                batches = [dpo_batch(processor, config, settings, index) for index in range(settings.batches)]
            else:
                batches = [with_reference_logps(variants[0].trainer, grpo_batch(processor, config, settings, index))
                           for index in range(settings.batches)]
            with tower_rows_seen([variant.trainer.model for variant in variants]) as seen:
                rows = measure_batches(settings.preference(), variants, batches, say)
            passes = settings.rounds + 1  # the untimed checked steps, then every timed round
            tower_rows = {variant.name: count // passes for variant, count in zip(variants, seen)}
            with_pixels_ideal(rows, tower_rows)
            costs = measured_costs(rows, variants, tower_rows)
        finally:
            for variant in variants:
                if variant.acceleration is not None:
                    variant.acceleration.undo()
    images = sum(int(batch["image_grid_thw"].shape[0]) for batch in batches if "image_grid_thw" in batch)
    import transformers
    import trl

    environment = {"trainer": {"dpo": "trl.DPOTrainer", "grpo": "trl.GRPOTrainer"}[settings.trainer],
                   "model": f"{type(policy).__name__} (language model {settings.text})", "torch": torch.__version__,
                   "trl": trl.__version__, "transformers": transformers.__version__, "device": "cpu",
                   "threads": settings.threads or torch.get_num_threads()}
    try:
        environment["load average (1, 5, 15 min)"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        pass
    return VisionPreferenceResult(settings, rows, images, environment, tower_rows, costs)


@contextmanager
def tower_rows_seen(models: list[Any]) -> Iterator[list[int]]:
    """Per model: the pixel rows (patches) its vision tower (``visual``) is given, summed over the block."""
    seen = [0] * len(models)
    handles = []
    for index, model in enumerate(models):
        def count(module: Any, args: tuple, kwargs: dict, index: int = index) -> None:
            seen[index] += int((args[0] if args else kwargs["hidden_states"]).shape[0])

        tower = getattr(getattr(model, "model", model), "visual")
        handles.append(tower.register_forward_pre_hook(count, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def vision_tower(model: Any) -> Any:
    return getattr(getattr(model, "model", model), "visual")


@dataclass
class TowerTimed(Variant):
    """A variant whose every timed step is followed (outside its time) by the vision towers the step ran, alone, on
    the pixel rows the step gave them (:func:`~padfree_plugins.benchmarks.measure.seconds_alone`): the policy's forward
    and backward, the reference model's (DPO) forward. What the towers cost beside the step, in the same rounds."""

    tower_seconds: list[float] = field(default_factory=list)  # per timed step, in order

    def timed_step(self, inputs: dict) -> float:
        reference = getattr(self.trainer, "ref_model", None)
        towers = [vision_tower(self.trainer.model)] + ([vision_tower(reference)] if reference is not None else [])
        with calls_seen(towers) as calls:
            seconds = super().timed_step(inputs)
        self.trainer.model.zero_grad(set_to_none=True)
        # the policy's tower trained (forward and backward), the reference's forward only
        self.tower_seconds.append(sum(seconds_alone(call, trained=call[0] is towers[0]) for call in calls))
        self.trainer.model.zero_grad(set_to_none=True)
        return seconds


def measured_costs(rows: list[PreferenceRow], variants: list[Variant], tower_rows: dict[str, int]) -> dict[str, Any]:
    """The ideal over ``native`` with each pixel row weighed by its measured cost: per round, a pixel row costs
    ``native``'s tower time over its pixel rows, a token the rest of ``native``'s step over its tokens; the ideal is
    ``native``'s time over what ``shared``'s tokens and pixel rows cost at those rates (medians over rounds). Beside it,
    the tower's own time per step (``native``, ``shared``) and a pixel row's cost over a token's. The ideal of
    :func:`with_pixels_ideal` (every pixel row weighed as a token) is unchanged."""
    by_name = {variant.name: variant for variant in variants}
    native, shared = by_name["native"], by_name["shared"]
    tokens = {row.variant: row.tokens_computed for row in rows}
    steps = len(native.tower_seconds) // len(native.seconds)  # timed steps per round (the batches)
    weighted, ratios = [], []
    for r, seconds in enumerate(native.seconds):
        tower = sum(native.tower_seconds[r * steps:(r + 1) * steps])
        weighted.append(cost_weighted_ideal(seconds, tower, (tokens["native"], tokens["shared"]),
                                            (tower_rows["native"], tower_rows["shared"])))
        ratios.append((tower / tower_rows["native"]) / ((seconds - tower) / tokens["native"]))
    return {"tower_ms_per_step": {variant.name: statistics.median(variant.tower_seconds) * 1e3
                                  for variant in (native, shared)},
            "step_ms": {variant.name: statistics.median(variant.seconds) / steps * 1e3 for variant in (native, shared)},
            "pixel_row_vs_token": statistics.median(ratios),
            "cost_weighted_ideal": statistics.median(weighted)}


def with_pixels_ideal(rows: list[PreferenceRow], tower_rows: dict[str, int]) -> None:
    """The ``shared`` row's ideal over ``native``: the tokens and pixel rows ``native``'s policy computes over those
    ``shared``'s computes (the text benchmark's counts tokens alone)."""
    native = next(row for row in rows if row.variant == "native")
    for row in rows:
        if row.variant == "shared":
            row.ideal_vs_native = (native.tokens_computed + tower_rows["native"]) / \
                (row.tokens_computed + tower_rows["shared"])


# -- output ----------------------------------------------------------------------------------------------------------


def markdown(result: VisionPreferenceResult) -> str:
    s, padded = result.settings, result.rows[0]
    unit = "pairs" if s.trainer == "dpo" else f"completions ({GRPO_GENERATIONS} per prompt)"
    head = (f"{result.environment['trainer']} compute_loss + backward on image-text batches, Qwen2.5-VL-shaped, "
            f"float32 cpu, {s.batch_size or (8 if s.trainer == 'dpo' else 16)} {unit} = {padded.rows} padded rows, "
            f"{s.batches} batches x {s.rounds} interleaved rounds, {result.images} images (as computed), "
            f"{padded.padding_fraction:.0%} padding: real tokens/s (the padded run's non-pad tokens), medians")
    costs = result.costs
    lines = ["| variant | real tok/s | step ms | vs padded | vs native (ideal: tokens + pixel rows) | ideal weighted by "
             "measured cost | tower pixel rows | activation MiB | memory vs padded | loss rel. diff | grad rel. diff | "
             "packed forwards |", "|" + " --- |" * 12]
    for row in result.rows:
        shared = row.variant == "shared"
        versus = f"{row.speedup_vs_native:.2f}x (ideal {row.ideal_vs_native:.2f}x)" if shared else "-"
        weighted = costs.get("cost_weighted_ideal") if shared else None
        weighted = f"{weighted:.2f}x ({row.speedup_vs_native / weighted:.0%} of it)" if weighted else "-"
        lines.append(f"| {row.variant} | {row.tokens_per_s:,.0f} | {row.step_ms:,.0f} | {row.speedup_vs_padded:.2f}x "
                     f"| {versus} | {weighted} | {result.tower_rows.get(row.variant, 0):,} "
                     f"| {row.memory_bytes / 2**20:,.1f} | {row.memory_ratio:.2f}x | {row.loss_rel_diff:.1e} | "
                     f"{row.grad_rel_diff:.1e} | {row.packed} |")
    met = ", ".join(f"{key} {'yes' if ok else 'no'}" for key, ok in result.targets().items())
    note = []
    if costs:
        tower, step = costs["tower_ms_per_step"], costs["step_ms"]
        note = [f"measured cost (medians over rounds): the vision tower alone, forward and backward (a reference's "
                f"forward too), {tower['native']:,.0f} ms per step native ({tower['native'] / step['native']:.0%} of "
                f"its {step['native']:,.0f} ms), {tower['shared']:,.0f} ms shared; a pixel row costs "
                f"{costs['pixel_row_vs_token']:.3f}x a token (the rest of native's step over its tokens). The ideal "
                "counts a pixel row as a token; weighted by these costs it is the column beside it", ""]
    return "\n".join([head, "", *lines, "", *note, f"targets (>= {TARGETS['speedup']}x real tokens/s, memory <= "
                      f"{TARGETS['memory_ratio']}x): {met}", f"environment: {json.dumps(result.environment)}", ""])


def write_outputs(result: VisionPreferenceResult, out: Path) -> dict[str, Path]:
    """``bench_<trainer>_vision.json`` and ``.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{result.settings.trainer}_vision"
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(result.to_json())
    paths["markdown"].write_text(markdown(result))
    return paths
