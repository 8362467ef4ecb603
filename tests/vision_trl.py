"""Tiny vision-language models and conversational image-text data for TRL's trainers, one per family: a processor
built here with a chat template that writes each image part as the family's own image mark (the processor expands
it to the image's placeholders), and the family's tiny model. Shared by tests/test_trl_vision_families.py and
tests/test_trl_vision_rl.py."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from padfree_plugins.testing.vision import (
    gemma3_processor,
    image_text_processor,
    synthetic_image,
    tiny_gemma3_model,
    tiny_vision_language_model,
)

#: The text each family's processor expands to an image's placeholders.
QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_MARKS = {**{family: QWEN_MARK for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                                   "qwen3_5_moe")},
               "gemma3": "<start_of_image>", "idefics3": "<image>", "smolvlm": "<image>", "llava_onevision": "<image>"}
WORDS = "a tiny picture of the red square on a green field with some words about it and more".split()


def chat_template(mark: str) -> str:
    """``role: content`` lines, an image part written as ``mark``, the assistant's turn ending in ``</s>``."""
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{ content }}{%- else -%}"
        "{%- for part in content -%}"
        "{%- if part['type'] == 'image' -%}" + mark +
        "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{%- endmacro -%}"
        "{%- for message in messages -%}"
        "{{ message['role'] }}: "
        "{%- if message['role'] == 'assistant' -%}"
        "{% generation %}{{ render(message['content']) }}</s>{% endgeneration %}"
        "{%- else -%}{{ render(message['content']) }}{%- endif -%}"
        "{{ '\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}assistant: {%- endif -%}"
    )


@functools.lru_cache(maxsize=None)
def _built_processor(family: str) -> Any:
    processor = gemma3_processor() if family == "gemma3" else image_text_processor(family)
    processor.chat_template = chat_template(IMAGE_MARKS[family])
    return processor


def processor(family: str) -> Any:
    """A fresh copy each call: a trainer may change its processor."""
    return copy.deepcopy(_built_processor(family))


def model(family: str, seed: int = 0) -> Any:
    """The family's tiny model, in training mode."""
    if family == "gemma3":
        return tiny_gemma3_model(processor(family), seed=seed).train()
    return tiny_vision_language_model(family, processor(family), seed=seed).train()


def words(start: int, count: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(count))


def images(index: int) -> list:
    """0, 1 or 2 images of 28..84 pixels a side, every example its own."""
    return [synthetic_image(28 + 14 * ((index + k) % 5), 28 + 14 * ((2 * index + k) % 5), seed=10 * index + k)
            for k in range(index % 3)]


def pair(index: int, pictures: list) -> dict:
    """A conversational DPO pair whose prompt holds ``pictures``."""
    return {"images": pictures, "prompt": [{"role": "user", "content": words(index, 2 + index % 4)}],
            "chosen": [{"role": "assistant", "content": words(index + 3, 1 + index % 5)}],
            "rejected": [{"role": "assistant", "content": words(index + 5, 1 + (2 * index) % 6)}]}


def unpaired(index: int, pictures: list) -> dict:
    """A conversational KTO example whose prompt holds ``pictures``, desirable or not by its index."""
    return {"images": pictures, "prompt": [{"role": "user", "content": words(index, 2 + index % 4)}],
            "completion": [{"role": "assistant", "content": words(index + 3, 1 + (3 * index) % 6)}],
            "label": index % 3 != 1}


def prompt(index: int, pictures: list) -> dict:
    """A conversational GRPO / RLOO prompt with ``pictures`` (TRL puts them before the user's text)."""
    return {"images": pictures, "prompt": [{"role": "user", "content": words(index, 1 + index % 6)}]}


def fused_call(trainer: Any, batch: dict) -> tuple[dict, dict]:
    """TRL's fused call of DPO's ``_compute_loss`` on ``batch``: the per-token outputs and the policy's gradients."""
    trainer.model.zero_grad()
    kwargs = {key: value for key, value in batch.items() if key != "completion_mask"}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    output = trainer.model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True)
    (output.log_probs.sum() + output.log_probs[:, ::3].sum()).backward()
    values = {key: output[key].detach().clone() for key in ("log_probs", "entropy") if output.get(key) is not None}
    grads = {name: param.grad.clone() for name, param in trainer.model.named_parameters() if param.grad is not None}
    return values, grads
