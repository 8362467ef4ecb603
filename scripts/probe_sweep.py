#!/usr/bin/env python
"""Sweep transformers' decoder-only and encoder-only text model types through ``architecture: probe``, and check
every verdict against the ground truth: packed training vs padded training.

For every model type of ``CONFIG_MAPPING`` that is decoder-only or encoder-only text, a tiny random model is built
(2 layers, hidden 64, 4 heads, vocab 128, small MLP; the family's features switched on where its config has them:
a sliding window shorter than the examples, ``layer_types`` mixing its layer kinds, a few experts, MLA ranks …) and:

1. **the verdict**: ``assemble(model, {"task": ..., "architecture": "probe", "plugins": {"block": [<declaring
   plugin>]}})`` — accepted, or refused with the first clause of the reason. Blocking the declaring plugin sends
   declared model types through the probe too.
2. **the ground truth**, in fp32 and training mode (dropout 0): the examples packed into one row through the
   assembly, against the same examples right-padded with an attention mask (``-100`` labels on padding), and
   against each example alone (which checks the padded reference itself). The loss is the causal-LM loss for a
   decoder with an LM head, else a fixed random projection of ``last_hidden_state`` summed over the real tokens.
   Reported: the loss's relative difference and the largest gradient difference over all parameters.
   An accepted type whose packed training differs from padded (and from alone) by more than 1e-5 (loss, relative)
   or 1e-4 (gradients) is a **fooled probe**.
3. for a refused type (unless ``--no-refused``): the same ground truth with the probe bypassed (``attention:
   exact``), which counts refusals of types that would have packed exactly.

Run from the repository root (one process, one thread; tiny models only)::

    .venv/bin/python scripts/probe_sweep.py --out docs/probe-sweep.md
    .venv/bin/python scripts/probe_sweep.py --types llama,lfm2,phimoe        # a subset, report on stdout
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import inspect
import logging
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

#: Example lengths of the ground truth (each declared window / chunk adds one within and one straddling it).
LENGTHS = (1, 13, 6, 20, 2, 6)
#: Beyond these, an accepted type's packed training differs from padded: a fooled probe.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4
#: And per-token outputs (logits / hidden states) relative to each example's largest: stricter than the loss, which
#: a random tiny model's near-uniform predictions make insensitive (a leak moves it by 1e-7 where logits move 1e-3).
OUTPUT_RTOL = 1e-4
#: Ground-truth token ids start here (below: the tiny configs' special tokens).
LOW_TOKEN = 5
VOCAB = 128
#: Sizes of the tiny configs (set through each config class's attribute_map, as padfree_plugins.testing does).
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, pad_token_id=1, bos_token_id=0, eos_token_id=2)
#: A window / chunk shorter than the examples of 13 and 20 tokens.
WINDOW = 8
#: Sub-configs that do not make a config multimodal.
TEXT_SUB_CONFIGS = {"attn_config", "ffn_config", "esmfold_config"}

# -- tiny configs -----------------------------------------------------------------------------------------------

#: (config attribute names, value) applied when the default config has the attribute (as an int unless noted).
SIZE_RULES: list[tuple[tuple[str, ...], Any]] = [
    (("d_model", "n_embd", "n_embed", "embed_dim", "model_dim", "d_embed", "dim", "hidden_size"), 64),
    (("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers"), 2),
    (("num_attention_heads", "num_heads", "n_head", "n_heads", "n_attn_heads", "decoder_attention_heads"), 4),
    (("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_key_value_groups_heads"),
     2),
    (("intermediate_size", "ffn_dim", "ffn_hidden_size", "d_ff", "n_inner", "inner_dim", "intermediate_dim",
      "mlp_dim", "dim_feedforward", "intermediate_size_mlp", "dense_intermediate_size", "hidden_act_dim"), 128),
    (("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size", "moe_ffn_hidden_size",
      "expert_ffn_dim", "moe_dim", "expert_hidden_size", "shared_intermediate_size",
      "moe_shared_expert_intermediate_size"), 32),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_moe_experts", "n_experts",
      "num_routed_experts"), 4),
    (("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "top_k", "moe_k",
      "n_activated_experts", "num_selected_experts", "experts_per_token", "router_top_k"), 2),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "shared_expert_count"), 1),
    (("n_group", "topk_group", "num_expert_group"), 1),
    (("first_k_dense_replace", "num_dense_layers", "first_dense_layers", "moe_layer_start_index"), 1),
    (("decoder_sparse_step", "moe_layer_freq", "moe_every_n_layers", "expert_interval"), 1),
    (("head_dim", "attention_head_dim", "kv_channels", "attention_head_size", "d_head", "v_head_dim",
      "qk_head_dim"), 16),
    (("kv_lora_rank",), 16),
    (("q_lora_rank",), 32),
    (("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    (("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length", "n_ctx",
      "max_trained_positions"), 256),
    (("sliding_window", "window_size", "local_window_size", "sliding_window_size", "swa_window", "local_attention",
      "attention_chunk_size", "local_window"), WINDOW),
    (("max_window_layers",), 1),
    (("global_attn_every_n_layers", "sliding_window_pattern", "global_attention_every", "sliding_window_period"), 2),
    (("embedding_size", "embedding_dim", "word_embed_proj_dim", "proj_dim"), 32),
    (("state_size", "ssm_state_size", "mamba_d_state", "d_state", "linear_state_size"), 16),
    (("mamba_n_heads", "mamba_num_heads", "linear_num_value_heads"), 8),
    (("linear_num_key_heads",), 4),
    (("mamba_d_head", "mamba_head_dim", "linear_key_head_dim", "linear_value_head_dim"), 16),
    (("n_groups", "mamba_n_groups"), 1),
    (("mamba_d_ssm",), 128),
    (("vocab_size_per_layer_input",), VOCAB),
    (("hidden_size_per_layer_input", "laurel_rank"), 16),
    (("num_kv_shared_layers",), 0),
    (("rotary_dim",), 8),
    (("coordinate_size",), 12),
    (("shape_size",), 8),
    (("time_step_rank", "dt_rank"), 8),
    (("mamba_chunk_size", "chunk_size", "linear_chunk_size"), 16),
    (("type_vocab_size",), 2),
    (("num_buckets",), 8),
    (("attn_layer_period",), 2),
    (("attn_layer_offset", "expert_layer_offset"), 1),
    (("expert_layer_period",), 2),
]
#: Flags switched on / off where the config has them.
FLAG_RULES = {"use_sliding_window": True, "output_router_logits": False, "use_cache": False,
              "router_jitter_noise": 0.0, "jitter_noise": 0.0, "gradient_checkpointing": False,
              "torchscript": False}
DROPOUT = re.compile(r"dropout|pdrop|drop_rate|_drop$|drop_prob|drop_path")
#: Per-type overrides on top of the generic rules (families whose tiny config needs more).
FAMILY = {
    "distilbert": dict(dim=64, hidden_dim=128, n_heads=4, n_layers=2),
    "funnel": dict(block_sizes=[1, 1], block_repeats=[1, 1], d_head=16, d_inner=128, n_head=4),
    "reformer": dict(attn_layers=["local", "lsh"], axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32],
                     feed_forward_size=128, attention_head_size=16, local_attn_chunk_length=WINDOW,
                     lsh_attn_chunk_length=WINDOW, num_hashes=1, max_position_embeddings=256),
    "xlnet": dict(d_inner=128, n_head=4, d_head=16),
    "longformer": dict(attention_window=[WINDOW, WINDOW]),
    "big_bird": dict(block_size=4, num_random_blocks=2, attention_type="original_full"),
    "transfo-xl": dict(d_embed=64, div_val=1, cutoffs=[]),
    "tapas": dict(type_vocab_sizes=[2, 2, 2, 2, 2, 2, 2]),
    "mra": dict(max_position_embeddings=258),
    "fnet": dict(use_tpu_fourier_optimizations=False),
    "rwkv": dict(attention_hidden_size=64, intermediate_size=128, context_length=256),
    "ctrl": dict(dff=128),
    "gpt_neox_japanese": dict(intermediate_multiple_size=2),
    "cpmant": dict(dim_model=64, dim_ff=128, num_heads=4, dim_head=16, prompt_length=4, segment_types=4),
    "squeezebert": dict(embedding_size=64, q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1,
                        intermediate_groups=1, output_groups=1),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, expand=2),
    "zaya": dict(num_experts_per_tok=1),
    "mistral4": dict(head_dim=16, qk_head_dim=16),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2, "hidden_size": 64}),
    "xlstm": dict(embedding_dim=64, num_blocks=2, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0,
                  chunk_size=16),
}


def per_layer_lengths(config: Any) -> int | None:
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


#: Keys set even where the default is None: a declared window, chunk or local attention the family can switch on,
#: and sizes a None default leaves to the model (which may then fail: head_dim ** -0.5).
SWITCHED_ON = {"sliding_window", "attention_chunk_size", "local_attention", "head_dim", "num_experts_per_tok",
               "moe_intermediate_size", "n_routed_experts", "n_shared_experts"}


@functools.lru_cache(maxsize=None)
def family_source(model_type: str) -> str:
    """The source of a family's configuration and modeling modules."""
    import importlib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    module = inspect.getmodule(CONFIG_MAPPING[model_type])
    source = inspect.getsource(module)
    with contextlib.suppress(Exception):
        source += inspect.getsource(importlib.import_module(module.__name__.replace(".configuration_", ".modeling_")))
    return source


