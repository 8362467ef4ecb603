"""The equivalence probe: prove, on the real model, that an undeclared architecture is safe to pack.

A model type that no plugin declares is refused by default. With ``architecture: probe`` in the acceleration
config, assembly instead reads the model, patches it and runs a check before handing it over. The probe is built
so that it cannot be fooled:

* **It refuses without measuring** what no measurement can clear on small rows: a sequence-mixing module that
  never sees the example boundaries (a convolution over the sequence, a state-space scan, a linear-attention
  recurrence: :func:`sequence_mixers`), and structure a model keeps only in its own mask or computes from the
  row's absolute positions (chunked attention, an attention temperature from positions: :data:`ROW_STRUCTURE`).
  A window the config declares that no attention call receives is refused too: it lives in the mask alone.
* **Its rows are longer than every length the config declares** (windows, chunks, the original context of a
  scaled rope), with examples that straddle each of them (:func:`probe_lengths`), plus a single token and two
  equal lengths.
* **Its rows hold the tokens a model treats specially**: BOS / CLS first, EOS / SEP last, mask tokens in a share
  that differs from example to example, ids next to the pad id (:func:`probe_examples`).
* **What it reads comes from the model**: whether attention looks both ways (a later token changed, does an
  earlier output move? :func:`reads_both_ways`), where positions start (a position table with a padding index
  starts after it, as RoBERTa's: :func:`position_start_of`), per-layer attributes of heterogeneous configs.
* **It runs in float64, at a relative tolerance** (:data:`RELATIVE_TOLERANCE`): the model is converted for the
  probe and back (losslessly), so that no leak is hidden by rounding — 1e-6 of the output scale is caught in a
  24-layer model, where fp32 rounding alone reaches 1e-4. (It needs the parameters' memory in float64.)

The reference runs each example alone with the model's own attention implementation (as before the patch), so
structure only the model's own mask carries is measured too. Eval mode and no gradients while it runs; the
model's mode, dtypes and the global random state are left as they were. If anything differs, the patch is undone
and assembly fails with the measurement and how to add a plugin.

A model type that a plugin declares is used as declared: ``probe`` only changes what happens to unknown ones.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from padfree_plugins.config.model_configs import layer_values, uses_sliding_window
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import UnsupportedArchitectureError
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.modeling.patching import patch_of
from padfree_plugins.packing.collator import PackingCollator

#: The value of ``architecture:`` that asks for a probe of undeclared model types.
PROBE = "probe"
#: The plugin name a probed architecture is attributed to (in ``Plan.architecture_plugin``).
PROBE_PLUGIN = "probe"
#: Example lengths of every probe: a single token, equal lengths, a longer one (more straddle declared lengths).
PROBE_LENGTHS = (1, 9, 9, 23, 4)
#: Largest difference accepted, relative to the largest output of the example alone. The probe runs in float64,
#: where packed and per-example runs differ by ~1e-15 of the scale; models that force parts of their forward to
#: fp32 whatever the parameters' dtype (eager softmax in fp32, MoE routers) differ by up to 2e-7 (the sweep's
#: largest); in fp32 alone, rounding reaches 1e-5–1e-4 in a 24-layer model, as large as the leaks to be caught.
RELATIVE_TOLERANCE = 1e-6
#: Declared lengths up to this are straddled by probe examples; longer ones (a 128k window) would cost a probe of
#: hundreds of thousands of tokens, and are checked structurally only (a window must reach attention).
LONGEST_PROBED_LENGTH = 8192
#: Config attributes that declare a length over which a model's attention or positions change.
DECLARED_LENGTHS = ("sliding_window", "attention_chunk_size", "local_attention", "original_max_position_embeddings",
                    "floor_scale")
#: Config attributes of structure kept in the model's own mask, or computed from the row's absolute positions:
#: the patched attention never sees it, so a packed row would lose it — refused at every size.
ROW_STRUCTURE = {
    "attention_chunk_size": "chunked attention, which only the model's own mask carries",
    "attn_temperature_tuning": "an attention temperature computed from positions along the whole row",
}
#: Layer kinds (``config.layer_types``) of attention the backends implement (a window comes as ``sliding_window``).
ATTENTION_LAYER_KINDS = {"full_attention", "sliding_attention", "attention", "global", "local", "full", "sliding"}
#: Layer kinds that say which feed-forward a layer has: they mix no tokens.
FEED_FORWARD_LAYER_KINDS = {"moe", "dense", "mlp", "sparse_moe", "dense_mlp"}
#: Layer kinds that mix the sequence outside attention (a convolution, a recurrence, a state-space scan).
MIXER_LAYER_KINDS = re.compile(r"conv|linear|mamba|ssm|hybrid|rwkv|recurrent|delta|retention|lightning")
#: Module class names of sequence mixers that carry state or taps along the sequence (case-sensitive: ``Ssm`` must
#: not match the ``ssM`` of ``GptOssMLP``).
SEQUENCE_MIXER_NAMES = re.compile(r"Mamba|MAMBA|Ssm|SSM|ShortConv|DeltaNet|LinearAttention|Rwkv|RWKV|Retention|"
                                  r"Hyena|Lightning|KimiDelta|Kda|KDA|CausalConv|ConvLayer|Recurrent")
#: Special-token ids a model may treat specially, by config attribute.
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token_id", "cls_token_id", "eos_token_id", "sep_token_id", "mask_token_id",
                            "decoder_start_token_id", "image_token_id")


def probed_architecture(model_config: Any, model: Any = None) -> Architecture:
    """The provisional declaration of an undeclared model type, valid only once :func:`verify` passes.

    With ``model``, whether it is an encoder and where its positions start are read from the model itself;
    without (``padfree-plugins check``), from its config."""
    model_type = model_config.model_type
    if getattr(model_config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is an encoder-decoder model; padding-free packing (and its probe) covers "
            "decoder-only and encoder-only models. Add an architecture plugin for it (docs/writing-a-plugin.md)."
        )
    kind = probed_kind(model_config) if model is None else ("encoder" if reads_both_ways(model) else "decoder")
    start = 0 if model is None else position_start_of(model)
    return Architecture(f"probed:{model_type}", (model_type,), kind=kind,
                        position_start=functools.partial(_constant, start),
                        default_pooling="first" if kind == "encoder" else "last",
                        description=f"{model_type}, accepted by the equivalence probe at assembly")


def _constant(value: int, model_config: Any) -> int:
    return value


def probed_kind(model_config: Any) -> str:
    """From the config alone: ``"encoder"`` for a model type transformers gives a masked-LM head (BERT-shaped),
    unless its config makes it a decoder (``is_decoder``); ``"decoder"`` otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    masked_lm = model_config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return "encoder" if masked_lm and not getattr(model_config, "is_decoder", False) else "decoder"


