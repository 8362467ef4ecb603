"""Per-example heads on a packed row: run the model's base once, pool one vector per example, apply the model's
own head modules to those vectors.

transformers' ``*ForSequenceClassification`` heads pool one token per *row*, so on a packed ``[1, T]`` row they
would return one result for ``n`` examples. Here the base model runs packed, the token each head reads is
gathered per example (CLS at ``cu[:-1]``, a decoder's last token that is not the pad id, or ModernBERT's
mean) and the head's own modules (pooler, dropout, dense layers, ``score``) run on ``[n, H]`` — the same weights
and the same arithmetic as the padded forward, with no padding.

A model family missing from :data:`SEQUENCE_HEADS` is refused with an error saying how to add it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from padfree_plugins.errors import PadfreeError, UnsupportedArchitectureError
from padfree_plugins.modeling.patching import COMPUTE_KEYWORD, patch_of, unwrap_model
from padfree_plugins.modeling.pooling import FirstTokenPooler, LastTokenPooler, MeanPooler, example_index
from padfree_plugins.packing.batch import MODEL_INPUT_KEYS

_first, _last, _mean = FirstTokenPooler(), LastTokenPooler(), MeanPooler()


@lru_cache(maxsize=64)
def _forward_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def call_model(model: Any, compute: Callable[[Any], Any]) -> Any:
    """``compute(inner)`` for the transformers model ``inner`` inside ``model``, run *as its forward* through every
    wrapper around it (DDP, FSDP, peft, accelerate's autocast), so that the wrappers do what they do around a
    forward — DDP prepares the gradient all-reduce, which it skips for submodules called directly. A bare model goes
    through its own forward too (accelerate's single-process mixed precision wraps nothing but that forward), or is
    computed directly when it has no compute route. Needs the compute route of the model's patch
    (:meth:`ModelPatch.route_compute`), which assembly installs for forwards marked ``runs_inside_model_forward``.
    """
    inner = unwrap_model(model)
    patch = patch_of(inner)
    if model is inner and (patch is None or patch.compute_route is None):
        return compute(inner)
    if patch is None or patch.compute_route is None:
        raise PadfreeError(f"{type(inner).__name__} was not assembled for a per-example task: use "
                           "padfree_plugins.assemble(model, config) (or accelerate) before calling its forward")
    return model(**{COMPUTE_KEYWORD: compute})


def base_model(model: Any) -> Any:
    """The transformer body of a transformers model with a head (``model.bert``, ``model.model`` …)."""
    return unwrap_model(model).base_model


#: Inputs some families' base models take besides the tokens, passed on when the batch carries them and the base's
#: forward has the parameter: X-MOD's ``lang_ids`` (per example ``[n]`` or per token ``[1, T]``), RoCBert's per-token
#: ``input_shape_ids`` / ``input_pronunciation_ids``, LayoutLM's per-token ``bbox`` (``[1, T, 4]``).
FAMILY_INPUT_KEYS = ("lang_ids", "input_shape_ids", "input_pronunciation_ids", "bbox")


def run_base(model: Any, batch: Mapping) -> torch.Tensor:
    """The packed last hidden states ``[1, T, H]`` of ``model``'s base on a packed batch (no KV cache); the base gets
    the tokens, positions and boundaries, and those of ``token_type_ids``, :data:`FAMILY_INPUT_KEYS` and the batch's
    recorded ``model_keys`` (an architecture's declared inputs) that the batch holds and its forward takes."""
    base = base_model(model)
    accepted = _forward_parameters(type(base))
    inputs = {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}
    for key in ("token_type_ids", *FAMILY_INPUT_KEYS, *(getattr(batch, "model_keys", None) or ())):
        if key in batch and key in accepted:
            inputs[key] = batch[key]
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    return base(**inputs).last_hidden_state


# -- sequence-classification heads, one per model family: (model, packed hidden [1, T, H], batch) -> [n, labels] --


def _bert_head(model, hidden, batch):
    """BERT and BERT-shaped (ERNIE, Nomic BERT, GTE, RoCBert, LayoutLM): CLS -> the base's pooler (dense + tanh) ->
    dropout -> classifier."""
    pooled = model.base_model.pooler(_first(hidden, batch).unsqueeze(1))
    return model.classifier(model.dropout(pooled))


def _albert_head(model, hidden, batch):
    """ALBERT: CLS -> pooler (dense) -> pooler_activation (tanh) -> dropout -> classifier."""
    base = model.base_model
    return model.classifier(model.dropout(base.pooler_activation(base.pooler(_first(hidden, batch)))))


def _classification_head_module(model, hidden, batch):
    """RoBERTa / XLM-R / ELECTRA / MPNet / ESM-2 / ESM C / Jina-v3 / X-MOD: ``model.classifier`` takes
    ``features[:, 0]`` of ``[n, 1, H]``."""
    return model.classifier(_first(hidden, batch).unsqueeze(1))


def _distilbert_head(model, hidden, batch):
    """DistilBERT: first token -> pre_classifier -> ReLU -> dropout -> classifier."""
    pooled = torch.relu(model.pre_classifier(_first(hidden, batch)))
    return model.classifier(model.dropout(pooled))


def _modernbert_head(model, hidden, batch):
    """ModernBERT: CLS or mean (``config.classifier_pooling``) -> head -> drop -> classifier."""
    mode = model.config.classifier_pooling
    if mode not in ("cls", "mean"):
        raise UnsupportedArchitectureError(f"ModernBERT classifier_pooling {mode!r} is not supported (cls, mean)")
    pooled = _first(hidden, batch) if mode == "cls" else _mean(hidden, batch)
    return model.classifier(model.drop(model.head(pooled)))


def _context_pooler_head(model, hidden, batch):
    """DeBERTa-v2 / v3: first token -> ``ContextPooler`` (pooler_dropout -> dense -> ``pooler_hidden_act``) ->
    dropout (``cls_dropout``) -> classifier."""
    return model.classifier(model.dropout(model.pooler(_first(hidden, batch).unsqueeze(1))))


def _eurobert_head(model, hidden, batch):
    """EuroBERT (``config.classifier_pooling``): ``bos`` / ``mean`` pool, then dense -> activation -> classifier;
    ``late`` runs dense -> activation -> classifier on every token, then takes each example's mean."""
    mode = model.config.classifier_pooling
    if mode == "late":
        return _mean(model.classifier(model.activation(model.dense(hidden))), batch)
    if mode not in ("bos", "mean"):
        raise UnsupportedArchitectureError(f"EuroBERT classifier_pooling {mode!r} is not supported (bos, mean, late)")
    pooled = _first(hidden, batch) if mode == "bos" else _mean(hidden, batch)
    return model.classifier(model.activation(model.dense(pooled)))


def _last_not_pad(model, hidden, batch):
    """Every example's rightmost token that is not the pad id, as transformers' decoder heads choose it (that is
    how they find a padded row's end, so real pad-id tokens at an example's end — an EOS doubling as pad token —
    are passed over too; an example of pad ids only gives its first token). The last token without a pad id or
    ``input_ids``, as there."""
    pad = model.config.get_text_config().pad_token_id
    ids = batch.get("input_ids")
    if pad is None or ids is None:
        return _last(hidden, batch)
    rows = hidden.reshape(-1, hidden.shape[-1])
    cu = batch["cu_seq_lens_q"].to(rows.device, torch.long)
    example = example_index(batch, rows.shape[0], rows.device)
    position = torch.arange(rows.shape[0], device=rows.device)
    candidate = torch.where(ids.reshape(-1).to(rows.device) != pad, position, cu[:-1].index_select(0, example))
    last = candidate.new_zeros(cu.numel() - 1).scatter_reduce(0, example, candidate, "amax", include_self=False)
    return rows.index_select(0, last)


def _modernbert_decoder_head(model, hidden, batch):
    """ModernBERT-decoder: each example's last token that is not the pad id -> head -> drop -> classifier (the padded
    model runs them on every token and reads that one)."""
    return model.classifier(model.drop(model.head(_last_not_pad(model, hidden, batch))))


def _score_head(model, hidden, batch):
    """Decoders (Llama, Qwen2/3, Mistral …): each example's last token that is not the pad id -> ``score``."""
    return model.score(_last_not_pad(model, hidden, batch))


#: ``config.model_type`` -> head function. Decoders with a ``score`` layer need no entry.
SEQUENCE_HEADS: Mapping[str, Callable] = MappingProxyType({
    "bert": _bert_head,
    "ernie": _bert_head,
    "nomic_bert": _bert_head,
    "gte": _bert_head,
    "albert": _albert_head,
    "roberta": _classification_head_module,
    "xlm-roberta": _classification_head_module,
    "xlm-roberta-xl": _classification_head_module,
    "camembert": _classification_head_module,
    "data2vec-text": _classification_head_module,
    "roberta-prelayernorm": _classification_head_module,
    "electra": _classification_head_module,
    "mpnet": _classification_head_module,
    "deberta-v2": _context_pooler_head,
    "eurobert": _eurobert_head,
    "distilbert": _distilbert_head,
    "modernbert": _modernbert_head,
    "modernbert-decoder": _modernbert_decoder_head,
    "esm": _classification_head_module,
    "esmc": _classification_head_module,
    "jina_embeddings_v3": _classification_head_module,
    "xmod": _classification_head_module,
    "roc_bert": _bert_head,
    "layoutlm": _bert_head,
})


def sequence_head(model: Any) -> Callable:
    """The head function for a transformers ``*ForSequenceClassification`` model."""
    inner = unwrap_model(model)
    head = SEQUENCE_HEADS.get(inner.config.model_type)
    if head is not None:
        return head
    if isinstance(getattr(inner, "score", None), torch.nn.Module):
        return _score_head
    raise UnsupportedArchitectureError(
        f"{type(inner).__name__}: padfree-plugins does not know how this sequence-classification head pools "
        f"(model type {inner.config.model_type!r}). Supported: {', '.join(SEQUENCE_HEADS)} and decoders with a "
        "`score` layer. A plugin can add it with a task_forward hook (docs/writing-a-plugin.md)."
    )


def check_sequence_head(model: Any, task: str) -> None:
    """Refuse, at assembly, a model without a sequence-classification head (a bare ``BertModel``, a causal LM)."""
    inner = unwrap_model(model)
    if inner.base_model is inner or not any(isinstance(getattr(inner, name, None), torch.nn.Module)
                                            for name in ("classifier", "score")):
        raise UnsupportedArchitectureError(
            f"task {task} needs a model with a sequence-classification head; {type(inner).__name__} has none. "
            "Load it with AutoModelForSequenceClassification (num_labels=…)"
        )
    sequence_head(inner)  # a head this module knows how to run per example


def check_lm_head(model: Any, task: str) -> Any:
    """The model's language-model head; refused (at assembly) for a model without one (a bare base model, a
    classifier)."""
    inner = unwrap_model(model)
    head = inner.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise UnsupportedArchitectureError(
            f"task {task} needs a model with a language-model head; {type(inner).__name__} has none. Load it with "
            "AutoModelForCausalLM"
        )
    return head


def sequence_logits(model: Any, batch: Mapping, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example logits ``[n, num_labels]`` of a ``*ForSequenceClassification`` model on a packed batch; ``hidden``:
    the batch's last hidden states ``[1, T, H]`` where computed elsewhere (under sequence parallelism), else the
    base's on ``batch``."""
    head = sequence_head(model)
    return head(unwrap_model(model), run_base(model, batch) if hidden is None else hidden, batch)


# -- generative scoring (yes / no token logits of a causal LM) --------------------------------------------------


def _sharded(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is a shard outside its module's forward: an FSDP2 ``DTensor`` or a ZeRO-3 parameter."""
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor) or hasattr(parameter, "ds_id")


def token_logits(model: Any, batch: Mapping, token_ids: Sequence[int],
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of ``token_ids`` (python ints) at every example's last token: ``[n, k]``; ``hidden``: the batch's
    last hidden states where computed elsewhere (under sequence parallelism), else the base's on ``batch``.

    Only those ``k`` rows of the LM head are multiplied (never the whole vocabulary), picked by python ints (no index
    tensor copied from the host in every step, which would wait for the device); the output scaling a model applies
    to its logits (Cohere ``logit_scale``, Granite ``logits_scaling``, Gemma ``final_logit_softcapping``) is applied
    the same way.

    A sharded head (its weight an FSDP2 ``DTensor`` shard, or a DeepSpeed ZeRO-3 partition) is whole only inside its
    own forward: then the head module runs on the ``n`` pooled rows (its hooks gather the weight, and reduce its
    gradient) and the ``k`` columns are kept — ``n × vocabulary`` logits, still no per-token ones.
    """
    inner = unwrap_model(model)
    head = check_lm_head(inner, "reranker (scorer yes_no)")
    last = _last(run_base(inner, batch) if hidden is None else hidden, batch)
    if _sharded(head.weight):
        every = head(last)
        logits = torch.stack([every[:, i] for i in token_ids], dim=1)
    else:
        bias = getattr(head, "bias", None)
        bias = None if bias is None else torch.stack([bias[i] for i in token_ids])
        logits = F.linear(last, torch.stack([head.weight[i] for i in token_ids]), bias)
    text_config = inner.config.get_text_config()
    if getattr(text_config, "logit_scale", None) is not None:
        logits = logits * text_config.logit_scale
    if getattr(text_config, "logits_scaling", None) is not None:
        logits = logits / text_config.logits_scaling
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