@functools.lru_cache(maxsize=None)
def layer_kinds(model_type: str) -> tuple[str, ...]:
    """The layer kinds (transformers' ``ALLOWED_ATTN_LAYER_TYPES``) a family's configuration and modeling source
    name: what its ``layer_types`` can mix."""
    from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES

    source = family_source(model_type)
    found = dict.fromkeys(s for s in re.findall(r"[\"'](\w+)[\"']", source) if s in ALLOWED_ATTN_LAYER_TYPES)
    others = [k for k in found if k != "full_attention"]
    return tuple(others[:3] + (["full_attention"] if "full_attention" in found else []))


def tiny_kwargs(model_type: str, default: Any, kinds: list[str] | None, kind: str = "decoder") -> dict[str, Any]:
    """The overrides that make ``default`` (the config class's defaults) tiny, with its features switched on;
    ``kinds``: the layer_types to build (one layer each), or None to leave them to the config."""
    values = default.to_dict()
    names = set(values) | set(getattr(type(default), "attribute_map", {}))
    kwargs = dict(TINY)
    for keys, value in SIZE_RULES:
        for key in keys:
            if key in values and ((isinstance(values[key], int) and not isinstance(values[key], bool))
                                  or (key in SWITCHED_ON and values[key] is None)):
                kwargs[key] = value
    if kind == "encoder" and "num_key_value_heads" in values:
        kwargs["num_key_value_heads"] = 4
    if "hidden_size" not in names and "dim" in values and "hidden_dim" in values:  # DistilBERT-shaped
        kwargs["hidden_dim"] = 128
    if "kv_lora_rank" in values:  # MLA: rope on qk_rope_head_dim, which head_dim names for the rotary embedding
        kwargs.update(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
        if "num_key_value_heads" in values:
            kwargs["num_key_value_heads"] = 4  # MLA keys and values have as many heads as queries
        if "head_dim" in values:
            kwargs["head_dim"] = 8
        if "qk_head_dim" in values:
            kwargs["qk_head_dim"] = 16
    for key, value in FLAG_RULES.items():
        if key in values:
            kwargs[key] = value
    for key, value in values.items():
        if DROPOUT.search(key) and isinstance(value, float):
            kwargs[key] = 0.0
    # special-token ids inside the tiny vocab (BOS 0, PAD 1, EOS 2 from TINY; others from 3 on)
    spare = iter(range(3, LOW_TOKEN))
    for key, value in values.items():
        if (key.endswith("_token_id") or key.endswith("_token_index")) and key not in TINY:
            if isinstance(value, int) and value >= VOCAB - 8 and "image" not in key and "video" not in key:
                kwargs[key] = next(spare, VOCAB - 1)
            elif isinstance(value, int) and value >= VOCAB:
                kwargs[key] = VOCAB - 1
            elif isinstance(value, list) and value:
                kwargs[key] = [min(v, VOCAB - 1) for v in value if isinstance(v, int)][:1] or None
    # per-layer structure: one layer of every kind the family has (up to 4), per-layer lists cut to as many
    layers = per_layer_lengths(default)
    n = 2
    if kinds:
        n = max(2, len(kinds))
        kwargs["layer_types"] = list(kinds) * (2 if len(kinds) == 1 else 1)
    else:
        kwargs.pop("layer_types", None)
    for key in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if key in values or key == "num_hidden_layers":
            kwargs[key] = n
    if layers:
        for key, value in values.items():
            if key == "layer_types" or key in kwargs:
                continue
            if isinstance(value, list) and len(value) == layers and layers > 1:
                unique = list(dict.fromkeys(map(repr, value)))
                picked = [value[[repr(v) for v in value].index(u)] for u in unique]
                kwargs[key] = [picked[i % len(picked)] for i in range(n)]
            elif isinstance(value, str) and len(value) == layers and layers > 1 and key.endswith("pattern"):
                unique = list(dict.fromkeys(value))
                kwargs[key] = "".join(unique[i % len(unique)] for i in range(n))
    if "mlp_layer_types" in values and "mlp_layer_types" not in kwargs:
        kwargs["mlp_layer_types"] = [("dense", "sparse")[i % 2] for i in range(n)]
    rope = values.get("rope_parameters")
    source = family_source(model_type)
    if isinstance(rope, dict) and not rope and "rope_parameters[layer_type]" in source:  # one table per layer kind
        rope = {k: {"rope_type": "default", "rope_theta": 10000.0}
                for k in (kwargs.get("layer_types") or ["full_attention"])}
    nested = isinstance(rope, dict) and bool(rope) and all(isinstance(v, dict) for v in rope.values())
    if isinstance(rope, dict) and not nested and "mrope_section" in source and "mrope_section" not in str(rope):
        rope = {**rope, "mrope_section": [2, 3, 3]}  # multimodal rope: sections of the rotary half-dimension
    if isinstance(rope, dict):
        rope = copy.deepcopy(rope)
        tables = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
        for table in tables:
            if "mrope_section" in table:  # sections of the rotary half-dimension (head_dim 16: 8)
                table["mrope_section"] = [2, 3, 3]
        if tables is not None and rope and all(isinstance(v, dict) for v in rope.values()):
            for layer_kind in kwargs.get("layer_types") or ():
                rope.setdefault(layer_kind, copy.deepcopy(tables[0]))
        kwargs["rope_parameters"] = rope
    kwargs.update(FAMILY.get(model_type, {}))
    return kwargs


def build_model(candidate: Any) -> tuple[Any, str]:
    """The tiny model (fp32, dropout 0, seeded) and a note on how it was built; variants are tried in turn: every
    layer kind the family names, sliding + full, the config's own layer_types."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[candidate.model_type]
    default = config_class()
    has_layer_types = "layer_types" in default.to_dict()
    kinds = layer_kinds(candidate.model_type) if has_layer_types else ()
    variants: list[tuple[str, Any]] = []
    if kinds:
        variants.append(("", list(kinds)))
        if "sliding_attention" in kinds and "full_attention" in kinds and len(kinds) > 2:
            variants.append(("layer_types sliding + full only", ["sliding_attention", "full_attention"]))
    variants.append(("" if not kinds else "layer_types left to the config", None))
    first_error = None
    for note, variant in variants:
        kwargs = tiny_kwargs(candidate.model_type, default, variant, candidate.kind)
        family = FAMILY.get(candidate.model_type, {})
        slim = {k: v for k, v in kwargs.items() if not isinstance(v, (list, str)) or k == "layer_types" or k in family}
        for attempt in (kwargs, slim):
            for _ in range(4):  # a key the class refuses by name ("does not support the setting of `x`") is dropped
                try:
                    config = config_class(**attempt)
                    torch.manual_seed(0)
                    model = candidate.model_class._from_config(config).float()
                    zero_dropout(model)
                    if hasattr(model, "set_default_language") and getattr(config, "languages", None):
                        model.set_default_language(config.languages[0])  # X-MOD: one adapter for every example
                    with torch.no_grad():
                        model.eval()(input_ids=torch.tensor([[LOW_TOKEN + 1, LOW_TOKEN + 2, LOW_TOKEN + 3]]))
                    return model, note
                except TypeTimeout:
                    raise
                except Exception as exc:  # noqa: BLE001
                    first_error = first_error or exc
                    named = [k for k in attempt if k not in family and re.search(rf"[`'\"]{re.escape(k)}[`'\"]",
                                                                                  str(exc))]
                    if not named:
                        break
                    attempt = {k: v for k, v in attempt.items() if k not in named}
    raise first_error


# -- which model types ------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    model_type: str
    skip: str | None = None  # why it is not swept
    model_class: Any = None
    task: str = "hidden_states"
    kind: str = "decoder"  # the sweep's guess (declared kind, else masked-LM mapping = encoder)


def _class(name: Any) -> Any:
    import transformers

    if isinstance(name, (tuple, list)):
        name = name[0]
    return getattr(transformers, name, None)


def classify(model_type: str, claims: dict) -> Candidate:
    """Whether ``model_type`` is decoder-only or encoder-only text, and the class and task it is swept with."""
    from transformers.models.auto import modeling_auto as auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    masked = auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model_type)
    base = auto.MODEL_MAPPING_NAMES.get(model_type)
    try:
        config_class = CONFIG_MAPPING[model_type]
        default = config_class()
    except Exception as exc:  # noqa: BLE001
        return Candidate(model_type, f"default config cannot be built ({type(exc).__name__})")
    if getattr(config_class, "model_type", model_type) not in ("", model_type):
        return Candidate(model_type, f"alias of {config_class.model_type!r} (same config class)")
    if getattr(default, "is_encoder_decoder", False):
        return Candidate(model_type, "encoder-decoder")
    subs = set(getattr(default, "sub_configs", {}) or {})
    if subs - TEXT_SUB_CONFIGS:
        return Candidate(model_type, "multimodal or composite (vision / audio / other sub-model configs)")
    if causal is None and masked is None and base is None:  # a sub-model's config: <Name>Config -> <Name>Model
        stem = config_class.__name__[: -len("Config")] if config_class.__name__.endswith("Config") else None
        base = next((f"{stem}{suffix}" for suffix in ("Model", "ForCausalLM") if stem and _class(f"{stem}{suffix}")),
                    None)
        if base is None:
            return Candidate(model_type, "no model class (a sub-model's config)")
    declared = claims.get(model_type)
    kind = declared[0].kind if declared else ("encoder" if masked else "decoder")
    if kind == "decoder" and causal and _class(causal) is not None:
        model_class, task = _class(causal), "causal_lm"
    else:
        model_class, task = _class(base or masked or causal), "hidden_states"
    if model_class is None:
        return Candidate(model_type, "no model class (a sub-model's config)")
    try:
        parameters = inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if "input_ids" not in parameters:
        return Candidate(model_type, "not text (vision, audio, time series …: its forward takes no input_ids)")
    text = default.get_text_config() if hasattr(default, "get_text_config") else default
    if "vocab_size" not in default.to_dict() and not isinstance(getattr(text, "vocab_size", None), int):
        return Candidate(model_type, "not text (its config has no vocab_size)")
    return Candidate(model_type, None, model_class, task, kind)


# -- the ground truth -------------------------------------------------------------------------------------------


def declared_lengths(config: Any) -> list[int]:
    from padfree_plugins.modeling.probe import declared_lengths as lengths

    try:
        return lengths(config)
    except Exception:  # noqa: BLE001
        return []


def sweep_lengths(config: Any, start: int) -> tuple[int, ...]:
    limit = getattr(config.get_text_config(), "max_position_embeddings", None) or 256
    limit = int(limit) - start
    lengths = list(LENGTHS)
    for length in declared_lengths(config):
        if length + 3 <= min(limit, 256):
            lengths += [length - 1, length + 3]
    return tuple(n for n in lengths if n <= limit)


def sweep_examples(config: Any, lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[dict]:
    """Random ids in [LOW_TOKEN, vocab), BOS / CLS first and EOS / SEP last where the config names them (never the
    pad id), and a mask token in one example where it names one."""
    generator = torch.Generator().manual_seed(seed)
    text = config.get_text_config()
    pad = getattr(text, "pad_token_id", None)

    def token(*names: str) -> int | None:
        for name in names:
            value = getattr(text, name, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(value, int) and 0 <= value < vocab and value != pad:
                return value
        return None

    first, last, mask = token("bos_token_id", "cls_token_id"), token("eos_token_id", "sep_token_id"), token(
        "mask_token_id")
    examples = []
    for index, n in enumerate(lengths):
        ids = torch.randint(min(LOW_TOKEN, vocab - 1), vocab, (n,), generator=generator).tolist()
        ids = [i if i != pad else LOW_TOKEN for i in ids]
        if n >= 3:
            ids[0] = first if first is not None else ids[0]
            ids[-1] = last if last is not None else ids[-1]
            if mask is not None and index == 3:
                ids[n // 2] = mask
        examples.append({"input_ids": ids})
    return examples


def _projection(i: int, length: int, width: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000 + i)
    return torch.randn(length, width, generator=generator) / math.sqrt(width * 8)


def _hidden(result: Any) -> torch.Tensor:
    value = getattr(result, "last_hidden_state", None)
    if value is None:  # a base class that returns logits (Higgs Audio v2)
        value = getattr(result, "logits", None)
    if value is None and isinstance(result, (tuple, list)):
        value = result[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the model returned {type(result).__name__} without last_hidden_state")
    return value


@dataclass
class Run:
    loss: torch.Tensor
    scale: float  # what the loss difference is relative to
    grads: list[torch.Tensor | None]
    outputs: list[torch.Tensor]  # per example, per token: logits (causal_lm) or last_hidden_state


def _grads(loss: torch.Tensor, parameters: list) -> list:
    return list(torch.autograd.grad(loss, parameters, allow_unused=True))


def projection_loss(parts: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    terms = [(part * _projection(i, part.shape[0], part.shape[-1])).sum(-1) for i, part in enumerate(parts)]
    loss = sum(t.sum() for t in terms)
    return loss, float(sum(t.detach().abs().sum() for t in terms))


def _logits(result: Any) -> torch.Tensor:
    value = getattr(result, "logits", None)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the model returned {type(result).__name__} without logits")
    return value


def run_padded(model: Any, examples: list[dict], task: str, pad: int, parameters: list) -> Run:
    lengths = [len(e["input_ids"]) for e in examples]
    ids = torch.full((len(examples), max(lengths)), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, example in enumerate(examples):
        ids[i, : lengths[i]] = torch.tensor(example["input_ids"])
        mask[i, : lengths[i]] = 1
    if task == "causal_lm":
        result = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        outputs = [_logits(result)[i, :n].detach() for i, n in enumerate(lengths)]
        return Run(result.loss, float(result.loss.detach().abs()), _grads(result.loss, parameters), outputs)
    hidden = _hidden(model(input_ids=ids, attention_mask=mask))
    parts = [hidden[i, :n] for i, n in enumerate(lengths)]
    loss, scale = projection_loss(parts)
    return Run(loss, scale, _grads(loss, parameters), [p.detach() for p in parts])


def run_alone(model: Any, examples: list[dict], task: str, parameters: list) -> Run:
    if task == "causal_lm":
        count = sum(len(e["input_ids"]) - 1 for e in examples)
        total, outputs = None, []
        for example in examples:
            ids = torch.tensor([example["input_ids"]])
            if ids.shape[1] < 2:
                outputs.append(_logits(model(input_ids=ids))[0].detach())
                continue
            result = model(input_ids=ids, labels=ids)
            outputs.append(_logits(result)[0].detach())
            term = result.loss * (ids.shape[1] - 1) / count
            total = term if total is None else total + term
        return Run(total, float(total.detach().abs()), _grads(total, parameters), outputs)
    parts = [_hidden(model(input_ids=torch.tensor([e["input_ids"]])))[0] for e in examples]
    loss, scale = projection_loss(parts)
    return Run(loss, scale, _grads(loss, parameters), [p.detach() for p in parts])


def run_packed(model: Any, assembly: Any, examples: list[dict], task: str, parameters: list) -> Run:
    batch = assembly.collator(examples)
    result = assembly.forward(model, batch)
    cu = batch["cu_seq_lens_q"].tolist()
    if task == "causal_lm":
        logits = _logits(result)
        outputs = [logits[0, cu[i] : cu[i + 1]].detach() for i in range(len(cu) - 1)]
        return Run(result.loss, float(result.loss.detach().abs()), _grads(result.loss, parameters), outputs)
    hidden = _hidden(result)
    parts = [hidden[0, cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
    loss, scale = projection_loss(parts)
    return Run(loss, scale, _grads(loss, parameters), [p.detach() for p in parts])


#: (relative loss difference, max gradient difference over all parameters — each parameter's in units of 1 + its
#: largest gradient, i.e. an absolute difference for small gradients and a relative one for large —, max relative
#: per-token output difference, largest gradient of the reference)
Diffs = tuple[float, float, float, float]


def compare(got: Run, want: Run) -> Diffs:
    loss = float((got.loss.detach().double() - want.loss.detach().double()).abs())
    loss = loss / max(want.scale, 1e-12) if math.isfinite(loss) else math.inf
    grad, grad_scale = 0.0, 0.0
    for a, b in zip(got.grads, want.grads):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
            grad = math.inf
            continue
        if a.numel():  # per parameter, in units of 1 + its largest gradient (atol = rtol, as the package's tests)
            scale = float(b.double().abs().max())
            grad = max(grad, float((a.double() - b.double()).abs().max()) / (1.0 + scale))
            grad_scale = max(grad_scale, scale)
    output = 0.0
    for a, b in zip(got.outputs, want.outputs):
        if a.shape != b.shape or not bool(torch.isfinite(a).all()):
            output = math.inf
            continue
        scale = float(b.double().abs().max()) if b.numel() else 0.0
        output = max(output, float((a.double() - b.double()).abs().max()) / max(scale, 1e-12) if b.numel() else 0.0)
    return loss, grad, output, grad_scale


def exceeds(diffs: Diffs | None) -> bool:
    return diffs is not None and not (diffs[0] <= LOSS_RTOL and diffs[1] <= GRAD_ATOL and diffs[2] <= OUTPUT_RTOL)


# -- one model type ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    model_type: str
    declared_by: str = ""
    task: str = ""
    params: int = 0
    status: str = ""  # accepted / refused / not built / error
    reason: str = ""
    reason_kind: str = ""
    backend: str = ""
    lengths: tuple[int, ...] = ()
    packed_vs_padded: Diffs | None = None
    packed_vs_alone: Diffs | None = None
    padded_vs_alone: Diffs | None = None
    note: str = ""
    seconds: float = 0.0
    features: list[str] = field(default_factory=list)

    @property
    def packs_exactly(self) -> bool | None:
        if self.packed_vs_padded is None:
            return None
        return not (exceeds(self.packed_vs_padded) and exceeds(self.packed_vs_alone))

    @property
    def fooled(self) -> bool:
        return self.status == "accepted" and self.packs_exactly is False


REASON_KINDS = [
    (r"mixes the sequence outside attention", "sequence mixer outside attention"),
    (r"chunked attention|temperature computed from positions", "structure in the model's own mask / row positions"),
    (r"sliding window that no attention call receives", "window no attention call receives"),
    (r"differ from each example run alone", "measured: packed ≠ alone"),
    (r"the model alone failed in float64", "model alone fails in float64"),
    (r"the packed forward failed", "packed forward failed"),
    (r"encoder-decoder", "encoder-decoder"),
    (r"has no language-model head|LM head|lm_head", "no LM head"),
    (r"does not route attention through transformers' AttentionInterface",
     "attention not through transformers' AttentionInterface"),
    (r"backend|attention implementation", "attention backend refused"),
]


def first_clause(message: str) -> str:
    """The reason's first clause: what follows 'failed the padding-free equivalence probe: ' up to its ':' or '. '"""
    text = message.split("equivalence probe: ", 1)[-1]
    text = re.sub(r"\s+", " ", text)
    if text.startswith("the packed forward failed: ") or text.startswith("the model alone failed in float64: "):
        head, rest = text.split(": ", 1)
        return f"{head}: {re.split(r'[:(]', rest, 1)[0].strip()}"
    if text.startswith("packed outputs differ"):
        return re.split(r" of the output scale", text, 1)[0]
    clause = re.split(r"(?<=[a-z0-9)'\]])[:;]\s|\.\s|\s\(", text, 1)[0]
    return clause.strip()[:160]


def reason_kind(message: str) -> str:
    for pattern, kind in REASON_KINDS:
        if re.search(pattern, message):
            return kind
    return "other: " + first_clause(message)[:60]


def features_of(config: Any) -> list[str]:
    text = config.get_text_config()
    found = []
    window = getattr(text, "sliding_window", None) or getattr(text, "local_attention", None)
    if isinstance(window, int):
        found.append(f"window {window}")
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, list) and len(set(kinds)) > 1:
        found.append("layers " + "/".join(dict.fromkeys(str(k).replace("_attention", "") for k in kinds)))
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 1:
            found.append(f"{value} experts")
            break
    if getattr(text, "kv_lora_rank", None):
        found.append("MLA")
    if getattr(text, "attention_chunk_size", None):
        found.append(f"chunk {text.attention_chunk_size}")
    return found


