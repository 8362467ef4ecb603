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

Image-text calls (TRL's vision collators: padded rows, the rows' media given together as the processor makes them
for a batch), for every vision-language family (its assembly's
:class:`~padfree_plugins.packing.multimodal.MultimodalCollator` given at install): every fused call is split into its
rows (:func:`pack_media_call`: the real tokens by the mask; each row's media by the family's own
:meth:`~padfree_plugins.packing.multimodal.MultimodalCollator.split_call` — Qwen's grids, Gemma 3's images, Idefics3's
tiles batched per row, LLaVA-OneVision's images by size), the rows packed by that collator (each row's positions as if
it ran alone, its media beside its tokens, every example checked as in SFT), and the packed row run through TRL's
fused forward as for text. A placeholder token of a media the call has none of, typed text by the call's
``mm_token_type_ids`` (one the policy generated in a completion: TRL types completions text, and the model, given no
such media, embeds and positions it as text), is packed as text. A call that cannot be split exactly (placeholders
that do not match the media, per-token modalities that are not the placeholders' — TRL's ``mm_token_type_ids`` laid
out for right-padded prompts, say —, other per-token inputs, an empty row) runs TRL's forward, padded. With
``prefix_sharing``, rows whose prompts are equal in their tokens and in the media they hold (:func:`media_prefixes`:
pixels compared, not only placeholders) hold the prompt once, its media collated once
(:func:`~padfree_plugins.packing.multimodal.share_prompts`): the vision tower encodes each distinct prompt's images
once, and every completion keeps the positions of its whole row.

Every fused call that runs padded says why in a warning, the first time for each reason (per trainer patch:
:class:`FusedCalls`), and every fused call is counted, packed or padded by reason: ``Acceleration.describe()``
(``fused calls``) and the trainer's log (``padfree/packed_calls``, ``padfree/padded_calls``, ``padfree/shared_calls``:
packed calls whose row shares a prompt; so far) show the counts.
A call without any pad runs as it is (nothing to gain), counted apart and not said.

Under sequence parallelism (``sequence_parallel.size: N``, the model's patch holding a
:class:`~padfree_plugins.modeling.attention.ulysses.SequenceGroup`), each rank packs its own fused call (a batch
without padding too), the group's packed rows are exchanged and joined, each rank runs TRL's fused forward on its
slice of the joined row (the labels shifted already, so nothing is shifted again), every per-token output is
gathered back to the whole row (differentiable: each rank's gradient flows to the slice's owner), and each rank keeps
its own call's tokens. Each rank's TRL loss then reads exactly its own examples' log-probabilities, as under data
parallelism. The ranks of a group agree at every fused call whether all of them pack it (one small all-reduce): if
one cannot, every rank runs its own call through TRL's forward, padded, so that their collectives stay in step.
An image-text call is exchanged with its media (each rank's pixels and grids, in rank order) and goes to the model
whole on every rank, its ``shift_labels`` sliced: the model embeds the joined row, each rank's vision tower encodes its
own call's media and the features are all-gathered (:mod:`~padfree_plugins.modeling.tower_share`) and merged, and its
language model takes this rank's slice
(:class:`~padfree_plugins.modeling.sequence_parallel.SliceRow`), so that an image cut by a rank boundary is whole.
With ``prefix_sharing``
each rank's call shares its prompts, and its row's prompt structure travels with it (one parent per segment:
:data:`~padfree_plugins.packing.sequence_parallel.SEGMENT_PARENTS_KEY`): the joined row is one shared row, built
alike on every rank, and attention applies it to the whole row (Ulysses: every rank holds every token of its heads;
all-gather: each slice's queries against their segments' keys of the gathered row), so a completion whose prompt lies
in another rank's slice attends to it; a hybrid's split sequence mixers start each completion from its prompt's state,
handed on from the rank where the prompt ended (:mod:`~padfree_plugins.modeling.split_mixers`). Ulysses mixed with
all-gather does not take a split shared row (refused at ``accelerate()``:
:func:`~padfree_plugins.integrations.checks.why_not_split_shared`).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from padfree_plugins.assembly import Assembly, assemble, pad_token_of
from padfree_plugins.batching.sampler import check_whole_micro_batches, trainer_train_dataloader, uses_token_budget
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.base import keeps_methods, library_class
from padfree_plugins.integrations.checks import check_parallelism, check_whole_rows_budget, image_text_loads, \
    refuse_own_batches_options, sequence_parallel_size, shares_prefixes
from padfree_plugins.integrations.resume import ResumeGuard, plan_fingerprint
from padfree_plugins.modeling import unpad
from padfree_plugins.modeling.mixers import mixer_chunk
from padfree_plugins.modeling.attention.ulysses import SequenceGroup, gather_sequence
from padfree_plugins.modeling.patching import own_attribute, patch_of, restore_attributes, unwrap_model
from padfree_plugins.modeling.sequence_parallel import gather_rows
from padfree_plugins.modeling.tower_share import kept_media, media_counts, media_shares
from padfree_plugins.packing.batch import BOUNDARY_KEYS, MEDIA_KEYS, MODEL_INPUT_KEYS, packed_tokens
from padfree_plugins.packing.multimodal import MODALITY_KEYS, TOKEN_TYPES_KEY, MultimodalCollator, media_equal, \
    share_prompts
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, SharedPrefixes
from padfree_plugins.packing.sequence_parallel import MAX_KEYS, SEGMENT_PARENTS_KEY, join_rows, segment_parents, \
    slice_row


#: Inputs with which a fused call is left to TRL's own forward: a cache, embeddings instead of tokens, boundaries
#: (already packed), images (vision-language models: not yet packed).
UNPACKED_INPUTS = ("past_key_values", "inputs_embeds", *MEDIA_KEYS, *BOUNDARY_KEYS, SHARED_PREFIXES_KEY)


def fused_forward_of(model: Any) -> Any:
    """The forward TRL's ``add_fused_lm_head`` put on ``model`` (an instance attribute), or ``None``."""
    method = vars(model).get("forward")
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    return method if code is not None and code.co_name == "_fused_forward" else None


def refuse_trl_without_fused_head(name: str) -> None:
    """Refuse, before anything changes, a TRL without ``trl.trainer.utils.add_fused_lm_head`` (added in TRL 1.15):
    the packed log-probability calls take over the fused forward it adds to the trainer's model."""
    import trl
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "add_fused_lm_head"):
        raise ConfigError(f"{name} on TRL {trl.__version__}: padfree-plugins packs its log-probability calls through "
                          "TRL's fused LM head (trl.trainer.utils.add_fused_lm_head), which this TRL does not have. "
                          "Upgrade TRL (pip install 'trl>=1.16', the version tested), or train this trainer padded")