# -- what is read from the model ---------------------------------------------------------------------------------


def _body(model: Any) -> Any:
    return getattr(model, "base_model", model)  # per-token outputs: a classifier head pools one vector per row


def _vocab_size(model: Any) -> int:
    """The token-id range of the model's input embeddings (or its config's vocab size)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # transformers' default raises for models that do not say
        embeddings = None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int):
        raise UnsupportedArchitectureError(
            f"model type {getattr(model.config, 'model_type', '?')!r} has no token embeddings the probe can feed "
            "(no input embeddings, no vocab_size): it is not a text model padfree-plugins can pack")
    return vocab


@contextmanager
def _quiet_eval(model: Any) -> Iterator[None]:
    """Eval mode, no gradients, the global random state untouched; the model's mode restored after."""
    was_training = model.training
    state = torch.random.get_rng_state()
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        torch.random.set_rng_state(state)


def reads_both_ways(model: Any, length: int = 6) -> bool:
    """Whether the model's attention looks both ways: an earlier token's output moves when a later token changes
    (run with the model's own attention, before any patch)."""
    vocab = _vocab_size(model)
    device = next(model.parameters()).device
    ids = torch.arange(length, device=device)[None] % max(vocab - 10, 1) + min(10, vocab - 1)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    with _quiet_eval(model), original_attention(model):
        first = _outputs(_body(model)(input_ids=ids))[0, 0]
        second = _outputs(_body(model)(input_ids=changed))[0, 0]
    return not torch.allclose(first, second, atol=0.0, rtol=1e-6)


