"""TRL's fused LM head run on the packed row: the shared mechanism of the preference and RL trainer plugins
(:mod:`.trl_dpo`, :mod:`.trl_grpo`, :mod:`.trl_rloo`, :mod:`.trl_kto`).

TRL's DPO, GRPO, RLOO and KTO trainers compute every log-probability through ``add_fused_lm_head``: a call
``model(input_ids, attention_mask, labels=labels, fused_lm_head=True)`` on a padded batch (prompt + chosen and
prompt + rejected, right-padded; a left-padded prompt + its completion) returns per-token log-probabilities
``[rows, width - 1]`` (with entropy, mean logits, top-1 hits as asked), never the ``[rows, width, vocab]`` logits.
Their losses, metrics, reference / old-policy / KL forwards and loss types all read those per-token tensors.

:class:`PackedFusedHead` takes that call over on a patched model: the real tokens of every row are packed into one
row (:func:`~padfree_plugins.modeling.unpad.pack_padded_call`: the positions the padded forward would have used,
boundaries from one read from the device per call), the backbone and the fused head run on the packed tokens only
(pre-shifted labels: the head scores ``T`` packed positions, TRL's Triton path the labelled ones alone), and the
per-token outputs — scalars per token — are put back in the padded ``[rows, width - 1]`` shape, zeros at pads, as
TRL's own head leaves every unlabelled position. TRL's loss code then runs unchanged, so every loss type, metric and
logged value is TRL's. No hidden states are scattered to the padded shape, and no logits exist padded.

The same rules as ``unpad`` decide which calls are packed: a 2-D mask whose ones are contiguous in every row (left
or right padding) and at least one pad; labels that give no pad a token to predict. Any other fused call (a batch
without padding, which so costs nothing extra; a mask with holes), and every call without ``fused_lm_head``
(``generate()``, TRL's extra logits forward for ``compute_metrics``) runs TRL's own forward, padded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from padfree_plugins.assembly import Assembly, assemble
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.base import keeps_methods, library_class
from padfree_plugins.integrations.checks import check_parallelism
from padfree_plugins.modeling import unpad
from padfree_plugins.modeling.patching import own_attribute, restore_attributes, unwrap_model
from padfree_plugins.packing.batch import BOUNDARY_KEYS, MEDIA_KEYS

logger = logging.getLogger("padfree_plugins")

#: Inputs with which a fused call is left to TRL's own forward: a cache, embeddings instead of tokens, boundaries
#: (already packed), images (vision-language models: not yet packed).
UNPACKED_INPUTS = ("past_key_values", "inputs_embeds", *MEDIA_KEYS, *BOUNDARY_KEYS)


def fused_forward_of(model: Any) -> Any:
    """The forward TRL's ``add_fused_lm_head`` put on ``model`` (an instance attribute), or ``None``."""
    method = vars(model).get("forward")
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    return method if code is not None and code.co_name == "_fused_forward" else None


def padded_per_token(value: Any, unpadded: unpad.Unpadded) -> Any:
    """A packed per-token output ``[1, T]`` in TRL's padded shape ``[rows, width - 1]`` (zeros / ``False`` at
    pads); anything else (the loss, the MoE aux loss, ``None``) as it is."""
    if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.shape[0] != 1:
        return value
    return unpadded.scatter(value)[:, :-1]


@dataclass
class PackedFusedHead:
    """A model's TRL fused forward taken over: its fused calls on padded batches run on the packed row (see the
    module docstring). :meth:`remove` puts TRL's forward back."""

    model: Any
    original: Any
    saved: dict = field(default_factory=dict)

    @classmethod
    def install(cls, model: Any) -> PackedFusedHead:
        original = fused_forward_of(model)
        if original is None:
            raise PadfreeError(
                f"{type(model).__name__} has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head), which the "
                "trainer adds in its __init__ and the packed log-probabilities run through: accelerate the trainer "
                "after building it, with its own model")
        head = cls(model, original, {"forward": own_attribute(model, "forward")})
        model.forward = head.forward
        return head

    def forward(self, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                **kwargs: Any) -> Any:
        packed = None
        mask = kwargs.get("attention_mask")
        if fused_lm_head and not args and shift_labels is None and isinstance(labels, torch.Tensor) and isinstance(
                mask, torch.Tensor) and labels.shape == mask.shape and not any(
                kwargs.get(key) is not None for key in UNPACKED_INPUTS):
            packed = unpad.pack_padded_call(kwargs, mask, labels.to(mask.device))
        if packed is None:
            return self.original(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                                 **kwargs)
        inputs, unpadded = packed
        # the label each packed token predicts: the padded row's next column (-100 past the row's end)
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        inputs["shift_labels"] = shifted.reshape(-1).index_select(0, unpadded.index.to(shifted.device))[None]
        output = self.original(fused_lm_head=True, **inputs)
        for key in list(output.keys()):
            output[key] = padded_per_token(output[key], unpadded)
        return output

    def remove(self) -> None:
        restore_attributes(self.model, self.saved)


