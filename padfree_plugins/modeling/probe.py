"""The equivalence probe: prove, on the real model, that an undeclared architecture is safe to pack.

A model type that no plugin declares is refused by default. With ``architecture: probe`` in the acceleration
config, assembly instead patches the model and runs a tiny check before handing it over: a few short random
examples (one of them a single token, two of equal length) go through the patched model once packed, and once
each alone with the model's own attention implementation (as before the patch); the packed outputs must equal the
per-example ones. The reference is unpatched so that structure only the model's own mask carries (Llama 4's
chunked attention), which patched calls would lose packed and alone alike, is measured. Eval mode and no
gradients while it runs; the model's train/eval mode and the global random state are left as they were. If the
outputs differ (or the packed forward raises), the patch is undone and assembly fails with the measured
difference and how to add a plugin, so that an architecture that mixes examples is never trained silently wrong.

A model type that a plugin declares is used as declared: ``probe`` only changes what happens to unknown ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import UnsupportedArchitectureError
from padfree_plugins.modeling.patching import patch_of
from padfree_plugins.packing.collator import PackingCollator

#: The value of ``architecture:`` that asks for a probe of undeclared model types.
PROBE = "probe"
#: The plugin name a probed architecture is attributed to (in ``Plan.architecture_plugin``).
PROBE_PLUGIN = "probe"
#: Example lengths of the probe: a single token, equal lengths, a longer one.
PROBE_LENGTHS = (1, 9, 9, 23, 4)
#: Largest relative difference accepted, by parameter dtype (16-bit kernels differ by rounding, not by mixing).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def probed_architecture(model_config: Any) -> Architecture:
    """The provisional declaration of an undeclared model type, valid only once :func:`verify` passes."""
    model_type = model_config.model_type
    if getattr(model_config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is an encoder-decoder model; padding-free packing (and its probe) covers "
            "decoder-only and encoder-only models. Add an architecture plugin for it (docs/writing-a-plugin.md)."
        )
    kind = probed_kind(model_config)
    return Architecture(f"probed:{model_type}", (model_type,), kind=kind,
                        default_pooling="first" if kind == "encoder" else "last",
                        description=f"{model_type}, accepted by the equivalence probe at assembly")


def probed_kind(model_config: Any) -> str:
    """``"encoder"`` for a model type transformers gives a masked-LM head (BERT-shaped), unless its config makes it a
    decoder (``is_decoder``); ``"decoder"`` otherwise. The kind sets the default pooling and which poolings make
    sense (a causal decoder's first token sees nothing but itself); attention follows the model's own modules."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    masked_lm = model_config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return "encoder" if masked_lm and not getattr(model_config, "is_decoder", False) else "decoder"


@dataclass
class ProbeResult:
    """What the probe measured: the largest relative difference, or why the packed forward failed."""

    model_type: str
    error: float | None
    tolerance: float
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.error is not None and self.error <= self.tolerance

    def explain(self) -> str:
        found = (f"the packed forward failed: {self.failure}" if self.failure else
                 f"packed outputs differ from each example run alone by {self.error:.2e} (relative; tolerance "
                 f"{self.tolerance:.0e})")
        return (
            f"model type {self.model_type!r} failed the padding-free equivalence probe: {found.rstrip('.')}. "
            "Training it padding-free would mix examples, so it is refused. To support it, write an architecture "
            "plugin (docs/writing-a-plugin.md): declare the model type and, if its layers do not pass **kwargs on to "
            "attention or its positions are not position_ids, implement patch_model; the equivalence test in the "
            "plugin template proves it exact."
        )


def _outputs(result: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    raise TypeError(f"the model returned {type(result).__name__}, with neither logits nor last_hidden_state")


def _vocab_size(model: Any) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    return int(model.config.get_text_config().vocab_size)


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


def run_probe(model: Any, position_start: int = 0, lengths: tuple[int, ...] = PROBE_LENGTHS,
              seed: int = 0) -> ProbeResult:
    """Compare packed and per-example outputs of a patched ``model`` (a transformers ``PreTrainedModel``)."""
    parameter = next(model.parameters())
    tolerance = TOLERANCE.get(parameter.dtype, 5e-2)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    vocab = _vocab_size(model)
    generator = torch.Generator().manual_seed(seed)
    low = min(10, vocab - 1)
    examples = [{"input_ids": torch.randint(low, vocab, (n,), generator=generator).tolist()} for n in lengths]
    batch = PackingCollator(position_start=position_start)(examples).to(parameter.device)
    body = getattr(model, "base_model", model)  # per-token outputs: a classifier head pools one vector per row
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                packed = _outputs(body(**batch.model_inputs()))[0].float()
            except torch.OutOfMemoryError:
                raise  # the machine's limit, not the architecture's
            except Exception as exc:  # noqa: BLE001 - any other failure of the packed forward is a refusal
                return ProbeResult(model_type, None, tolerance, f"{type(exc).__name__}: {exc}")
            with original_attention(model):  # the reference: the model as it was before the patch
                references = [_outputs(body(input_ids=torch.tensor([example["input_ids"]], device=parameter.device)))
                              [0].float() for example in examples]
            error, start = 0.0, 0
            for example, alone in zip(examples, references):
                got = packed[start : start + len(example["input_ids"])]
                start += len(example["input_ids"])
                if got.shape != alone.shape:
                    return ProbeResult(model_type, None, tolerance,
                                       f"packed outputs have shape {tuple(got.shape)} per example, expected "
                                       f"{tuple(alone.shape)}")
                scale = alone.abs().max().clamp(min=1e-6)
                difference = float(((got - alone).abs().max() / scale).item())
                error = max(error, difference if math.isfinite(difference) else math.inf)
    finally:
        model.train(was_training)
    return ProbeResult(model_type, error, tolerance)


def verify(model: Any, position_start: int = 0) -> ProbeResult:
    """Run the probe and raise :class:`UnsupportedArchitectureError` (with the measurement) unless it passes."""
    result = run_probe(model, position_start)
    if not result.ok:
        raise UnsupportedArchitectureError(result.explain())
    return result