def position_start_of(model: Any) -> int:
    """Where the model's own embeddings start positions: after the padding index of a position table that has one
    (RoBERTa, ESM, X-MOD, MarkupLM …), else 0."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "position_embeddings" and isinstance(module, torch.nn.Embedding):
            if module.padding_idx is not None:
                return int(module.padding_idx) + 1
    return 0


def sequence_mixers(model: Any) -> list[str]:
    """Modules that mix tokens along the sequence other than through attention: a 1-D convolution (not GPT-2's
    ``Conv1D``, a linear layer), a state-space scan, a linear-attention recurrence, and layer kinds other than
    attention in ``config.layer_types``. None of them sees the example boundaries."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or (SEQUENCE_MIXER_NAMES.search(kind) and kind != "Conv1D"):
            found.append(f"{name or 'model'} ({kind})")
    found += [f"layer type {kind!r}" for kind in _layer_kinds(model.config) if MIXER_LAYER_KINDS.search(kind)]
    return found


def _layer_kinds(model_config: Any) -> list[str]:
    kinds = [str(kind) for layers in layer_values(model_config, "layer_types") for kind in (layers or ())]
    return [kind for kind in dict.fromkeys(kinds)
            if kind not in ATTENTION_LAYER_KINDS and kind not in FEED_FORWARD_LAYER_KINDS]


def unknown_attention_kinds(model_config: Any) -> list[str]:
    """``layer_types`` entries the probe does not know that are no sequence mixer either — attention of another
    kind (sparse or indexed selection, compressed or reference attention, chunks …): what it selects could reach
    across examples on rows longer than the probe's."""
    return [kind for kind in _layer_kinds(model_config) if not MIXER_LAYER_KINDS.search(kind)]


def row_structure(model_config: Any) -> list[str]:
    """The structure :data:`ROW_STRUCTURE` names that the config switches on."""
    return [reason for name, reason in ROW_STRUCTURE.items() if any(layer_values(model_config, name))]


def declared_lengths(model_config: Any) -> list[int]:
    """Every length the config declares (:data:`DECLARED_LENGTHS`, in ``rope_scaling`` / ``rope_parameters``
    too), below the model's position limit."""
    lengths = [value for name in DECLARED_LENGTHS for value in layer_values(model_config, name)]
    for name in ("rope_scaling", "rope_parameters"):
        for value in layer_values(model_config, name):
            for table in (value.values() if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())
                          else [value]):
                if isinstance(table, dict):
                    lengths.append(table.get("original_max_position_embeddings"))
    return sorted({int(n) for n in lengths if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 1})


