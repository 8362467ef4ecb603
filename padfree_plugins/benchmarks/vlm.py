"""The vision-language benchmark (``padfree-plugins bench vlm``): a tiny Qwen2.5-VL-shaped model trained on
image-text batches, padded vs padding-free, on the same batches and weights, measured in one run.

Every example is a text of lognormal length (:func:`~padfree_plugins.benchmarks.lengths.mixture_lengths`) with
0, 1 or 2 synthetic images of mixed sizes (their placeholder tokens where the processor puts them, their pixels
made by the family's image processor); labels are the text tokens (placeholders get none).

* ``padded``: the batch padded on the right (``attention_mask``, ``mm_token_type_ids``, pixels concatenated in
  example order), the unpatched model — transformers computes each row's mRoPE positions itself;
* ``padfree``: the assembly's multimodal collator (one packed row, per-example mRoPE) and the patched model.

What is timed is one training step's forward and backward (the loss summed over labelled tokens, divided by their
count). Real tokens are the examples' tokens, text and image placeholders; padding is never counted. Memory is the
activations autograd keeps for the backward (:func:`~padfree_plugins.benchmarks.measure.saved_activation_bytes`).
Rounds rotate the order of the variants; figures are medians, speedups taken within a round.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from padfree_plugins.assembly import assemble
from padfree_plugins.benchmarks.lengths import Mixture, mixture_lengths
from padfree_plugins.benchmarks.measure import saved_activation_bytes, torch_threads
from padfree_plugins.testing.vision import image_text_processor, synthetic_image, tiny_vision_language_model

VARIANTS = ("padded", "padfree")
#: The default language model: 4 layers, d=256, GQA 8/2 heads.
TEXT_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2)
#: ``--quick``: the test suite's size.
QUICK = dict(batch_size=4, batches=1, rounds=1, longest_text=64, text=dict(num_hidden_layers=1))
#: Text lengths (tokens besides the images'): a lognormal law with a long tail, as instruction data.
TEXT_LENGTHS: Mixture = ((1.0, 48, 0.9),)
#: Image sizes (height, width in pixels) drawn for the examples' images: 4 to 24 visual tokens each.
IMAGE_SIZES = ((56, 56), (56, 112), (112, 84), (84, 168), (168, 112))


@dataclass
class VLMSettings:
    model_type: str = "qwen2_5_vl"
    batch_size: int = 16
    batches: int = 3
    rounds: int = 3
    seed: int = 0
    threads: int | None = 1
    longest_text: int = 384
    #: The language model's shape (the vision tower stays tiny, as it is small beside a real VLM's language model).
    text: dict = field(default_factory=lambda: dict(TEXT_SHAPE))


@dataclass
class VLMRow:
    variant: str
    real_tokens_per_s: float
    step_s: float
    speedup: float
    share_of_ideal: float
    activation_mib: float
    memory_vs_padded: float
    loss: float
    loss_rel_diff: float


@dataclass
class VLMResult:
    settings: VLMSettings
    padding_fraction: float
    ideal_speedup: float
    images_per_batch: float
    rows: list[VLMRow] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def image_text_batch(processor: Any, model: Any, settings: VLMSettings, index: int) -> list[dict]:
    """``batch_size`` examples: random text tokens of lognormal lengths, each example with 0, 1 or 2 images whose
    placeholders (``<|vision_start|>``, its image tokens, ``<|vision_end|>``) sit at random places in the text."""
    config = model.config
    seed = settings.seed * 1000 + index
    generator = torch.Generator().manual_seed(seed)
    lengths = mixture_lengths(TEXT_LENGTHS, settings.batch_size, seed, 4, settings.longest_text)
    vocab_low, vocab_high = 3, processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    merge = config.vision_config.spatial_merge_size ** 2
    examples = []
    for length in lengths:
        ids = torch.randint(vocab_low, vocab_high, (length,), generator=generator).tolist()
        count = int(torch.randint(0, 3, (1,), generator=generator))
        images = [synthetic_image(*IMAGE_SIZES[int(torch.randint(0, len(IMAGE_SIZES), (1,), generator=generator))],
                                  seed=seed) for _ in range(count)]
        example: dict[str, Any] = {}
        if images:
            pixels = processor.image_processor(images=images, return_tensors="pt")
            example.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
            places = sorted(torch.randint(0, len(ids) + 1, (count,), generator=generator).tolist())
            for where, grid in reversed(list(zip(places, pixels["image_grid_thw"]))):  # the text keeps their order
                tokens = [config.image_token_id] * (int(grid.prod()) // merge)
                ids[where:where] = [config.vision_start_token_id, *tokens, config.vision_end_token_id]
        example["input_ids"] = ids
        examples.append(example)
    return examples


def padded_batch(examples: list[dict], config: Any, pad: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``labels`` / ``attention_mask`` / ``mm_token_type_ids``, pixels concatenated."""
    width = max(len(example["input_ids"]) for example in examples)
    ids = torch.full((len(examples), width), pad)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, :len(example["input_ids"])] = torch.tensor(example["input_ids"])
        mask[row, :len(example["input_ids"])] = 1
    image = ids == config.image_token_id
    labels = ids.masked_fill((mask == 0) | image, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": image.long()}
    with_images = [example for example in examples if "pixel_values" in example]
    if with_images:
        batch["pixel_values"] = torch.cat([example["pixel_values"] for example in with_images])
        batch["image_grid_thw"] = torch.cat([example["image_grid_thw"] for example in with_images])
    return batch


def step_loss(model: Any, batch: dict, assembly: Any = None) -> torch.Tensor:
    """The model's own loss: the mean over labelled tokens."""
    output = assembly.forward(model, batch) if assembly is not None else model(**batch)
    return output.loss


def run_vlm_benchmark(settings: VLMSettings, progress: Callable[[str], None] | None = None) -> VLMResult:
    """Padded vs padding-free steps on the same batches; ``progress`` gets a line a stage and a round."""
    say = progress or (lambda _: None)
    with torch_threads(settings.threads):
        processor = image_text_processor(settings.model_type, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 96)
        reference = tiny_vision_language_model(settings.model_type, processor, **settings.text).train()
        padfree_model = copy.deepcopy(reference)
        assembly = assemble(padfree_model, {"task": "causal_lm"})
        try:
            return _measure(settings, processor, reference, padfree_model, assembly, say)
        finally:
            assembly.undo()


def _measure(settings: VLMSettings, processor: Any, reference: Any, padfree_model: Any, assembly: Any,
             say: Callable[[str], None]) -> VLMResult:
    config = reference.config
    say(f"model built; {settings.batches} batches of {settings.batch_size} image-text examples")
    pad = processor.tokenizer.pad_token_id
    batches = [image_text_batch(processor, reference, settings, index) for index in range(settings.batches)]
    inputs = {"padded": [padded_batch(examples, config, pad) for examples in batches],
              "padfree": [assembly.collator(examples) for examples in batches]}
    models = {"padded": reference, "padfree": padfree_model}
    runs = {"padded": lambda batch: step_loss(reference, batch),
            "padfree": lambda batch: step_loss(padfree_model, batch, assembly)}
    real = sum(sum(len(example["input_ids"]) for example in examples) for examples in batches)
    slots = sum(batch["input_ids"].numel() for batch in inputs["padded"])
    losses = {variant: [] for variant in VARIANTS}
    memory = {variant: [] for variant in VARIANTS}
    for variant in VARIANTS:  # untimed: warm-up, loss and memory
        say(f"{variant}: untimed steps (warm-up, loss, memory)")
        for batch in inputs[variant]:
            models[variant].zero_grad()
            loss_value = []
            memory[variant].append(saved_activation_bytes(lambda: loss_value.append(runs[variant](batch)) or
                                                          loss_value[-1]))
            losses[variant].append(float(loss_value[-1].detach()))
    times = {variant: [] for variant in VARIANTS}
    for round_index in range(settings.rounds):
        order = VARIANTS[round_index % 2:] + VARIANTS[:round_index % 2]
        for variant in order:
            start = time.perf_counter()
            for batch in inputs[variant]:
                models[variant].zero_grad()
                runs[variant](batch).backward()
            times[variant].append(time.perf_counter() - start)
        say(f"round {round_index + 1}/{settings.rounds}: "
            + ", ".join(f"{variant} {real / times[variant][-1]:,.0f} tok/s" for variant in VARIANTS))
    padding = 1 - real / slots
    result = VLMResult(settings, padding, 1 / (1 - padding),
                       sum(int(b["image_grid_thw"].shape[0]) if "image_grid_thw" in b else 0
                           for b in inputs["padded"]) / len(batches))
    for variant in VARIANTS:
        speedups = [padded / mine for padded, mine in zip(times["padded"], times[variant])]
        step = statistics.median(times[variant]) / len(batches)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses[variant], losses["padded"]))
        result.rows.append(VLMRow(
            variant, real / len(batches) / step, step, statistics.median(speedups),
            statistics.median(speedups) / result.ideal_speedup, statistics.mean(memory[variant]) / 2 ** 20,
            statistics.mean(memory[variant]) / statistics.mean(memory["padded"]),
            statistics.mean(losses[variant]), rel))
    return result


def markdown(result: VLMResult) -> str:
    settings = result.settings
    lines = [f"{settings.model_type}-shaped tiny model, bs{settings.batch_size}, {result.images_per_batch:.1f} images "
             f"per batch, {100 * result.padding_fraction:.0f}% padding (ideal {result.ideal_speedup:.2f}x)", "",
             "| variant | real tok/s | speedup | of ideal | activation MiB | vs padded | loss rel. diff |",
             "|---|---|---|---|---|---|---|"]
    for row in result.rows:
        lines.append(f"| {row.variant} | {row.real_tokens_per_s:,.0f} | {row.speedup:.2f}x | "
                     f"{100 * row.share_of_ideal:.0f}% | {row.activation_mib:.1f} | {row.memory_vs_padded:.2f}x | "
                     f"{row.loss_rel_diff:.1e} |")
    return "\n".join(lines) + "\n"


def write_outputs(result: VLMResult, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_vlm.json", "markdown": out / "bench_vlm.md"}
    paths["json"].write_text(result.to_json())
    paths["markdown"].write_text(markdown(result))
    return paths