def fused_forward_under_autocast(model: Any, accelerator: Any) -> tuple[Any, Any]:
    """TRL's fused forward of a model that ``accelerator.prepare_model`` wrapped for mixed precision (its
    ``_original_forward``), and a function wrapping another forward the same way (autocast, outputs to fp32);
    ``(None, None)`` when the model is not so wrapped."""
    inner = vars(model).get("_original_forward")
    code = getattr(getattr(inner, "__func__", inner), "__code__", None)
    if code is None or code.co_name != "_fused_forward" or not getattr(accelerator, "native_amp", False):
        return None, None
    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.modeling import get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    return inner, lambda forward: convert_outputs_to_fp32(autocast(forward))


def padded_per_token(value: Any, unpadded: unpad.Unpadded) -> Any:
    """A packed per-token output ``[1, T]`` in TRL's padded shape ``[rows, width - 1]`` (zeros / ``False`` at
    pads); anything else (the loss, the MoE aux loss, ``None``) as it is."""
    if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.shape[0] != 1:
        return value
    return unpadded.scatter(value)[:, :-1].contiguous()  # not a view (FSDP2 warns of views a module returns)


def all_ranks_pack(packs: bool, group: SequenceGroup, device: Any) -> bool:
    """Whether every rank of the sequence-parallel ``group`` packs its fused call (``packs``: this rank's)."""
    flag = torch.tensor([int(packs)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.group)
    return bool(flag.item())


def own_tokens(whole: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """Rank ``rank``'s own tokens of the group's joined row ``whole`` ``[1, T, ...]`` (the ranks' rows of ``sizes``
    tokens back to back, then the padding segment)."""
    start = sum(sizes[:rank])
    return whole[:, start:start + sizes[rank]]


def fused_on_slice(original: Any, inputs: dict, group: SequenceGroup, shares: bool = False,
                   media: tuple[str, ...] = (), pad: int = 0, kept: tuple[str, ...] = ()) -> Any:
    """TRL's fused forward ``original`` of this rank's packed call ``inputs`` (pre-shifted ``shift_labels``) under
    sequence parallelism: the group's packed rows joined, this rank's slice through ``original``, every per-token
    output gathered back to the whole row (in one exchange) and cut to this rank's own tokens; the label mask and the
    loss recomputed on them. ``shares``: the group's heads share prefixes (every rank's, so each rank sends its row's
    segment parents, ``-1`` where its row shares nothing): the joined row carries the structure of every rank's row,
    built alike on every rank (:func:`~padfree_plugins.packing.sequence_parallel.slice_row`). ``media``: the media keys
    of an image-text row (its family's collator's): the joined row goes to the model whole, its ``shift_labels``
    sliced, and the model's language model cuts this rank's slice after merging the image features
    (:class:`~padfree_plugins.modeling.sequence_parallel.SliceRow`); ``pad``: the padding segment's token; ``kept``:
    the media keys each rank keeps to itself (its vision tower encodes its own:
    :func:`~padfree_plugins.modeling.tower_share.kept_media`)."""
    inputs = dict(inputs)
    structure = inputs.pop(SHARED_PREFIXES_KEY, None)
    if shares:
        inputs[SEGMENT_PARENTS_KEY] = segment_parents({**inputs, SHARED_PREFIXES_KEY: structure})
    elif structure is not None:
        raise PadfreeError("a shared row under sequence parallelism from a head that does not share prefixes")
    rows = {key: value for key, value in inputs.items() if isinstance(value, torch.Tensor) or key in MAX_KEYS}
    rest = {key: value for key, value in inputs.items() if key not in rows}
    gathered = gather_rows(rows, group, dropped=(), media=media, kept=kept)
    sizes = [packed_tokens(row) for row in gathered]
    local = slice_row(join_rows(gathered), group.rank, group.size, pad, pre_shifted=True, whole=bool(media))
    with media_shares(media_counts(gathered, media)):  # the vision tower runs on this rank's own media
        output = original(fused_lm_head=True, **rest, **local)
    tokens = local["shift_labels"].shape[1]  # the slice's (an image-text row's inputs are whole)
    keys = [key for key, value in output.items() if key != "label_mask" and isinstance(value, torch.Tensor) and
            tuple(value.shape) == (1, tokens)]
    if keys:  # stacked in a dtype that holds each exactly (top-1 hits are bools), gathered once
        dtype = functools.reduce(torch.promote_types, (output[key].dtype for key in keys), torch.float32)
        whole = own_tokens(gather_sequence(torch.stack([output[key].to(dtype) for key in keys], dim=-1), group),
                           sizes, group.rank)
        for index, key in enumerate(keys):
            output[key] = whole[..., index].to(output[key].dtype)
    mask = inputs["shift_labels"] != -100
    output["label_mask"] = mask
    count = rest.get("num_items_in_batch")
    output["loss"] = -output["log_probs"].sum() / (mask.sum().clamp(min=1) if count is None else count)
    return output


def media_collator(assembly: Assembly | None) -> MultimodalCollator | None:
    """The assembly's multimodal collator (a vision-language family's), the collator :func:`pack_media_call` runs;
    ``None`` for a text-only family."""
    collator = getattr(assembly, "collator", None)
    return collator if isinstance(collator, MultimodalCollator) else None


def _spans_text(columns: torch.Tensor) -> str:
    """Column indices as runs: ``5-68, 70``."""
    runs, values = [], columns.tolist()
    for column in values:
        if runs and column == runs[-1][1] + 1:
            runs[-1][1] = column
        else:
            runs.append([column, column])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) or "none"


def modality_mismatch(inputs: dict, spans: list, real: list[torch.Tensor], collator: MultimodalCollator,
                      shape: torch.Size) -> tuple[str, str] | None:
    """Why the call's per-token modalities (``mm_token_type_ids``, Gemma's ``token_type_ids``), where given, are not
    those the collator reads off the tokens (0 text, the media's number at its placeholders) at every real token:
    ``(reason, detail)``, or ``None`` when they agree. A placeholder of a media the call has none of, typed text
    (``mm_token_type_ids`` 0), agrees: the model embeds and positions it as text (a placeholder generated in a
    completion; the collator packs it as text, :meth:`~padfree_plugins.packing.multimodal.MultimodalCollator.
    placeholders`)."""
    absent = [media for media in collator.media if inputs.get(media.pixels) is None]
    for key in MODALITY_KEYS:
        types = inputs.get(key)
        if not isinstance(types, torch.Tensor):
            continue
        if types.shape != shape:
            return (f"its {key} are not one per token", f"{key} {tuple(types.shape)}, attention_mask {tuple(shape)}")
        flat = types.detach().cpu().long()
        for row, ((start, length), tokens) in enumerate(zip(spans, real)):
            given = flat[row, start:start + length]
            want = torch.zeros_like(tokens)
            for media in collator.media:
                want[tokens == collator.token_ids[media.name]] = media.modality
            if key == TOKEN_TYPES_KEY:  # placeholders of an absent media typed text: text to the model
                for media in absent:
                    want[(tokens == collator.token_ids[media.name]) & (given == 0)] = 0
            outside = int(flat[row].count_nonzero()) - int(given.count_nonzero())  # typed media at pads
            if outside == 0 and torch.equal(given, want):
                continue
            wrong = torch.nonzero(given != want).flatten()
            if outside == 0 and bool((given[wrong] == 0).all()):  # only placeholders typed text
                names = sorted({media.name for media in collator.media for column in wrong.tolist()
                                if int(tokens[column]) == collator.token_ids[media.name]})
                return (f"{'/'.join(names)} placeholder tokens typed text by its {key} while the call has that "
                        "media: the model fills every such placeholder with media features, so the call is not well "
                        "formed (a completion that holds a generated placeholder token: TRL's forward fails on it; "
                        "suppress those tokens in generation)",
                        f"row {row}, columns {_spans_text(wrong + start)}")
            typed = torch.nonzero(flat[row]).flatten()
            placed = torch.nonzero(want).flatten() + start
            detail = (f"row {row}: its {key} mark columns {_spans_text(typed)}, its placeholders are at columns "
                      f"{_spans_text(placed)}")
            if start and len(typed) and len(placed) and int(typed[0]) - int(placed[0]) == -start:
                detail += (f" (shifted by its {start} left pads: the processor padded the prompts on the right, "
                           "TRL pads them on the left; set processor.tokenizer.padding_side = 'left')")
            return (f"its {key} do not line up with its tokens: TRL's input is not consistent, and its padded "
                    "forward computes positions from these modalities", detail)
    return None


def media_prefixes(labels: torch.Tensor, spans: list[tuple[int, int]], examples: list[dict],
                   collator: MultimodalCollator) -> list[tuple[int, tuple] | None]:
    """Each row's shareable prompt, as :func:`~padfree_plugins.packing.prefixes.shared_layout` takes them: its
    tokens before the first that predicts a label (at most all but its last, :func:`~padfree_plugins.modeling.unpad.
    shared_rows`' rule), keyed by those tokens, their modalities and the media they hold — rows of equal tokens
    whose images differ in any pixel get other keys. A row with a media placeholder after its prompt shares nothing
    (its completion would hold an image). One read of the labels from the device."""
    rows, width = labels.shape
    predicts = labels[:, 1:] != -100  # token j predicts label j + 1
    first = torch.where(predicts.any(1), predicts.int().argmax(1), width).tolist()
    placeholders = torch.tensor(list(collator.token_ids.values()))
    media_keys = set(collator.media_keys)
    prefixes: list[tuple[int, tuple] | None] = []
    seen: dict[tuple, list[dict]] = {}  # per prompt's tokens: the distinct media held by such prompts
    for row, ((start, length), example) in enumerate(zip(spans, examples)):
        shared = min(first[row] - start, length - 1)
        tokens = torch.as_tensor(example["input_ids"])
        if shared < 1 or bool(torch.isin(tokens[shared:], placeholders).any()):
            prefixes.append(None)
            continue
        kinds = example.get(TOKEN_TYPES_KEY)
        text = (tuple(tokens[:shared].tolist()), tuple(kinds[:shared]) if kinds is not None else None)
        media = {key: value for key, value in example.items() if key in media_keys}
        known = seen.setdefault(text, [])
        which = next((number for number, other in enumerate(known) if media_equal(other, media)), None)
        if which is None:
            which = len(known)
            known.append(media)
        prefixes.append((shared, (text, which)))
    return prefixes


def pack_media_call(inputs: dict, mask: torch.Tensor, labels: torch.Tensor, collator: MultimodalCollator,
                    refused: unpad.Refused = unpad.ignore_refusal,
                    share_prefixes: bool = False) -> tuple[dict, unpad.Unpadded] | None:
    """A padded fused call with media (``inputs``: its keyword arguments but the labels) split into its rows — each
    row's real tokens and, by the family's :meth:`~padfree_plugins.packing.multimodal.MultimodalCollator.split_call`,
    its own media — and packed by ``collator`` as those examples alone would be; and where its tokens went. ``None``
    when the call cannot be split exactly: it then runs padded, and ``refused(reason, detail)`` is told why.
    ``share_prefixes``: rows whose prompts are equal in tokens and media (:func:`media_prefixes`) hold the prompt
    once, its images once (:func:`~padfree_plugins.packing.multimodal.share_prompts`)."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape != mask.shape:
        refused("its input_ids are not [rows, width] of its attention_mask", "")
        return None
    if inputs.get("position_ids") is not None:
        refused("it is given position_ids (the collator computes each row's own)", "")
        return None
    media_keys = set(collator.media_keys)
    for key, value in inputs.items():  # anything per token, or media the collator does not know, refused
        if key in ("input_ids", "attention_mask", *MODALITY_KEYS, *media_keys) or value is None:
            continue
        if key in MEDIA_KEYS or key in BOUNDARY_KEYS or isinstance(value, torch.Tensor):
            refused(f"it holds an input the {type(collator).__name__} does not split by row", repr(key))
            return None
    spans = unpad.contiguous_rows(mask, labels, refused)
    if spans is None:
        return None
    if not all(length for _, length in spans):
        refused("a row holds no real token", f"row {[length for _, length in spans].index(0)}")
        return None
    flat = ids.detach().cpu()
    real = [flat[row, start:start + length] for row, (start, length) in enumerate(spans)]
    placeholders = torch.tensor(list(collator.token_ids.values()))
    at_pads = int(torch.isin(flat, placeholders).sum()) - sum(int(torch.isin(tokens, placeholders).sum())
                                                              for tokens in real)
    if at_pads:  # every placeholder in a row's real tokens, none at pads
        refused("media placeholder tokens sit at padded positions", f"{at_pads} of them")
        return None
    mismatch = modality_mismatch(inputs, spans, real, collator, mask.shape)
    if mismatch is not None:
        refused(*mismatch)
        return None
    types = inputs.get(TOKEN_TYPES_KEY)
    types = [types.detach().cpu()[row, start:start + length].tolist() for row, (start, length) in enumerate(spans)] \
        if isinstance(types, torch.Tensor) else [None] * len(real)
    try:
        media = collator.split_call(inputs, real)
        examples = [{"input_ids": tokens.tolist(), **own, **({TOKEN_TYPES_KEY: kinds} if kinds else {})}
                    for tokens, own, kinds in zip(real, media, types)]
        batch = collator(examples)
    except PadfreeError as error:
        refused("its media cannot be split by row", str(error))
        return None
    index = torch.cat([torch.arange(length) + row * mask.shape[1] + start for row, (start, length) in enumerate(spans)])
    lengths = [length for _, length in spans]
    if batch["cu_seq_lens_q"].diff().tolist() != lengths or \
            not torch.equal(batch["input_ids"].reshape(-1).cpu(), flat.reshape(-1).index_select(0, index)):
        refused("the collator did not keep every real token of its rows (max_length?)",
                f"rows of {lengths} tokens, packed {batch['cu_seq_lens_q'].diff().tolist()}")
        return None
    if share_prefixes:
        shared = share_prompts(collator, examples, batch, media_prefixes(labels, spans, examples, collator))
        if shared is not None:
            batch, kept = shared
            index = index.index_select(0, kept)
    device = mask.device
    packed = {key: value for key, value in inputs.items()
              if key not in ("input_ids", "attention_mask", *MODALITY_KEYS) and key not in media_keys}
    for key in (*MODEL_INPUT_KEYS, *media_keys):
        if key in batch:
            value = batch[key]
            packed[key] = value.to(device) if isinstance(value, (torch.Tensor, SharedPrefixes)) else value
    return packed, unpad.Unpadded(mask.shape[0], mask.shape[1], index)


@dataclass
class FusedCalls:
    """How a trainer's fused log-probability calls ran: ``packed``; ``unpadded`` (no pad: run as they are, nothing
    to gain); ``padded`` (TRL's own forward), counted by reason. The first call of each reason says it in a warning;
    later ones are counted only. One per trainer patch, shared by its policy's and reference model's heads."""

    #: Who runs the calls, for the warnings (the trainer's class name).
    owner: str = "a trainer"
    packed: int = 0
    unpadded: int = 0
    padded: dict[str, int] = field(default_factory=dict)
    #: The packed calls whose row held a repeated prompt once (``prefix_sharing``), of :attr:`packed`.
    shared: int = 0
    #: Packed calls whose repeated prompts were (in part) held more than once, by reason.
    unshared: dict[str, int] = field(default_factory=dict)

    def ran_packed(self, shared: bool = False) -> None:
        self.packed += 1
        self.shared += bool(shared)

    def ran_padded(self, reason: str, detail: str = "") -> None:
        """One call ran padded (or without padding, ``reason`` :data:`~padfree_plugins.modeling.unpad.NO_PADDING`)
        for ``reason``; said in a warning the first time."""
        if reason == unpad.NO_PADDING:
            self.unpadded += 1
            return
        if reason not in self.padded:
            warnings.warn(f"{self.owner}: a log-probability call runs padded (TRL's own forward), not packed: "
                          f"{reason}{f' [{detail}]' if detail else ''}. Later calls padded for this reason are "
                          "counted, not said again (Acceleration.describe(), the trainer's log "
                          "padfree/padded_calls)", UserWarning, stacklevel=4)
        self.padded[reason] = self.padded.get(reason, 0) + 1

    def ran_unshared(self, reason: str, detail: str = "") -> None:
        """One packed call held repeated prompts more than once for ``reason``; said in a warning the first time."""
        if reason not in self.unshared:
            warnings.warn(f"{self.owner}: a log-probability call holds some repeated prefixes in every row, not once: {reason}. "
                          "Later calls are counted, not said again (Acceleration.describe())", UserWarning,
                          stacklevel=4)
        self.unshared[reason] = self.unshared.get(reason, 0) + 1

    @property
    def padded_total(self) -> int:
        return sum(self.padded.values())

    def metrics(self) -> dict[str, int]:
        """The counts so far, as the trainer's log reports them."""
        return {"padfree/packed_calls": self.packed, "padfree/padded_calls": self.padded_total,
                "padfree/shared_calls": self.shared}

    def describe(self) -> str:
        """``"12 packed (12 with shared prompts), 0 padded"``, then each reason's count."""
        shared = f" ({self.shared} with shared prompts)" if self.shared else ""
        text = f"{self.packed} packed{shared}, {self.padded_total} padded"
        if self.unpadded:
            text += f", {self.unpadded} without padding (run as they are)"
        text += "".join(f"; {count} padded: {reason}" for reason, count in self.padded.items())
        return text + "".join(f"; {count} with prompts unshared: {reason}" for reason, count in self.unshared.items())


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
    #: The model's sequence-parallel group (its patch's), ``None`` without sequence parallelism.
    sequence: SequenceGroup | None = None
    #: Whether text calls share their rows' repeated prompts (:func:`~padfree_plugins.modeling.unpad.shared_rows`).
    share_prefixes: bool = False
    #: Where the fused calls are counted, packed or padded (by reason): the trainer patch's, shared by its heads.
    calls: FusedCalls = field(default_factory=FusedCalls)
    #: The chunk the model's sequence mixers pad each shared segment to (:func:`~padfree_plugins.modeling.mixers.
    #: mixer_chunk`): a prefix is shared where it saves that much.
    chunk: int = 1

    @classmethod
    def install(cls, model: Any, collator: MultimodalCollator | None = None, share_prefixes: bool = False,
                calls: FusedCalls | None = None, accelerator: Any = None) -> PackedFusedHead:
        """Take over ``model``'s fused forward (its calls counted in ``calls``). A model accelerate already prepared
        under mixed precision (TRL's reference model with ``bf16``) has the fused forward inside accelerate's autocast
        wrapper: the packed forward is wrapped again with ``accelerator``'s autocast, so it computes as TRL's would."""
        original = fused_forward_of(model)
        mixed_precision = None
        if original is None and accelerator is not None:
            original, mixed_precision = fused_forward_under_autocast(model, accelerator)
        if original is None:
            raise PadfreeError(
                f"{type(model).__name__} has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head), which the "
                "trainer adds in its __init__ and the packed log-probabilities run through: accelerate the trainer "
                "after building it, with its own model")
        sequence = getattr(patch_of(model), "sequence", None)
        head = cls(model, original, {"forward": own_attribute(model, "forward")}, collator, sequence,
                   share_prefixes, calls if calls is not None else FusedCalls(), mixer_chunk(model))

        @functools.wraps(original)  # the model's own signature, which generate() checks its model kwargs against
        def forward(*args: Any, **kwargs: Any) -> Any:
            return head.forward(*args, **kwargs)

        model.forward = forward if mixed_precision is None else mixed_precision(forward)
        return head

    def forward(self, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                **kwargs: Any) -> Any:
        packed = self.pack(args, labels, shift_labels, kwargs) if fused_lm_head else None
        if fused_lm_head and self.sequence is not None:  # every rank of the group packs its call, or none does
            if not all_ranks_pack(packed is not None, self.sequence, self.model.device) and packed is not None:
                packed = None
                self.calls.ran_padded("another rank of the sequence-parallel group runs its call padded")
        if packed is None:
            return self.original(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                                 **kwargs)
        inputs, unpadded = packed
        self.calls.ran_packed(inputs.get(SHARED_PREFIXES_KEY) is not None)
        # the label each packed token predicts: the padded row's next column (-100 past the row's end)
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        inputs["shift_labels"] = shifted.reshape(-1).index_select(0, unpadded.index.to(shifted.device))[None]
        if self.sequence is not None:
            media = self.collator.media_keys if self.collator is not None else ()
            output = fused_on_slice(self.original, inputs, self.sequence, self.share_prefixes, media,
                                    pad_token_of(self.model, self.collator) if media else 0,
                                    kept_media(self.model, media))
        else:
            output = self.original(fused_lm_head=True, **inputs)
        for key in list(output.keys()):
            output[key] = padded_per_token(output[key], unpadded)
        return output

    def pack(self, args: tuple, labels: Any, shift_labels: Any, kwargs: dict) -> tuple[dict, unpad.Unpadded] | None:
        """The packed form of a fused call, or ``None`` (then :attr:`calls` is told why: it runs padded)."""
        why: list[tuple[str, str]] = []
        packed = None

        def refused(reason: str, detail: str = "") -> None:
            why.append((reason, detail))

        mask = kwargs.get("attention_mask")
        if args or shift_labels is not None:
            refused("it is given positional arguments or shift_labels (TRL's calls give neither)")
        elif not isinstance(labels, torch.Tensor) or not isinstance(mask, torch.Tensor) or labels.shape != mask.shape:
            refused("it has no labels and attention_mask of one shape")
        elif any(kwargs.get(key) is not None for key in ("past_key_values", "inputs_embeds")):
            refused("it is given past_key_values or inputs_embeds")
        elif self.collator is not None:
            packed = pack_media_call(kwargs, mask, labels.to(mask.device), self.collator, refused,
                                     self.share_prefixes)
        elif any(kwargs.get(key) is not None for key in UNPACKED_INPUTS):
            refused("it holds media, boundaries or shared prefixes, which this trainer's text calls do not pack",
                    ", ".join(key for key in UNPACKED_INPUTS if kwargs.get(key) is not None))
        else:
            # under sequence parallelism a call without padding is packed too (the group exchanges every call)
            packed = unpad.pack_padded_call(kwargs, mask, labels.to(mask.device), self.sequence is not None,
                                            self.share_prefixes, refused, self.chunk, self.calls.ran_unshared)
        if why or packed is None:
            self.calls.ran_padded(*(why[0] if why else ("it was not packed", "")))
            return None
        return packed

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
    #: Whether the plugin packs image-text calls (:func:`pack_media_call`) for a vision-language family; the others
    #: refuse vision datasets.
    packs_media: ClassVar[bool] = False
    #: Whether the plugin trains under ``sequence_parallel.size > 1`` (its fused calls through
    #: :func:`fused_on_slice`); refused otherwise.
    sequence_parallel: ClassVar[bool] = False
    #: Whether, under sequence parallelism, ``compute_metrics`` / ``predict`` get each rank's own examples' outputs:
    #: TRL's ``prediction_step`` hands them the logits of an extra forward without the fused head (DPO, KTO), which
    #: :class:`PackedFusedHead` leaves to TRL's own padded forward of the rank's own batch (never split), or nothing
    #: (GRPO, RLOO); its loss and TRL's metrics come from the split fused calls, each rank's own examples'.
    gathers_logits: ClassVar[bool] = True
    #: Whether TRL's ``prediction_step`` recomputes logits for ``compute_metrics`` with that extra forward (DPO, KTO):
    #: with a ``compute_metrics``, :meth:`check` says that the forward runs padded.
    metrics_forward: ClassVar[bool] = False
    #: Whether the plugin plans token-budget batches of the trainer's rows (``batching.strategy: tokens``, with
    #: :meth:`row_lengths`); refused otherwise.
    budgets_rows: ClassVar[bool] = False
    #: Why a token budget of image-text rows is not planned for this trainer (``None``: planned, each row's tokens
    #: and pixels counted by :meth:`image_text_sizes`).
    image_budget_refusal: ClassVar[str | None] = "a budget of image-text rows is not planned for this trainer yet"

    trainer: Any
    assembly: Assembly
    heads: list = field(default_factory=list)
    ref_assembly: Assembly | None = None
    active: bool = True
    #: Whether the text calls share repeated prompts (``prefix_sharing``, decided by :meth:`check`).
    shares_prefixes: bool = False
    #: The trainer's attributes :meth:`install` replaced (the token-budget dataloader), for :meth:`undo`.
    saved: dict = field(default_factory=dict)
    #: Whether the token budget also keeps ``batching.max_pixels_per_batch`` (image-text rows, decided by
    #: :meth:`check`); ``accelerate()`` refuses a pixel budget otherwise.
    budgets_pixels: bool = False
    #: Every row's share of the budget, once counted (:meth:`planned_lengths`).
    loads: Any = None
    #: The batching plan written into checkpoints and checked on resuming (:mod:`.resume`).
    resume: ResumeGuard | None = None
    #: How the policy's and the reference model's fused calls ran (packed, padded by reason), in the trainer's log
    #: and :meth:`describe`.
    calls: FusedCalls = field(default_factory=FusedCalls)
    #: The trainer's own ``log`` (bound), which :meth:`log` calls.
    trainer_log: Any = None

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        return keeps_methods(trainer, library_class(trainer, "trl", cls.trainer_class), cls.kept_methods)

    def check(self) -> None:
        """Refuse, before anything changes, what this trainer cannot do packed (a subclass adds its own)."""
        trainer, config, name = self.trainer, self.assembly.config, type(self.trainer).__name__
        refuse_trl_without_fused_head(name)
        # DPO / KTO say whether their dataset has images; GRPO / RLOO find images per batch, on a VLM
        vlm = getattr(trainer, "_is_vlm", False)
        images = getattr(trainer, "_is_vision_dataset", vlm)
        vision = images or vlm
        size = sequence_parallel_size(config)
        if size > 1 and getattr(trainer, "aux_loss_enabled", False):
            raise ConfigError(f"{name} with the MoE router aux loss under sequence parallelism (sequence_parallel."
                              f"size: {size}): each rank routes a slice of the group's row, and the fused "
                              "log-probability calls do not yet take each rank's share of the row's load-balancing "
                              "loss (HF Trainer does). Set router_aux_loss_coef=0.0, or train with "
                              "sequence_parallel.size: 1")
        # packed with images: a vision dataset, on a vision-language family (a VLM on text alone: refused)
        if vision and self.packs_media and images and media_collator(self.assembly) is None:
            raise PadfreeError(
                f"{name} on images: the {self.assembly.plan.architecture.name} plugin packs text only (it declares "
                "no multimodal collator, so its image tokens and pixels cannot be split by row). Vision-language "
                f"plugins: {', '.join(vision_language_plugins(self.assembly))}; a family adds one with a "
                "wrap_collator (docs/writing-a-plugin.md). Train this one padded, without accelerate()")
        if vision and not (self.packs_media and images):
            raise PadfreeError(
                f"{name} on images: padfree-plugins does not pack vision-language batches yet (their image tokens "
                "and positions need the multimodal collator); train this one padded, without accelerate()")
        refuse_own_batches_options(
            trainer, config, name,
            batches="TRL's own batches (its collator, its generation), which padfree-plugins packs at every forward",
            noise="packed is the row of every sequence (far weaker noise than padded): train without NEFTune",
            budgets=self.budgets_rows)
        if self.assembly.plan.architecture.kind != "decoder":
            raise PadfreeError(f"{name} trains a causal language model; {type(self.assembly.model).__name__} is an "
                               f"{self.assembly.plan.architecture.kind}")
        self.shares_prefixes = shares_prefixes(trainer, self.assembly, splits_shared_rows=self.sequence_parallel)
        if uses_token_budget(config):
            self.check_budget(vision)
        if self.metrics_forward and getattr(trainer, "compute_metrics", None) is not None:
            split = " and whole on every rank of the sequence-parallel group (each rank its own examples)" \
                if size > 1 else ""
            warnings.warn(f"{name} with compute_metrics: TRL recomputes the logits it hands compute_metrics with an "
                          "extra forward without its fused head ([rows, width, vocab] logits); padfree-plugins leaves "
                          f"that forward to TRL, padded{split}, so evaluation costs that forward's memory and time. "
                          "The loss and TRL's own eval metrics run packed. Drop compute_metrics to evaluate without it",
                          UserWarning, stacklevel=4)

    def row_lengths(self) -> Any:
        """Every training row's tokens as its forwards compute them (a plugin with :attr:`budgets_rows`)."""
        raise NotImplementedError

    def check_budget(self, vision: bool) -> None:
        """``batching.strategy: tokens``: every row (never split) within the budget — and, for image-text rows,
        within ``max_pixels_per_batch`` — before anything changes."""
        trainer, batching, name = self.trainer, self.assembly.config.batching, type(self.trainer).__name__
        if vision and self.image_budget_refusal is not None:
            raise ConfigError(f"{name} on images with batching.strategy: tokens: {self.image_budget_refusal}; use "
                              "batching.strategy: examples")
        if not vision:
            check_whole_rows_budget(trainer, batching, self.row_lengths, "row")
            return
        check_whole_micro_batches(trainer.accelerator)
        if batching.on_overlong_example == "split":
            raise ConfigError(f"batching.on_overlong_example: split cannot cut {name}'s image-text rows (each is "
                              "trained whole): use error, with a budget of at least the longest row")
        tokens, pixels = self.image_text_sizes()
        self.budgets_pixels = batching.max_pixels_per_batch is not None
        self.loads = image_text_loads(name, tokens, pixels, batching)

    def image_text_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Every image-text row's tokens and pixels as its forwards compute them: TRL's collator run on the row alone
        (texts rendered and images processed as in training, cut to ``max_length``), its padded rows' real tokens
        (image placeholders counted as tokens) and the pixels of each padded row's media (the family's
        :meth:`~padfree_plugins.packing.multimodal.MultimodalCollator.split_call`; a prompt's images once per row
        that computes them). One pass over the dataset, at ``accelerate()``."""
        collator, media, dataset = self.trainer.data_collator, media_collator(self.assembly), self.trainer.train_dataset
        tokens, pixels = np.zeros(len(dataset), dtype=np.int64), np.zeros(len(dataset), dtype=np.int64)
        for index in range(len(dataset)):
            batch = collator([dict(dataset[index])])
            mask = batch["attention_mask"].bool()
            rows = [ids[keep] for ids, keep in zip(batch["input_ids"], mask)]
            tokens[index] = int(mask.sum())
            pixels[index] = sum(media.media_pixels({"input_ids": row.tolist(), **own})
                                for row, own in zip(rows, media.split_call(batch, rows)) if own)
        return tokens, pixels

    def planned_lengths(self) -> Any:
        """Every row's share of the budget: its tokens (:meth:`row_lengths`), or for image-text rows the loads
        counted at :meth:`check` (tokens, and pixels where ``max_pixels_per_batch`` is set)."""
        return self.loads if self.loads is not None else self.row_lengths()

    def train_dataloader(self) -> Any:
        """``batching.strategy: tokens``: micro-batches of whole rows up to the budget, TRL's collator padding them
        (its fused calls are packed at every forward)."""
        return trainer_train_dataloader(self.trainer, self.assembly.config, self.trainer.data_collator,
                                        lengths=self.planned_lengths())

    @classmethod
    def wrap(cls, trainer: Any, assembly: Assembly) -> FusedTrainerPatch | None:
        if not cls.claims(trainer):
            return None
        check_parallelism(trainer, assembly.config, None if cls.sequence_parallel else
                          "its log-probabilities run through TRL's fused LM head on padded rows, which padfree-plugins "
                          "packs per call but does not split across ranks yet for this trainer",
                          gathers_logits=cls.gathers_logits)
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
        share = self.shares_prefixes
        self.calls = FusedCalls(type(self.trainer).__name__)
        if uses_token_budget(self.assembly.config):
            self.saved["get_train_dataloader"] = own_attribute(self.trainer, "get_train_dataloader")
            self.trainer.get_train_dataloader = self.train_dataloader
        self.resume = ResumeGuard.install(self.trainer, lambda: plan_fingerprint(
            self.trainer, self.assembly.config, self.planned_lengths), self.saved)
        self.saved["log"], self.trainer_log = own_attribute(self.trainer, "log"), self.trainer.log
        self.trainer.log = self.log
        self.heads.append(PackedFusedHead.install(self.assembly.model,
                                                  media_collator(self.assembly) if media else None, share,
                                                  self.calls))
        ref_model = getattr(self.trainer, "ref_model", None)
        if ref_model is not None:
            inner = unwrap_model(ref_model)
            self.ref_assembly = assemble(inner, self.assembly.config, host=self.assembly.host)
            self.heads.append(PackedFusedHead.install(inner, media_collator(self.ref_assembly) if media else None,
                                                      share, self.calls, accelerator=self.trainer.accelerator))

    def log(self, logs: dict, *args: Any, **kwargs: Any) -> Any:
        """The trainer's ``log``, every entry with the fused calls counted so far (``padfree/packed_calls``,
        ``padfree/padded_calls``) once there are any."""
        if self.calls.packed or self.calls.padded or self.calls.unpadded:
            logs = {**logs, **self.calls.metrics()}
        return self.trainer_log(logs, *args, **kwargs)

    def describe(self) -> dict[str, str]:
        """What the patch did so far, for ``Acceleration.describe()``: how the fused calls ran."""
        return {"fused calls": self.calls.describe()}

    def undo(self) -> None:
        """TRL's fused forwards back on the policy and the reference model, the reference model unpatched. Safe
        twice."""
        if not self.active:
            return
        restore_attributes(self.trainer, self.saved)
        if self.resume is not None:
            self.resume.remove()
        for head in reversed(self.heads):
            head.remove()
        self.heads.clear()
        if self.ref_assembly is not None:
            self.ref_assembly.undo()
        self.active = False


def vision_language_plugins(assembly: Assembly) -> list[str]:
    """The registered architectures that pack image-text batches (a ``wrap_collator``), by name."""
    host = getattr(assembly, "host", None)
    architectures = host.architectures().values() if host is not None else ()
    return sorted({architecture.name for architecture, _ in architectures
                   if getattr(architecture, "wrap_collator", None) is not None}) or ["none registered"]


def refuse_vllm_without_cuda(trainer: Any) -> None:
    """vLLM generates on a GPU only: ``use_vllm=True`` without CUDA is refused (on a GPU it works as TRL's: vLLM
    generates, every log-probability runs packed)."""
    if getattr(trainer.args, "use_vllm", False) and not torch.cuda.is_available():
        raise ConfigError(
            f"use_vllm=True with {type(trainer).__name__} on a machine without CUDA: vLLM generates on a GPU only. "
            "Set use_vllm=False (generation through model.generate), or train on a GPU")