def probe_lengths(model_config: Any, position_start: int = 0) -> tuple[int, ...]:
    """:data:`PROBE_LENGTHS`, and for every declared length ``L``: examples of ``L - 1`` and ``L + 3`` tokens (one
    within, one straddling it), within the model's position table."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(text, "max_position_embeddings", None)
    limit = int(limit) - position_start if isinstance(limit, int) and limit > 0 else None
    lengths = list(PROBE_LENGTHS)
    for length in declared_lengths(model_config):
        if length <= LONGEST_PROBED_LENGTH:
            lengths += [length - 1, length + 3]
    return tuple(n for n in lengths if limit is None or n <= limit)


def special_token_ids(model_config: Any, vocab: int) -> dict[str, int]:
    """The special-token ids the config names (one value per name; lists keep their first), within the vocab."""
    configs = [model_config]
    if hasattr(model_config, "get_text_config") and model_config.get_text_config() is not model_config:
        configs.append(model_config.get_text_config())
    found: dict[str, int] = {}
    for name in SPECIAL_TOKEN_ATTRIBUTES + ("pad_token_id",):
        for config in configs:
            value = getattr(config, name, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(value, int) and 0 <= value < vocab and name not in found:
                found[name] = value
    return found


def probe_examples(model_config: Any, vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[dict]:
    """Random examples of ``lengths`` that hold the tokens a model treats specially: each starts with BOS / CLS and
    ends with EOS / SEP (when long enough and the config names them), example ``i`` holds ``i`` mask tokens (so
    every example's share of masks differs), and ids next to the pad id appear in the middle."""
    generator = torch.Generator().manual_seed(seed)
    special = special_token_ids(model_config, vocab)
    low = min(10, vocab - 1)
    pad = special.get("pad_token_id")
    near_pad = [i for i in ((pad - 1, pad + 1) if pad is not None else ()) if 0 <= i < vocab]
    first = special.get("bos_token_id", special.get("cls_token_id"))
    last = special.get("eos_token_id", special.get("sep_token_id"))
    examples = []
    for index, n in enumerate(lengths):
        ids = torch.randint(low, vocab, (n,), generator=generator).tolist()
        if n >= 3:
            ids[0] = first if first is not None else ids[0]
            ids[-1] = last if last is not None else ids[-1]
            middle = list(range(1, n - 1))
            mask = special.get("mask_token_id")
            for offset, position in enumerate(middle[: min(index, len(middle) // 2)] if mask is not None else ()):
                ids[middle[-1 - offset]] = mask
            for offset, token in enumerate(near_pad[: len(middle)]):
                ids[middle[offset]] = token
        examples.append({"input_ids": ids})
    return examples


# -- the measurement --------------------------------------------------------------------------------------------


@dataclass
class ProbeResult:
    """What the probe measured: the largest relative difference, or why it refused."""

    model_type: str
    error: float | None
    tolerance: float
    failure: str | None = None
    lengths: tuple[int, ...] = ()
    measured: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.error is not None and self.error <= self.tolerance

    def explain(self) -> str:
        if self.failure and not self.measured:
            found = self.failure
        elif self.failure:
            found = f"the packed forward failed: {self.failure}"
        else:
            lengths = ", ".join(map(str, self.lengths))
            found = (f"packed outputs differ from each example run alone by {self.error:.2e} of the output scale "
                     f"in float64 (tolerance {self.tolerance:.0e}; example lengths {lengths})")
        return (
            f"model type {self.model_type!r} failed the padding-free equivalence probe: {found.rstrip('.')}. "
            "Training it padding-free would mix examples, so it is refused. To support it, write an architecture "
            "plugin (docs/writing-a-plugin.md): declare the model type and, if its layers do not pass **kwargs on to "
            "attention, mix the sequence other than through attention, or its positions are not position_ids, "
            "implement patch_model; the equivalence test in the plugin template proves it exact."
        )


def _outputs(result: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    raise TypeError(f"the model returned {type(result).__name__}, with neither logits nor last_hidden_state")


@contextmanager
def original_attention(model: Any) -> Iterator[None]:
    """Run ``model`` with the attention implementation it had before its padfree patch (if it has one)."""
    patch = patch_of(model)
    if patch is None or patch.previous_implementation is None:
        yield
        return
    model.set_attn_implementation(patch.previous_implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(patch.implementation)


@contextmanager
def in_float64(model: Any) -> Iterator[None]:
    """The model's floating parameters and buffers in float64 for the block, then back (lossless: every 16- and
    32-bit value is a float64 value)."""
    changed = [(t, t.dtype) for t in (*model.parameters(), *model.buffers())
               if t.is_floating_point() and t.dtype != torch.float64]
    try:
        for tensor, _ in changed:
            tensor.data = tensor.data.double()
        yield
    finally:
        for tensor, dtype in changed:
            tensor.data = tensor.data.to(dtype)


@contextmanager
def eager_experts(model: Any) -> Iterator[None]:
    """A mixture of experts run by its eager loop for the block (the grouped-matmul kernels take no float64)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_experts_implementation", None)
    settable = previous not in (None, "eager") and getattr(type(model), "_can_set_experts_implementation", None)
    if not settable or not type(model)._can_set_experts_implementation():
        yield
        return
    model.set_experts_implementation("eager")
    try:
        yield
    finally:
        model.set_experts_implementation(previous)


def _refusal(model_type: str, reason: str) -> ProbeResult:
    return ProbeResult(model_type, None, RELATIVE_TOLERANCE, reason, measured=False)


def run_probe(model: Any, position_start: int = 0, lengths: tuple[int, ...] | None = None,
              seed: int = 0) -> ProbeResult:
    """Check a patched ``model`` (a transformers ``PreTrainedModel``): refuse what cannot be measured, then compare
    packed and per-example outputs."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    mixers = sequence_mixers(model)
    if mixers:
        return _refusal(model_type, f"it mixes the sequence outside attention, where the example boundaries never "
                        f"arrive ({', '.join(mixers[:4])}{' …' if len(mixers) > 4 else ''}): a packed row would "
                        "carry state or convolution taps from one example into the next (a hybrid family restarts "
                        "its mixers at every example once declared with padfree_plugins.modeling.hybrids.Hybrid: "
                        "docs/writing-a-plugin.md, 'A hybrid family')")
    structure = row_structure(model.config)
    if structure:
        return _refusal(model_type, f"its config declares {' and '.join(structure)}: a packed row loses it at "
                        "every length")
    unknown = unknown_attention_kinds(model.config)
    if unknown:
        return _refusal(model_type, f"its layers use attention of a kind the probe does not know "
                        f"({', '.join(map(repr, unknown))}): a sparse or selective attention could reach across "
                        "examples on rows longer than the probe's")
    lengths = probe_lengths(model.config, position_start) if lengths is None else lengths
    examples = probe_examples(model.config, _vocab_size(model), lengths, seed)
    device = next(model.parameters()).device
    batch = PackingCollator(position_start=position_start)(examples).to(device)
    with _quiet_eval(model), in_float64(model), eager_experts(model):
        try:
            with record_attention_calls() as calls:
                packed = _outputs(_body(model)(**batch.model_inputs()))[0].double()
        except torch.OutOfMemoryError:
            raise  # the machine's limit, not the architecture's
        except Exception as exc:  # noqa: BLE001 - any other failure of the packed forward is a refusal
            return ProbeResult(model_type, None, RELATIVE_TOLERANCE, f"{type(exc).__name__}: {exc}", lengths)
        if uses_sliding_window(model.config) and calls and not any(c.window for c in calls):
            return _refusal(model_type, "its config declares a sliding window that no attention call receives: "
                            "the window lives in the model's own mask only, which a packed row never builds")
        with original_attention(model):  # the reference: the model as it was before the patch
            try:
                references = [_outputs(_body(model)(input_ids=torch.tensor([ex["input_ids"]], device=device)))[0]
                              .double() for ex in examples]
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - the model itself cannot run the probe (in float64)
                return ProbeResult(model_type, None, RELATIVE_TOLERANCE, f"the model alone failed in float64: "
                                   f"{type(exc).__name__}: {exc}", lengths)
    error, start = 0.0, 0
    for example, alone in zip(examples, references):
        got = packed[start : start + len(example["input_ids"])]
        start += len(example["input_ids"])
        if got.shape != alone.shape:
            return ProbeResult(model_type, None, RELATIVE_TOLERANCE, f"packed outputs have shape {tuple(got.shape)} "
                               f"per example, expected {tuple(alone.shape)}", lengths)
        scale = alone.abs().max().clamp(min=1e-12)
        difference = float(((got - alone).abs().max() / scale).item())
        error = max(error, difference if math.isfinite(difference) else math.inf)
    return ProbeResult(model_type, error, RELATIVE_TOLERANCE, lengths=lengths)


def verify(model: Any, position_start: int = 0) -> ProbeResult:
    """Run the probe and raise :class:`UnsupportedArchitectureError` (with the measurement) unless it passes."""
    result = run_probe(model, position_start)
    if not result.ok:
        raise UnsupportedArchitectureError(result.explain())
    return result