def first_line(exc: BaseException, limit: int = 100) -> str:
    text = str(exc)
    return text.splitlines()[0][:limit] if text.strip() else ""


class TypeTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def handler(signum, frame):
        raise TypeTimeout(f"over the per-type limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def probe_bypassed():
    """The probe skipped at assembly (to measure what a refused type would have trained like)."""
    import padfree_plugins.assembly as assembly_module

    original = assembly_module.verify
    assembly_module.verify = lambda *args, **kwargs: None
    try:
        yield
    finally:
        assembly_module.verify = original


def zero_dropout(model: Any) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def sweep_type(candidate: Candidate, claims: dict, measure_refused: bool) -> Row:
    """Build the tiny model of one candidate, then :func:`measure` it."""
    model_type = candidate.model_type
    declared = claims.get(model_type)
    row = Row(model_type, declared[1] if declared else "", candidate.task)
    try:
        model, row.note = build_model(candidate)
        row.params = sum(p.numel() for p in model.parameters())
        row.features = features_of(model.config)
    except TypeTimeout:
        raise
    except Exception as exc:  # noqa: BLE001
        row.status, row.reason = "not built", f"{type(exc).__name__}: {first_line(exc, 140)}"
        row.reason_kind = "tiny model cannot be built or run on input_ids"
        return row
    return measure(model, row, candidate.task, declared[1] if declared else None, measure_refused)


def measure(model: Any, row: Row, task: str, block: str | None, measure_refused: bool) -> Row:
    """The verdict and the ground truth of one tiny ``model`` (unpatched, fp32, dropout 0) into ``row``."""
    from padfree_plugins import assemble
    from padfree_plugins.errors import PadfreeError
    from padfree_plugins.modeling.patching import patch_of
    from padfree_plugins.modeling.probe import position_start_of

    text = model.config.get_text_config()
    pad = text.pad_token_id if isinstance(getattr(text, "pad_token_id", None), int) else 0
    vocab = text.vocab_size if isinstance(getattr(text, "vocab_size", None), int) else VOCAB
    start = position_start_of(model)
    row.lengths = sweep_lengths(model.config, start)
    examples = sweep_examples(model.config, row.lengths, vocab)
    parameters = [p for p in model.parameters() if p.requires_grad]

    # the references, on the model as it is (its own attention and mask), in training mode
    model.train()
    try:
        padded = run_padded(model, examples, task, pad, parameters)
        alone = run_alone(model, examples, task, parameters)
        row.padded_vs_alone = compare(padded, alone)
    except TypeTimeout:
        raise
    except Exception as exc:  # noqa: BLE001
        padded = alone = None
        row.note = (row.note + f" reference failed: {type(exc).__name__}: "
                    f"{first_line(exc, 100)}").strip()

    # the verdict
    config_block = {"task": task, "architecture": "probe", "plugins": {"block": [block] if block else []}}
    assembly = None
    try:
        assembly = assemble(model, config_block)
        row.status, row.backend = "accepted", assembly.plan.backend.name
    except TypeTimeout:
        raise
    except PadfreeError as exc:
        row.status, row.reason, row.reason_kind = "refused", first_clause(str(exc)), reason_kind(str(exc))
    except Exception as exc:  # noqa: BLE001 - anything else is a refusal too, but not a designed one
        row.status = "refused"
        row.reason = f"assemble raised {type(exc).__name__}: {first_line(exc, 120)}"
        row.reason_kind = f"assemble raised {type(exc).__name__}"
    if patch_of(model) is not None and assembly is None:
        row.note += " the patch was left on the model after a refusal!"

    if assembly is None and measure_refused and padded is not None:
        try:
            with probe_bypassed():
                assembly = assemble(model, {**config_block, "attention": "exact"})
        except TypeTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            row.note = (row.note + f" not measurable packed: {type(exc).__name__}: "
                        f"{first_line(exc, 80)}").strip()
    if assembly is not None and padded is not None:
        model.train()
        zero_dropout(model)
        try:
            packed = run_packed(model, assembly, examples, task, parameters)
            row.packed_vs_padded = compare(packed, padded)
            row.packed_vs_alone = compare(packed, alone)
        except TypeTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            row.note = (row.note + f" packed training failed: {type(exc).__name__}: "
                        f"{first_line(exc, 100)}").strip()
        finally:
            assembly.undo()
    elif assembly is not None:
        assembly.undo()
    if row.padded_vs_alone is not None and exceeds(row.padded_vs_alone):
        row.note = (row.note + " padded ≠ alone (the padded reference itself differs)").strip()
    return row


# -- the report -------------------------------------------------------------------------------------------------


def fmt(diffs: Diffs | None) -> str:
    if diffs is None:
        return "–"
    return f"{diffs[0]:.0e} / {diffs[1]:.0e} / {diffs[2]:.0e}"


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "padfree_plugins"],
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes in padfree_plugins/)" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


