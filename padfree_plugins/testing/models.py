"""Tiny random transformers models built from configs (no hub), and random example batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: Vocabulary of the tiny configs; example token ids start at :data:`LOW_TOKEN` (below it: special tokens).
VOCAB = 128
LOW_TOKEN = 5
#: Example lengths that exercise what packing gets wrong: one-token examples (first and inside the row), two equal
#: lengths, one long example.
DEFAULT_LENGTHS = (1, 7, 7, 30, 1, 3)
#: The defaults of :func:`tiny_config`: 2 layers, d=64, 4 heads (as many key/value heads: override for GQA).
TINY_DEFAULTS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2)
#: Task name (or ``"base"``) -> the transformers auto class :func:`tiny_model` builds.
MODEL_CLASSES = {
    "base": "AutoModel",
    "hidden_states": "AutoModel",
    "embedding": "AutoModel",
    "causal_lm": "AutoModelForCausalLM",
    "seq_cls": "AutoModelForSequenceClassification",
    "reranker": "AutoModelForSequenceClassification",
}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny transformers config of ``model_type``: :data:`TINY_DEFAULTS` updated with ``overrides``.

    Config classes map the usual names to their own (GPT-2's ``n_embd`` …); a family that needs more (DistilBERT's
    ``hidden_dim``, ELECTRA's ``embedding_size``) takes it as an override."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_DEFAULTS, **overrides})


def model_class(task: Any) -> Any:
    """The transformers class for ``task``: a key of :data:`MODEL_CLASSES`, or a model class (returned as is)."""
    if not isinstance(task, str):
        return task
    import transformers

    if task not in MODEL_CLASSES:
        raise ValueError(f"no tiny model class for task {task!r}: use one of {', '.join(MODEL_CLASSES)}, or pass a "
                         "transformers model class")
    return getattr(transformers, MODEL_CLASSES[task])


def tiny_model(model_type_or_config: Any, task: Any = "hidden_states", *, seed: int = 0,
               attn_implementation: str | None = None, **overrides: Any) -> Any:
    """A randomly initialised tiny model in eval mode, fp32: ``torch.manual_seed(seed)`` (the global generator, so the
    same call gives the same weights) then ``<class>.from_config``.

    ``model_type_or_config``: a model type (built with :func:`tiny_config` and ``overrides``) or a transformers
    config (copied, ``overrides`` set on the copy). ``task``: ``"hidden_states"`` / ``"base"`` (``AutoModel``),
    ``"causal_lm"``, ``"seq_cls"`` (``*ForSequenceClassification``; ``num_labels`` as an override), or a model
    class. ``attn_implementation``: ``None`` lets transformers pick (sdpa where the model has it, else eager).
    """
    import copy

    if isinstance(model_type_or_config, str):
        config = tiny_config(model_type_or_config, **overrides)
    else:
        config = copy.deepcopy(model_type_or_config)
        for name, value in overrides.items():
            setattr(config, name, value)
    factory = model_class(task)
    torch.manual_seed(seed)
    if attn_implementation is None:
        model = factory.from_config(config)
    else:
        config._attn_implementation = attn_implementation
        model = factory.from_config(config, attn_implementation=attn_implementation)
    return model.float().eval()


def random_examples(lengths: Sequence[int] = DEFAULT_LENGTHS, vocab_size: int = VOCAB, seed: int = 0,
                    low: int = LOW_TOKEN) -> list[dict[str, list[int]]]:
    """Examples as a tokenized dataset yields them, ``[{"input_ids": [...]}, …]``: random ids in ``[low, vocab_size)``
    (ids below ``low`` are left to special tokens: padding, BOS, EOS), one example per length."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(low, vocab_size, (int(n),), generator=generator).tolist()} for n in lengths]


def vocab_size_of(model_or_config: Any) -> int:
    """The number of token ids a model (its input embeddings) or a config takes."""
    embeddings = model_or_config.get_input_embeddings() if hasattr(model_or_config, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def example_batch(model_or_config: Any = None, lengths: Sequence[int] = DEFAULT_LENGTHS, *, seed: int = 0,
                  labels: bool = False) -> list[dict[str, Any]]:
    """:func:`random_examples` for a model (or config): token ids within its vocabulary (:data:`VOCAB` without one).

    ``labels=True`` adds a class ``label`` per example (``i % num_labels``), as the ``seq_cls`` task trains on."""
    vocab = VOCAB if model_or_config is None else vocab_size_of(model_or_config)
    examples = random_examples(lengths, vocab, seed=seed, low=min(LOW_TOKEN, vocab - 1))
    if labels:
        config = getattr(model_or_config, "config", model_or_config)
        classes = int(getattr(config, "num_labels", 2) or 2)
        examples = [{**example, "label": i % classes} for i, example in enumerate(examples)]
    return examples