@dataclass
class FusedTrainerPatch:
    """A TRL trainer whose log-probabilities run through the fused LM head, trained with :class:`PackedFusedHead`
    on its policy and its reference model (patched padding-free too, with the policy's config). Nothing else of the
    trainer changes: its collator, generation, losses and metrics are TRL's. :meth:`undo` restores everything."""

    #: The TRL trainer class the plugin claims (by name, from a ``trl`` module), and a short name for messages.
    trainer_class: ClassVar[str] = ""
    kind: ClassVar[str] = "trl"
    #: The methods a subclass must keep for the plugin to claim it (one that overrides them gets ``any_trainer``).
    kept_methods: ClassVar[tuple[str, ...]] = ("compute_loss", "prediction_step", "_compute_loss")

    trainer: Any
    assembly: Assembly
    heads: list = field(default_factory=list)
    ref_assembly: Assembly | None = None
    active: bool = True

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        return keeps_methods(trainer, library_class(trainer, "trl", cls.trainer_class), cls.kept_methods)

    def check(self) -> None:
        """Refuse, before anything changes, what this trainer cannot do packed (a subclass adds its own)."""
        trainer, config, name = self.trainer, self.assembly.config, type(self.trainer).__name__
        if getattr(trainer, "_is_vision_dataset", False) or getattr(trainer, "_is_vlm", False):
            raise PadfreeError(
                f"{name} on images: padfree-plugins does not pack vision-language batches yet (their image tokens "
                "and positions need the multimodal collator); train this one padded, without accelerate()")
        if config.batching.strategy == "tokens":
            raise ConfigError(
                f"batching.strategy: tokens fills packed batches up to a token budget, but {name} keeps TRL's own "
                "batches (its collator, its generation), which padfree-plugins packs at every forward: use "
                "batching.strategy: examples")
        if getattr(trainer, "neftune_noise_alpha", None) is not None:
            raise PadfreeError(
                f"neftune_noise_alpha with {name}: the trainer's NEFTune hook scales its noise by the length of the "
                "row it sees, which packed is the row of every sequence (far weaker noise than padded): train "
                "without NEFTune")
        if self.assembly.plan.architecture.kind != "decoder":
            raise PadfreeError(f"{name} trains a causal language model; {type(self.assembly.model).__name__} is an "
                               f"{self.assembly.plan.architecture.kind}")

    @classmethod
    def wrap(cls, trainer: Any, assembly: Assembly) -> FusedTrainerPatch | None:
        if not cls.claims(trainer):
            return None
        check_parallelism(trainer)
        if trainer.model is None or unwrap_model(trainer.model) is not assembly.model:
            raise PadfreeError("the assembly was built for another model than trainer.model")
        patch = cls(trainer, assembly)
        patch.check()
        try:
            patch.install()
        except BaseException:
            patch.undo()
            raise
        return patch

    def install(self) -> None:
        self.heads.append(PackedFusedHead.install(self.assembly.model))
        ref_model = getattr(self.trainer, "ref_model", None)
        if ref_model is not None:
            inner = unwrap_model(ref_model)
            self.ref_assembly = assemble(inner, self.assembly.config)
            self.heads.append(PackedFusedHead.install(inner))

    def undo(self) -> None:
        """TRL's fused forwards back on the policy and the reference model, the reference model unpatched. Safe
        twice."""
        if not self.active:
            return
        for head in reversed(self.heads):
            head.remove()
        self.heads.clear()
        if self.ref_assembly is not None:
            self.ref_assembly.undo()
        self.active = False


def refuse_vllm_without_cuda(trainer: Any) -> None:
    """vLLM generates on a GPU only: ``use_vllm=True`` without CUDA is refused (on a GPU it works as TRL's: vLLM
    generates, every log-probability runs packed)."""
    if getattr(trainer.args, "use_vllm", False) and not torch.cuda.is_available():
        raise ConfigError(
            f"use_vllm=True with {type(trainer).__name__} on a machine without CUDA: vLLM generates on a GPU only. "
            "Set use_vllm=False (generation through model.generate), or train on a GPU")
