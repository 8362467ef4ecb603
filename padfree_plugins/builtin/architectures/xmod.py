"""X-MOD (``xmod``): XLM-R with a bottleneck adapter per language in every layer's output.

transformers chooses the adapter from ``lang_ids`` — one language per row (``[B]``), or, without them, the config's
``default_language`` (``set_default_language``). ``XmodOutput.lang_adapter`` selects hidden states with
``hidden_states[lang_ids == i]``, so a ``lang_ids`` of the row's shape ``[1, T]`` routes *every token* to its own
language's adapter: the adapters act on each token alone, which is exactly what each example run alone with its
language computes. The patch therefore expands per-example ``lang_ids`` (``[n]``, one per packed example) into
per-token ids on a packed row (a pre-hook on the base model; examples from ``cu_seq_lens_q`` or, called past the
hooks, from where the position ids restart); per-token ids ``[1, T]`` pass unchanged, and without ``lang_ids`` every
example uses ``default_language``, as padded. Positions start at ``pad_token_id + 1`` (RoBERTa's embeddings).

``lang_ids`` are declared a per-example model input (``example_keys``): the collator stacks every example's
``lang_ids`` (one language id, in every example or in none) into ``[n]``, and the forward passes them to the model;
examples without them all run with ``default_language``, as padded.
"""

from __future__ import annotations

import torch

from padfree_plugins.builtin.architectures._packed_rows import example_of_token
from padfree_plugins.builtin.architectures.roberta import after_padding_idx
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BatchError
from padfree_plugins.modeling.patching import ModelPatch
from padfree_plugins.packing.batch import token_examples

XMOD = Architecture("xmod", model_types=("xmod",), kind="encoder", position_start=after_padding_idx,
                    default_pooling="first", example_keys=("lang_ids",),
                    description="X-MOD encoders; language adapters routed per token (per-example lang_ids, else "
                    "default_language); positions from pad_token_id + 1")


@hookimpl
def register_architectures():
    return [XMOD]


def per_token_languages(lang_ids: torch.Tensor, input_ids: torch.Tensor, position_ids, cu_seq_lens) -> torch.Tensor:
    """``[n]`` languages of a packed row's examples -> ``[1, T]`` languages of its tokens."""
    total = input_ids.shape[1]
    if cu_seq_lens is not None:
        examples, count = token_examples(cu_seq_lens.to(input_ids.device), total), cu_seq_lens.numel() - 1
    elif position_ids is not None:
        examples, count = example_of_token(position_ids), None
    else:
        return lang_ids
    if count is not None and lang_ids.numel() not in (1, count):
        raise BatchError(f"X-MOD: lang_ids has {lang_ids.numel()} values for a packed row of {count} examples; give "
                         "one language per example (or one per token)")
    if lang_ids.numel() == 1:
        return lang_ids.reshape(1, 1).expand(1, total)
    return lang_ids.reshape(-1).to(input_ids.device).index_select(0, examples).unsqueeze(0)


def route_languages(module, args, kwargs):
    """The base model's pre-hook: per-example ``lang_ids`` of a packed row become per-token ids."""
    lang_ids = kwargs.get("lang_ids", args[1] if len(args) > 1 else None)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(lang_ids, torch.Tensor) or not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        return None
    if input_ids.shape[0] != 1 or lang_ids.ndim != 1 or kwargs.get("attention_mask") is not None:
        return None  # a padded batch (one language per row), or per-token ids already
    routed = per_token_languages(lang_ids, input_ids, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"))
    if len(args) > 1:
        args = (args[0], routed, *args[2:])
    else:
        kwargs = {**kwargs, "lang_ids": routed}
    return args, kwargs


@hookimpl
def patch_model(model, architecture, backend, fallback, config):
    if architecture.name != XMOD.name:
        return None
    patch = ModelPatch.apply(model, architecture, backend, fallback,
                             attention_dropout=config.attention_dropout == "keep")
    patch.handles.append(patch.model.base_model.register_forward_pre_hook(route_languages, with_kwargs=True))
    return patch
