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

Image-text calls (TRL's ``DataCollatorForVisionPreference``: padded rows, every row's images concatenated in row
order as ``pixel_values`` / ``image_grid_thw``), for a family whose assembly packs grid media (Qwen-VL): with the
assembly's :class:`~padfree_plugins.packing.multimodal.MultimodalCollator` given at install, every fused call is
split into its rows (:func:`pack_media_call`: the real tokens by the mask; each row's images by its placeholder runs,
each run the length of the next grid's ``t·h·w / merge²``, the pixels split by ``t·h·w``), the rows packed by that
collator (each row's mRoPE positions as if it ran alone, its images beside its tokens), and the packed row run
through TRL's fused forward as for text. A call that cannot be split exactly (placeholders that do not match the
grids, video, other per-token inputs, an empty row) runs TRL's forward, padded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from padfree_plugins.assembly import Assembly, assemble
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.base import keeps_methods, library_class
from padfree_plugins.integrations.checks import check_parallelism, refuse_own_batches_options
from padfree_plugins.modeling import unpad
from padfree_plugins.modeling.patching import own_attribute, restore_attributes, unwrap_model
from padfree_plugins.packing.batch import BOUNDARY_KEYS, MEDIA_KEYS, MODEL_INPUT_KEYS
from padfree_plugins.packing.multimodal import TOKEN_TYPES_KEY, MultimodalCollator

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


def media_collator(assembly: Assembly | None) -> MultimodalCollator | None:
    """The assembly's multimodal collator where it packs grid media (Qwen-VL: images split by their grids), the
    collator :func:`pack_media_call` runs; ``None`` for a text-only family or media without grids."""
    collator = getattr(assembly, "collator", None)
    if isinstance(collator, MultimodalCollator) and any(media.grid is not None for media in collator.media):
        return collator
    return None


def _placeholder_runs(ids: torch.Tensor, token: int) -> list[int]:
    """The lengths of the runs of ``token`` in ``ids`` (1-D, on the CPU), in order."""
    marks = torch.cat([torch.zeros(1, dtype=torch.bool), ids == token, torch.zeros(1, dtype=torch.bool)])
    edges = torch.nonzero(marks[1:] != marks[:-1]).reshape(-1)
    return (edges[1::2] - edges[::2]).tolist()


def pack_media_call(inputs: dict, mask: torch.Tensor, labels: torch.Tensor,
                    collator: MultimodalCollator) -> tuple[dict, unpad.Unpadded] | None:
    """A padded fused call with grid media (``inputs``: its keyword arguments but the labels) split into its rows —
    each row's real tokens and its own images — and packed by ``collator`` as those examples alone would be; and
    where its tokens went. ``None`` when the call cannot be split exactly: it then runs padded."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape != mask.shape or \
            inputs.get("position_ids") is not None:
        return None
    rows, width = mask.shape
    grid_media = [media for media in collator.media if media.grid is not None]
    media_keys = {key for media in grid_media for key in media.keys}
    for key, value in inputs.items():  # anything per token, or media the collator does not split by grids, refused
        if key in ("input_ids", "attention_mask", TOKEN_TYPES_KEY) or value is None:
            continue
        if key not in media_keys and (key in MEDIA_KEYS or key in BOUNDARY_KEYS or isinstance(value, torch.Tensor)):
            return None
    spans = unpad.contiguous_rows(mask, labels)
    if spans is None or not all(length for _, length in spans):
        return None
    flat = ids.detach().cpu()
    real = [flat[row, start:start + length] for row, (start, length) in enumerate(spans)]
    examples: list[dict] = [{"input_ids": tokens.tolist()} for tokens in real]
    for media in grid_media:
        pixels, grid = inputs.get(media.pixels), inputs.get(media.grid)
        token = collator.token_ids[media.name]
        placeholders = int((flat == token).sum())
        if pixels is None and grid is None:
            if placeholders:
                return None
            continue
        if pixels is None or grid is None or not media.one_run_per_item or media.per_row:
            return None
        grid = grid.detach().cpu().long().reshape(-1, 3)
        cells = grid.prod(-1)
        # every placeholder in a row's real tokens (none at pads), every pixel row in a grid
        if int(cells.sum()) != pixels.shape[0] or placeholders != sum(int((tokens == token).sum()) for tokens in real):
            return None
        extras = {key: inputs[key] for key in media.extra if inputs.get(key) is not None}
        if any(len(value) != len(grid) for value in extras.values()):
            return None
        item, row_start = 0, 0
        for example, tokens in zip(examples, real):
            runs = _placeholder_runs(tokens, token)
            count = len(runs)
            if item + count > len(grid) or runs != (cells[item:item + count] // collator.merge ** 2).tolist():
                return None
            if count:
                pixel_rows = int(cells[item:item + count].sum())
                example[media.pixels] = pixels[row_start:row_start + pixel_rows]
                example[media.grid] = grid[item:item + count]
                for key, value in extras.items():
                    example[key] = value[item:item + count]
                row_start += pixel_rows
            item += count
        if item != len(grid):
            return None
    types = inputs.get(TOKEN_TYPES_KEY)
    if isinstance(types, torch.Tensor):  # the padded forward's modalities: those the collator reads off the tokens
        if types.shape != mask.shape:
            return None
        flat_types = types.detach().cpu()
        for row, ((start, length), tokens) in enumerate(zip(spans, real)):
            want = torch.zeros_like(tokens)
            for media in collator.media:
                want[tokens == collator.token_ids[media.name]] = media.modality
            if not torch.equal(flat_types[row, start:start + length].long(), want):
                return None
    try:
        batch = collator(examples)
    except PadfreeError:
        return None
    index = torch.cat([torch.arange(length) + row * width + start for row, (start, length) in enumerate(spans)])
    lengths = [length for _, length in spans]
    if batch["cu_seq_lens_q"].diff().tolist() != lengths or \
            not torch.equal(batch["input_ids"].reshape(-1).cpu(), flat.reshape(-1).index_select(0, index)):
        return None
    device = mask.device
    packed = {key: value for key, value in inputs.items()
              if key not in ("input_ids", "attention_mask", TOKEN_TYPES_KEY) and key not in media_keys}
    for key in (*MODEL_INPUT_KEYS, *media_keys):
        if key in batch:
            value = batch[key]
            packed[key] = value.to(device) if isinstance(value, torch.Tensor) else value
    return packed, unpad.Unpadded(rows, width, index)


@dataclass
class PackedFusedHead:
    """A model's TRL fused forward taken over: its fused calls on padded batches run on the packed row (see the
    module docstring). :meth:`remove` puts TRL's forward back."""

    model: Any
    original: Any
    saved: dict = field(default_factory=dict)
    #: The assembly's multimodal collator (:func:`media_collator`): every fused call is then packed through it,
    #: images and all (:func:`pack_media_call`); ``None``: text only, calls with media run padded.
    collator: MultimodalCollator | None = None

    @classmethod
    def install(cls, model: Any, collator: MultimodalCollator | None = None) -> PackedFusedHead:
        original = fused_forward_of(model)
        if original is None:
            raise PadfreeError(
                f"{type(model).__name__} has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head), which the "
                "trainer adds in its __init__ and the packed log-probabilities run through: accelerate the trainer "
                "after building it, with its own model")
        head = cls(model, original, {"forward": own_attribute(model, "forward")}, collator)
        model.forward = head.forward
        return head

    def forward(self, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                **kwargs: Any) -> Any:
        packed = None
        mask = kwargs.get("attention_mask")
        fused = fused_lm_head and not args and shift_labels is None and isinstance(labels, torch.Tensor) and \
            isinstance(mask, torch.Tensor) and labels.shape == mask.shape
        if fused and self.collator is not None:
            if not any(kwargs.get(key) is not None for key in ("past_key_values", "inputs_embeds")):
                packed = pack_media_call(kwargs, mask, labels.to(mask.device), self.collator)
        elif fused and not any(kwargs.get(key) is not None for key in UNPACKED_INPUTS):
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
    #: Whether the plugin packs image-text calls (:func:`pack_media_call`) for a family whose assembly packs grid
    #: media; the others refuse vision datasets.
    packs_media: ClassVar[bool] = False

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
        images, vlm = getattr(trainer, "_is_vision_dataset", False), getattr(trainer, "_is_vlm", False)
        vision = images or vlm
        # packed with images: a vision dataset, on a family that packs grid media (a VLM on text alone: refused)
        if vision and self.packs_media and images and media_collator(self.assembly) is None:
            raise PadfreeError(
                f"{name} on images: padfree-plugins does not pack vision-language batches yet for the "
                f"{self.assembly.plan.architecture.name} plugin (TRL's image-text log-probability calls are packed "
                "for families whose images are split by their grids: the Qwen-VL families); train this one padded, "
                "without accelerate()")
        if vision and not (self.packs_media and images):
            raise PadfreeError(
                f"{name} on images: padfree-plugins does not pack vision-language batches yet (their image tokens "
                "and positions need the multimodal collator); train this one padded, without accelerate()")
        refuse_own_batches_options(
            trainer, config, name,
            batches="TRL's own batches (its collator, its generation), which padfree-plugins packs at every forward",
            noise="packed is the row of every sequence (far weaker noise than padded): train without NEFTune")
        if self.assembly.plan.architecture.kind != "decoder":
            raise PadfreeError(f"{name} trains a causal language model; {type(self.assembly.model).__name__} is an "
                               f"{self.assembly.plan.architecture.kind}")

    @classmethod
    def wrap(cls, trainer: Any, assembly: Assembly) -> FusedTrainerPatch | None:
        if not cls.claims(trainer):
            return None
        check_parallelism(trainer, assembly.config,
                          "its log-probabilities run through TRL's fused LM head on padded rows, which padfree-plugins "
                          "packs per call but does not split across ranks yet")
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
        media = self.packs_media
        self.heads.append(PackedFusedHead.install(self.assembly.model,
                                                  media_collator(self.assembly) if media else None))
        ref_model = getattr(self.trainer, "ref_model", None)
        if ref_model is not None:
            inner = unwrap_model(ref_model)
            self.ref_assembly = assemble(inner, self.assembly.config)
            self.heads.append(PackedFusedHead.install(inner, media_collator(self.ref_assembly) if media else None))

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