FINDINGS = re.compile(r"<!-- findings -->.*?<!-- /findings -->", re.DOTALL)


def findings_of(text: str) -> str:
    """The hand-written findings block of an earlier report (kept verbatim by a rerun), or ''."""
    found = FINDINGS.search(text)
    return found.group(0) if found else ""


def report(rows: list[Row], skipped: dict[str, list[str]], total: int, command: str, elapsed: float,
           subset: bool, measure_refused: bool, findings: str = "", declared_types: frozenset = frozenset()) -> str:
    import transformers

    built = [r for r in rows if r.status in ("accepted", "refused")]
    accepted = [r for r in built if r.status == "accepted"]
    refused = [r for r in built if r.status == "refused"]
    fooled = [r for r in accepted if r.fooled]
    unmeasured = [r for r in accepted if r.packed_vs_padded is None]
    needless = [r for r in refused if r.packs_exactly]
    leaky = [r for r in refused if r.packs_exactly is False]
    by_reason: dict[str, list[str]] = {}
    for r in refused:
        by_reason.setdefault(r.reason_kind, []).append(r.model_type)
    not_built = [r for r in rows if r.status not in ("accepted", "refused")]
    declared = [r for r in built if r.declared_by]
    lines = [
        "# Probe sweep: `architecture: probe` against packed-vs-padded training",
        "",
        f"Generated by `scripts/probe_sweep.py` on {datetime.date.today().isoformat()}"
        f"{' (a subset of model types)' if subset else ''}.",
        "",
        f"* command: `{command}`",
        f"* transformers {transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"padfree-plugins at {git_state()}; CPU, {torch.get_num_threads()} thread, {elapsed / 60:.1f} min",
        f"* every model type in transformers' `CONFIG_MAPPING` ({total}) that is decoder-only or encoder-only text, "
        "as a tiny random model: 2 layers (one of each layer kind the family has, up to 4), hidden 64, 4 heads (2 "
        "key/value heads), vocab 128, MLP 128; a sliding window / local attention / chunk of "
        f"{WINDOW} tokens where the config has one, 4 experts (2 per token, 1 shared, one dense layer first) where it "
        "has experts, MLA ranks where it has them; dropout 0",
        "* verdict: `assemble(model, {\"task\": <causal_lm for a decoder with an LM head, else hidden_states>, "
        "\"architecture\": \"probe\", \"plugins\": {\"block\": [<the plugin declaring the type>]}})` — blocking the "
        "declaring plugin sends declared types through the probe too",
        f"* ground truth, fp32, training mode: examples of lengths {list(LENGTHS)} (plus one within and one "
        "straddling each declared window / chunk / rope length), BOS/CLS first, EOS/SEP last, a mask token in one "
        "example; packed through the assembly vs right-padded with an attention mask (-100 labels on padding) vs "
        "each example alone. Loss: the model's causal-LM loss (decoders with an LM head), else a fixed random "
        "projection of `last_hidden_state` summed over real tokens. Each comparison column gives three numbers: "
        "the loss's relative difference / the largest gradient difference over all parameters (each parameter's in "
        "units of 1 + its largest gradient: absolute for small gradients, relative for large ones, the convention "
        "of `padfree_plugins.testing.assert_packed_matches_alone`) / the largest per-token output difference "
        "(logits or hidden states) relative to each example's largest output",
        f"* **fooled** = accepted, yet packed training differs from padded *and* from each example alone by more "
        f"than {LOSS_RTOL:g} (loss) or {GRAD_ATOL:g} (gradients) or {OUTPUT_RTOL:g} (outputs; stricter than the "
        "loss, which a random tiny model's near-uniform predictions make insensitive: LFM2's convolution leak moves "
        "the loss by 1e-7 and the logits by 5e-4)",
        "",
        *([findings, ""] if findings else []),
        "## Summary",
        "",
        f"* model types in `CONFIG_MAPPING`: {total}; swept (decoder-only / encoder-only text): {len(rows)}; "
        f"skipped: {sum(len(v) for v in skipped.values())}",
        f"* tiny model built and run: **{len(built)}** ({len(declared)} declared by a plugin, blocked for the sweep; "
        f"{len(built) - len(declared)} undeclared); not built: {len(not_built)}"
        + "".join(f"\n  * {r.model_type}: {r.reason_kind} — {r.reason}" for r in sorted(not_built,
                                                                                       key=lambda r: r.model_type)),
        f"* accepted by the probe: **{len(accepted)}** "
        f"({sum(1 for r in accepted if r.declared_by)} declared, {sum(1 for r in accepted if not r.declared_by)} "
        "undeclared)",
        f"* refused: **{len(refused)}**",
    ]
    for kind, types in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  * {kind}: {len(types)} — {', '.join(sorted(types))}")
    lines += [
        f"* **fooled: {len(fooled)}**" + (f" — {', '.join(r.model_type for r in fooled)}" if fooled else
                                            " (must be 0)"),
        f"* accepted but not measured (the ground truth could not run): {len(unmeasured)}"
        + (f" — {', '.join(r.model_type for r in unmeasured)}" if unmeasured else ""),
    ]
    if measure_refused:
        lines += [
            f"* refused types that would have packed exactly (probe bypassed, `attention: exact`): {len(needless)}"
            + "".join(f"\n  * {kind}: {', '.join(sorted(r.model_type for r in needless if r.reason_kind == kind))}"
                      for kind in sorted({r.reason_kind for r in needless})),
            f"* refused types whose packed training does differ: {len(leaky)}; not measurable packed: "
            f"{sum(1 for r in refused if r.packs_exactly is None)}",
        ]
    lines += ["", "## Every swept type", "",
              "| model type | declared by | task | features | params | verdict | reason (first clause) | packed vs "
              "padded (loss / grad / output) | packed vs alone | padded vs alone | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r.model_type):
        verdict = r.status + (" **FOOLED**" if r.fooled else "")
        if r.status == "refused" and r.packs_exactly:
            verdict += " (packs exactly)"
        reason = (r.reason or "").replace("|", "\\|")
        note = r.note.replace("|", "\\|")
        lines.append(f"| {r.model_type} | {r.declared_by or '–'} | {r.task} | {', '.join(r.features) or '–'} | "
                     f"{r.params / 1e6:.2f}M | {verdict} | {reason or '–'} | {fmt(r.packed_vs_padded)} | "
                     f"{fmt(r.packed_vs_alone)} | {fmt(r.padded_vs_alone)} | {note or '–'} |")
    lines += ["", "## Skipped model types", ""]
    for reason, types in sorted(skipped.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"* {reason}: {len(types)} — {', '.join(sorted(types))}")
    skipped_declared = sorted(t for types in skipped.values() for t in types if t in declared_types)
    if skipped_declared:
        lines.append(f"* of these, declared by a plugin (not swept): {', '.join(skipped_declared)}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown report here (default: stdout)")
    parser.add_argument("--types", help="comma-separated model types (default: every one)")
    parser.add_argument("--limit", type=int, default=90, help="seconds per model type (default 90)")
    parser.add_argument("--no-refused", action="store_true", help="skip the ground truth of refused types")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from padfree_plugins.contract.host import PluginHost

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    claims = PluginHost().architectures()
    names = list(CONFIG_MAPPING_NAMES)
    wanted = [t.strip() for t in args.types.split(",")] if args.types else names
    unknown = [t for t in wanted if t not in CONFIG_MAPPING_NAMES]
    if unknown:
        parser.error(f"unknown model types: {', '.join(unknown)}")
    skipped: dict[str, list[str]] = {}
    candidates = []
    for model_type in wanted:
        try:
            candidate = classify(model_type, claims)
        except Exception as exc:  # noqa: BLE001
            candidate = Candidate(model_type, f"cannot be classified ({type(exc).__name__})")
        if candidate.skip:
            skipped.setdefault(candidate.skip, []).append(model_type)
        else:
            candidates.append(candidate)
    print(f"{len(candidates)} model types to sweep, {len(wanted) - len(candidates)} skipped", file=sys.stderr)
    began = time.time()
    rows = []
    for index, candidate in enumerate(candidates, 1):
        t0 = time.time()
        try:
            with time_limit(args.limit):
                row = sweep_type(candidate, claims, not args.no_refused)
        except TypeTimeout as exc:
            row = Row(candidate.model_type, claims.get(candidate.model_type, (None, ""))[1], candidate.task,
                      status="error", reason=str(exc), reason_kind="time limit")
        except Exception as exc:  # noqa: BLE001 - one type's failure is a row, not the end of the sweep
            row = Row(candidate.model_type, claims.get(candidate.model_type, (None, ""))[1], candidate.task,
                      status="error", reason=f"{type(exc).__name__}: {exc}"[:200], reason_kind="sweep error")
            traceback.print_exc(limit=3)
        row.seconds = time.time() - t0
        rows.append(row)
        flag = " FOOLED" if row.fooled else (" (packs exactly)" if row.status == "refused" and row.packs_exactly
                                             else "")
        print(f"[{index}/{len(candidates)}] {row.model_type}: {row.status}{flag} {row.seconds:.1f}s "
              f"padded {fmt(row.packed_vs_padded)} alone {fmt(row.packed_vs_alone)} "
              f"{(row.reason or '')[:90]} {row.note[:80]}", file=sys.stderr, flush=True)
    elapsed = time.time() - began
    command = "scripts/probe_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    findings = ""
    if args.out and os.path.exists(args.out):
        with open(args.out) as handle:
            findings = findings_of(handle.read())
    text = report(rows, skipped, len(names) if not args.types else len(wanted), ".venv/bin/python " + command,
                  elapsed, bool(args.types), not args.no_refused, findings, frozenset(claims))
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    return 1 if any(r.fooled for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
