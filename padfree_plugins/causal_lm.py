"""Causal-LM packing: labels default to ``input_ids``, and every example must fit the model's positions.

The packing itself is :class:`~padfree_plugins.collator.PackingCollator`'s (labels travel per token and each
example's first label is set to -100, so that the shifted loss never trains an example to continue the one
before it). This module adds what a causal-LM dataset needs on top:

* **labels from input_ids** when the examples carry no ``labels`` (what ``DataCollatorForLanguageModeling``
  and ``DataCollatorWithFlattening`` do); user labels, including -100 masks for prompts or user turns
  (completion-only / assistant-only loss), are kept as they are;
* **the model's limit**: an example longer than ``max_position_embeddings`` (minus the architecture's first
  position) is an error that says what to do, instead of an index error or silent extrapolation mid-training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .batch import PackedBatch
from .collator import DEFAULT_TOKEN_KEYS, PackingCollator, WrapsPackingCollator
from .config import PadfreeConfig
from .errors import BatchError, ConfigError
from .specs import Architecture, Task

#: ``task_options`` of the ``causal_lm`` task, with their defaults.
OPTIONS = {"labels_from_input_ids": True}


def model_token_limit(model_config: Any, position_start: int = 0) -> int | None:
    """The longest example the model's position table takes (``None`` when the config states no limit)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(text_config, "max_position_embeddings", None)
    return int(limit) - int(position_start) if isinstance(limit, int) and limit > 0 else None


@dataclass
class CausalLMCollator(WrapsPackingCollator):
    """The ``causal_lm`` collator: a :class:`PackingCollator` plus default labels and the model-limit check.

    ``model_limit`` (set when the acceleration config gives no ``max_length``) is checked before packing so that
    the message names the model's limit; ``limit_source`` says where it comes from.
    """

    packing: PackingCollator
    labels_from_input_ids: bool = True
    model_limit: int | None = None
    limit_source: str = ""

    def overlong_message(self, index: int, length: int, where: str = "") -> str:
        """The error for an example longer than :attr:`max_length` (also used by the dataset check)."""
        if self.model_limit is not None:
            return (
                f"example {index}{where} has {length} tokens but the model takes at most {self.model_limit} "
                f"({self.limit_source}); truncate it when tokenizing, or set max_length: {self.model_limit} and "
                "on_overlong: truncate in the acceleration config"
            )
        return (
            f"example {index}{where} has {length} tokens, more than max_length={self.max_length}; truncate it when "
            "tokenizing or set on_overlong: truncate in the acceleration config"
        )

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        if isinstance(examples, Sequence) and all(isinstance(ex, Mapping) for ex in examples):
            if self.model_limit is not None and self.on_overlong == "error":
                for i, ex in enumerate(examples):
                    ids = ex.get("input_ids")
                    if ids is not None and getattr(ids, "ndim", 1) == 1 and len(ids) > self.model_limit:
                        raise BatchError(self.overlong_message(i, len(ids)))
            if self.labels_from_input_ids and examples and all(ex.get("labels") is None for ex in examples):
                examples = [{**ex, "labels": ex["input_ids"]} for ex in examples]
        return self.packing(examples)


def causal_lm_collator(task: Task, architecture: Architecture, model_config: Any,
                       config: PadfreeConfig) -> CausalLMCollator:
    """The collator for the ``causal_lm`` task, from the resolved specs and the acceleration config."""
    from .builtin.task_options import read_options

    options = read_options(task.name, config.task_options, OPTIONS, {"labels_from_input_ids": (True, False)})
    start = int(architecture.position_start(model_config))
    limit = model_token_limit(model_config, start)
    source = f"{type(model_config).__name__}.max_position_embeddings={limit + start}" if limit else ""
    if config.max_length is not None and limit is not None and config.max_length > limit:
        raise ConfigError(
            f"max_length: {config.max_length} is more than the model takes ({limit} tokens, {source}); "
            f"set max_length to at most {limit}"
        )
    required = tuple(dict.fromkeys((*task.required_keys, *(() if options["labels_from_input_ids"] else ("labels",)))))
    packing = PackingCollator(
        position_start=start,
        token_keys=tuple(dict.fromkeys((*DEFAULT_TOKEN_KEYS, *task.token_keys))),
        example_keys=task.example_keys,
        required_keys=required,
        max_length=config.max_length if config.max_length is not None else limit,
        on_overlong=config.on_overlong,
        masked_first_keys=task.masked_first_keys,
    )
    return CausalLMCollator(packing, options["labels_from_input_ids"],
                            model_limit=limit if config.max_length is None else None, limit_source=source)
