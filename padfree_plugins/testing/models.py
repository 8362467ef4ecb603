"""Tiny random transformers models built from configs (no hub), and random example batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from padfree_plugins.testing import vision

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
#: Routed experts: 4, two per token, each of width 32 (the families' own defaults hold 60-256 experts).
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
#: DeepSeek-style MoE (DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, Mistral 4): layer 0 dense, then 4 routed experts plus
#: a shared one; :data:`_GROUPED` for the families that route within expert groups.
_DEEPSEEK_EXPERTS = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                         first_k_dense_replace=1)
_GROUPED = dict(n_group=2, topk_group=1)
#: Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral 4) at d=64: latent ranks 16 / 32, query and
#: key heads of 16 + 8 dims, values of 12 (the defaults: 512 / 1536, 128 + 64, 128).
_MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
#: Gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next): a linear-attention layer on each side of a full-attention one.
_GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, head_dim=16, num_key_value_heads=2, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"])
#: Gemma 3n / Gemma 4 per-layer inputs: a table over :data:`VOCAB` ids, 8 wide (the defaults: 262,144 x 256).
_PER_LAYER_INPUTS = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
#: Model type -> what its tiny config needs on top of :data:`TINY_DEFAULTS`, for the families whose own defaults are
#: not tiny (routed experts, per-layer embedding tables) or do not build at d=64 (Mamba2's heads, a head size the
#: config cannot derive). Every model type a builtin plugin declares builds with :func:`tiny_model` (test_testing_models).
#: Config keys that list one entry per layer: given one, a caller also gives the number of layers.
LAYER_LISTS = ("layer_types", "layers_block_type")

TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {**_MLA, **_DEEPSEEK_EXPERTS, **_GROUPED},
    "deepseek_v3": {**_MLA, **_DEEPSEEK_EXPERTS, **_GROUPED},
    "embedding_gemma2": dict(text_config={**TINY_DEFAULTS, "head_dim": 16, "embedding_dim": 32,
                                          "hidden_size_per_layer_input": 8}),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                         moe_layer_start_index=1),
    "gemma3n_text": dict(num_hidden_layers=3, head_dim=16, layer_types=["sliding_attention", "full_attention",
                                                                        "sliding_attention"],
                         num_kv_shared_layers=1, activation_sparsity_pattern=[0.95, 0.0, 0.0], laurel_rank=8,
                         **_PER_LAYER_INPUTS),
    "gemma4_text": dict(head_dim=16, global_head_dim=32, **_PER_LAYER_INPUTS),
    "glm4_moe": {**_DEEPSEEK_EXPERTS, **_GROUPED},
    "glm4_moe_lite": {**_MLA, **_DEEPSEEK_EXPERTS},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "hunyuan_v1_dense": dict(head_dim=16),
    "kimi_linear": dict(num_hidden_layers=3, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"], num_local_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, num_dense_layers=1,
                     **_EXPERTS),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, conv_kernel=4, expand=1, n_groups=2, chunk_size=16),
    "minimax_m2": dict(head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2),
    "mistral4": {**_MLA, **_DEEPSEEK_EXPERTS},
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "moe", "mamba"], num_hidden_layers=4, head_dim=16,
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, expand=1,
                       chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(**_EXPERTS, shared_expert_intermediate_size=32),
    "qwen3_5_moe_text": dict(**_GATED_DELTA, **_EXPERTS, shared_expert_intermediate_size=32),
    "qwen3_5_text": _GATED_DELTA,
    "qwen3_moe": _EXPERTS,
    "qwen3_next": dict(**_GATED_DELTA, **_EXPERTS, shared_expert_intermediate_size=32),
    "roc_bert": dict(shape_vocab_size=64, shape_embed_dim=16, pronunciation_vocab_size=64, pronunciation_embed_dim=16),
}
#: Model types that transformers' ``AutoModel`` does not build (SigLIP's text towers): their base model class.
BASE_CLASSES = {"siglip_text_model": "SiglipTextModel", "siglip2_text_model": "Siglip2TextModel"}
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
    """A tiny transformers config of ``model_type``: :data:`TINY_DEFAULTS`, then the family's :data:`TINY_FAMILIES`
    entry, then ``overrides``. A vision-language family's config is :mod:`padfree_plugins.testing.vision`'s
    (``overrides`` go to its text config), its special token ids those of the family's tiny processor.

    Config classes map the usual names to their own (GPT-2's ``n_embd`` …); a family that needs more (DistilBERT's
    ``hidden_dim``, ELECTRA's ``embedding_size``) takes it as an override."""
    from transformers import AutoConfig

    if model_type in VISION_LANGUAGE:
        return _vision_language_config(model_type, **overrides)
    family = dict(TINY_FAMILIES.get(model_type, {}))
    if any(key in overrides for key in LAYER_LISTS) and "num_hidden_layers" not in overrides:
        family.pop("num_hidden_layers", None)  # the caller's list of layers decides how many there are
        overrides = {**overrides, "num_hidden_layers": len(next(overrides[k] for k in LAYER_LISTS if k in overrides))}
    return AutoConfig.for_model(model_type, **{**TINY_DEFAULTS, **family, **overrides})


#: The image-text families with a tiny config and processor in :mod:`padfree_plugins.testing.vision`.
VISION_LANGUAGE = (*vision.FAMILIES, *vision.TILED, *vision.ANY_RESOLUTION, "gemma3")


def _vision_language_config(model_type: str, **text_overrides: Any) -> Any:
    if model_type == "gemma3":
        return vision.tiny_gemma3_config(vision.gemma3_processor(), **text_overrides)
    return vision.tiny_vision_language_config(model_type, vision.image_text_processor(model_type),
                                              **text_overrides)


def model_class(task: Any, model_type: str | None = None) -> Any:
    """The transformers class for ``task``: a key of :data:`MODEL_CLASSES`, or a model class (returned as is); for a
    base model of a type ``AutoModel`` does not build, its :data:`BASE_CLASSES` class."""
    if not isinstance(task, str):
        return task
    import transformers

    if task not in MODEL_CLASSES:
        raise ValueError(f"no tiny model class for task {task!r}: use one of {', '.join(MODEL_CLASSES)}, or pass a "
                         "transformers model class")
    if MODEL_CLASSES[task] == "AutoModel" and model_type in BASE_CLASSES:
        return getattr(transformers, BASE_CLASSES[model_type])
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
    factory = model_class(task, config.model_type)
    build = factory.from_config if hasattr(factory, "from_config") else factory._from_config  # auto or model class
    torch.manual_seed(seed)
    if attn_implementation is None:
        model = build(config)
    else:
        config._attn_implementation = attn_implementation
        model = build(config, attn_implementation=attn_implementation)
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
