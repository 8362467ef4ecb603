"""What each assembly hook returns, written down as ``typing.Protocol`` classes.

Each hook's answer has one required shape (:class:`Collator`, :class:`ModelPatchLike`, :class:`Pooler`,
:class:`Reverter`, :class:`TaskForward`, :class:`TrainerPatchLike`). Beyond that, the framework reads a few
**optional** attributes when an answer has them; each optional attribute is one small protocol below, so that a
plugin author finds in one place every name the framework may look up on their object, what it means, and when
it is read. :data:`OPTIONAL_ATTRIBUTES` lists them by hook (a test checks that the framework reads no other).

Answers must be picklable plain objects (a collator travels to DataLoader workers); nothing here is called in the
training loop by the host — only the objects themselves are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

# -- collate ---------------------------------------------------------------------------------------------------


@runtime_checkable
class Collator(Protocol):
    """``collate``'s answer: a list of tokenized examples -> one packed batch
    (:class:`~padfree_plugins.packing.batch.PackedBatch`, or a mapping with its keys)."""

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]: ...


class WrapsPacking(Protocol):
    """Optional: a task collator built around the core packing collator exposes it as ``packing`` (or, a trainer's
    wrapper, as ``collator``); the dataset checks before training and token-budget batching read its
    ``max_length``, ``on_overlong``, ``token_keys`` and ``vocab_size`` (token ids must be below it; mixin:
    :class:`~padfree_plugins.packing.collator.WrapsPackingCollator`)."""

    packing: Any
    collator: Any
    max_length: int | None
    on_overlong: str
    token_keys: tuple[str, ...]
    vocab_size: int | None


class ReadsDatasetColumns(Protocol):
    """Optional: the dataset columns the collator reads, when they depend on the dataset (the embedding task's
    ``<column>_input_ids``). Read at ``accelerate``, so that ``remove_unused_columns`` keeps them."""

    def dataset_columns(self, names: Sequence[str]) -> list[str]: ...


class ChecksTrainerDataset(Protocol):
    """Optional: refuse, at ``accelerate``, a training or evaluation set laid out in a way the trainer's batches
    would break (e.g. listwise groups cut across batches)."""

    def check_trainer_dataset(self, dataset: Any) -> None: ...


class NamesTextColumns(Protocol):
    """Optional: which token-id columns hold the texts, for the dataset checks: ``id_columns`` (e.g. a preference
    collator's ``chosen_ids``, ``rejected_ids``) or ``columns`` (the embedding collator's column names; empty: every
    ``<column>_input_ids``)."""

    id_columns: Sequence[str]
    columns: Sequence[str]


class DescribesLabels(Protocol):
    """Optional: what the dataset checks before training need to check labels and positions as the collator will:
    ``ignore_index`` (the label of a token without a loss, -100), ``masked_first_keys`` (per-token keys whose first
    value in every example the collator masks), ``num_labels`` / ``float_labels`` (per-example class labels: how many
    classes, or float targets), ``position_start`` (the first position id of every example: 2 for RoBERTa)."""

    ignore_index: int
    masked_first_keys: tuple[str, ...]
    num_labels: int | None
    float_labels: bool
    position_start: int


class AsksLabelledLogits(Protocol):
    """Optional (``causal_lm``): ``labelled_logits_only`` True asks trainers to compute ``logits_to_keep`` /
    ``shift_labels`` for each batch and pass them in their own loss call only; every other forward of the batch
    returns all positions (:mod:`padfree_plugins.packing.labelled_logits`)."""

    labelled_logits_only: bool


class PacksMedia(Protocol):
    """Optional (vision-language families): ``media_keys`` names the dataset columns of images and video the
    collator packs (``pixel_values``, ``image_grid_thw`` …), which trainers keep through column removal; a collator
    without it packs text only (:mod:`padfree_plugins.packing.multimodal`). Under sequence parallelism ``media``
    (each medium's layout: ``name``, ``pixels``, ``grid``, ``batch_dim``, ``tokens_per_row``) says whether the group
    can join its pixel rows, and ``token_ids`` (placeholder name -> token id) keeps the padding segment off the
    placeholders."""

    media_keys: tuple[str, ...]
    media: tuple[Any, ...]
    token_ids: Mapping[str, int]


class RefusesSharedMediaPrompts(Protocol):
    """Optional (vision-language families): ``why_prompts_not_shared`` says why the family's image-text prompts
    cannot be held once in a shared row (``None``: they can; :mod:`padfree_plugins.packing.multimodal`)."""

    why_prompts_not_shared: str | None


class DerivesLabels(Protocol):
    """Optional (``causal_lm``): ``labels_from_input_ids`` True says the collator takes the labels of examples
    without any from their ``input_ids``; the multimodal collator then leaves image and video placeholders
    unlabelled (:mod:`padfree_plugins.packing.multimodal`)."""

    labels_from_input_ids: bool


# -- task_forward ----------------------------------------------------------------------------------------------


@runtime_checkable
class TaskForward(Protocol):
    """``task_forward``'s answer: run a patched model on a packed batch, returning a transformers ``ModelOutput``
    (with ``.loss`` when the batch has labels)."""

    def __call__(self, model: Any, batch: Mapping[str, Any], **loss_kwargs: Any) -> Any: ...


class ChecksModel(Protocol):
    """Optional: at assembly, before the model is patched, refuse a model without the head the task reads."""

    def check_model(self, model: Any) -> None: ...


class RunsInsideModelForward(Protocol):
    """Optional: ``runs_inside_model_forward`` True makes assembly route the model's forward to the task's
    computation (:meth:`~padfree_plugins.modeling.patching.ModelPatch.route_compute`), so that wrappers that call
    ``model(...)`` (DDP, peft, accelerate) run it."""

    runs_inside_model_forward: bool


class UsesAssemblyPooler(Protocol):
    """Optional: ``uses_assembly_pooler`` True makes assembly set the forward's ``pooler`` field (a dataclass field)
    to the ``pool`` hook's answer, a plugin's pooling mode included."""

    uses_assembly_pooler: bool
    pooler: Any


class ChoosesMetrics(Protocol):
    """Optional: what ``compute_metrics`` gets in ``evaluate`` / ``predict``: ``(logits, labels)`` with one entry
    per dataset row, instead of re-padded per-token outputs."""

    def for_metrics(self, outputs: Any, batch: Mapping[str, Any]) -> tuple[Any, Any]: ...


class PoolsExamples(Protocol):
    """Optional: ``pools_examples`` True — the forward pools whole examples and takes ``hidden=`` (a callable giving
    the model's batch's last hidden states ``[1, T, H]`` computed elsewhere), so that under sequence parallelism
    each rank pools, scores and computes the loss of its own micro-batch (``SequenceParallelForward.pooled``)
    instead of being refused."""

    pools_examples: bool


class SaysLossScaling(Protocol):
    """Optional: ``loss_is_scaled_for_ga`` — False for a per-batch mean loss (the trainer averages it over gradient
    accumulation steps), True for a loss normalised by ``num_items_in_batch`` itself."""

    loss_is_scaled_for_ga: bool


# -- the other assembly hooks ----------------------------------------------------------------------------------


@runtime_checkable
class Pooler(Protocol):
    """``pool``'s answer: packed hidden states ``[1, T, H]`` -> one vector per example ``[n, H]``."""

    def __call__(self, hidden_states: Any, batch: Mapping[str, Any]) -> Any: ...


@runtime_checkable
class Reverter(Protocol):
    """``revert_output``'s answer: packed ``[1, T, ...]`` -> ``(padded [n, L_max, ...], attention_mask [n, L_max])``."""

    def __call__(self, packed: Any, batch: Mapping[str, Any]) -> tuple[Any, Any]: ...


@runtime_checkable
class ModelPatchLike(Protocol):
    """``patch_model``'s answer (usually a :class:`~padfree_plugins.modeling.patching.ModelPatch`): ``undo()``
    restores the model exactly; ``describe()`` says what was patched; ``route_compute()`` is called when the task
    forward :class:`RunsInsideModelForward`."""

    def undo(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def route_compute(self) -> None: ...


@runtime_checkable
class TrainerPatchLike(Protocol):
    """``wrap_trainer``'s answer (usually a :class:`~padfree_plugins.integrations.base.TrainerPatch`): ``undo()``
    restores the trainer exactly."""

    def undo(self) -> None: ...


class ReportsRun(Protocol):
    """Optional: ``describe()`` says what the trainer patch did so far (e.g. how many log-probability calls ran
    packed and how many padded, by reason); ``Acceleration.describe()`` shows it."""

    def describe(self) -> dict[str, Any]: ...


def _attributes(*protocols: type) -> tuple[str, ...]:
    names: list[str] = []
    for protocol in protocols:
        names += [name for name in (*protocol.__annotations__, *vars(protocol)) if not name.startswith("_")
                  and name not in names]
    return tuple(names)


#: Hook -> the optional attributes the framework may read on its answer.
OPTIONAL_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "collate": _attributes(WrapsPacking, ReadsDatasetColumns, ChecksTrainerDataset, NamesTextColumns,
                           DescribesLabels, AsksLabelledLogits, DerivesLabels, PacksMedia, RefusesSharedMediaPrompts),
    "task_forward": _attributes(ChecksModel, RunsInsideModelForward, UsesAssemblyPooler, ChoosesMetrics,
                                PoolsExamples, SaysLossScaling),
    "wrap_trainer": _attributes(ReportsRun),
}
