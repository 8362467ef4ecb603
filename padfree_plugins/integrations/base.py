"""The shared base of every trainer plugin: install / undo, the collator swap, whole batches, padding-free
evaluation with re-padded outputs.

A trainer plugin (one module per trainer: :mod:`.hf_trainer`, :mod:`.trl_sft`, :mod:`.trl_reward`, or a third
party's) subclasses :class:`TrainerPatch`, says which trainers it :meth:`~TrainerPatch.claims`, and answers the
``wrap_trainer`` hook with ``MyPatch.wrap(trainer, assembly)``. What the base does for every trainer, all of it
undone by :meth:`TrainerPatch.undo`:

* refuses, while the trainer is unchanged, what cannot train padding-free (:mod:`.checks`): parallelism that
  splits rows, a custom collator (unless the plugin :meth:`~TrainerPatch.runs_trainer_collator` per example, as
  TRL's vision-language one), bad examples, a token budget the trainer cannot keep;
* **train_dataset** / **eval_dataset** without the rows that ``on_overlong: truncate`` leaves without a label, with
  a warning naming them (:meth:`~TrainerPatch.drop_unlabelled`, as TRL drops them);
* **train**: a checkpoint of another batching plan is refused on resuming, and every checkpoint keeps the plan
  (:mod:`.resume`);
* **data_collator** becomes :meth:`~TrainerPatch.make_collator`'s (by default the assembly's packing collator as a
  :class:`TrainerCollator`);
* **batches stay whole**: accelerate's ``dispatch_batches``, left unset, is turned off (:class:`WholeBatches`);
* **column removal**: the signature columns gain the task's keys and a vision-language family's media
  (:func:`signature_columns`);
* **compute_loss** / **prediction_step** are the subclass's;
* **training_step** (the trainer class's own, a subclass's included) gets each batch without the positions held for
  labelled logits (:mod:`~padfree_plugins.packing.labelled_logits`), so that a forward of its own sees every
  position, as padded; the plugin's loss of that batch reads them (:meth:`~TrainerPatch.labelled_logits_of`);
* **include_num_input_tokens_seen**: every packed token counts (there is no padding);
* **NEFTune**: the padded batch's noise (:class:`~padfree_plugins.modeling.neftune.PackedNeftune`);
* **get_train_dataloader**, with ``batching.strategy: tokens`` only: token-budget micro-batches.

A plugin that patches a trainer some other way (its own attributes, say) saves and restores them with
:func:`own_attribute` and :func:`restore_attributes`, re-exported here for that.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from padfree_plugins.assembly import Assembly
from padfree_plugins.batching.sampler import IndexingDataloaders, trainer_train_dataloader, uses_token_budget
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.checks import (
    check_collator,
    check_datasets,
    check_parallelism,
    image_text_loads,
    refuse_prefix_sharing,
    trainer_datasets,
    without_rows,
)
from padfree_plugins.integrations.resume import ResumeGuard, plan_fingerprint
from padfree_plugins.modeling.neftune import PackedNeftune
from padfree_plugins.modeling.patching import own_attribute, restore_attributes, unwrap_model
from padfree_plugins.packing.batch import INDEX_KEY, packed_tokens
from padfree_plugins.packing.collator import collate_naming_examples, split_packed_rows, unlabelled_message
from padfree_plugins.packing.labelled_logits import hold_labelled_logits, take_labelled_logits
from padfree_plugins.packing.multimodal import MultimodalCollator
from padfree_plugins.packing.prefixes import WHOLE_TOKENS_KEY, share_unlabelled

#: The fewest tokens sharing must save for a trainer's batch to be shared: examples that merely begin with the same
#: token (a BOS) or two are packed whole, as their segments would cost more than the tokens they save.
MIN_TOKENS_SAVED = 16

__all__ = ["TrainerCollator", "TrainerPatch", "WholeBatches", "library_class", "keeps_methods", "own_attribute",
           "restore_attributes", "signature_columns"]


def library_class(trainer: Any, module_prefix: str, name: str) -> type | None:
    """The class named ``name`` from a module under ``module_prefix`` in ``trainer``'s MRO (by name, so that the
    library need not be imported), or ``None``."""
    for cls in type(trainer).__mro__:
        if cls.__name__ == name and cls.__module__.startswith(module_prefix):
            return cls
    return None


def keeps_methods(trainer: Any, owner: type | None,
                  names: tuple[str, ...] = ("compute_loss", "prediction_step")) -> bool:
    """Whether ``trainer``'s class is ``owner`` or a subclass that keeps ``owner``'s ``names`` methods. A subclass
    that overrides ``compute_loss`` or ``prediction_step`` does something unknown with a batch: feeding it packed
    rows could be silently wrong, so no builtin plugin claims it."""
    if owner is None:
        return False
    cls = type(trainer)
    return all(getattr(cls, name) is getattr(owner, name) for name in names)


@dataclass
class TrainerCollator:
    """The assembly's collator as a trainer's ``data_collator`` (picklable, for DataLoader workers).

    Rows that hold several examples (TRL's ``packing=True``: a ``seq_lengths`` column) are split into them first;
    ``labelled_logits`` holds each batch's labelled positions for the plugin's own loss
    (:func:`~padfree_plugins.packing.labelled_logits.hold_labelled_logits`: no model input);
    ``unlabelled_token`` (the pad id of a replaced ``DataCollatorForLanguageModeling``) gets no loss, as there;
    ``share_prefixes``: the unlabelled tokens that examples of a causal-LM batch begin with are held once
    (:func:`~padfree_plugins.packing.prefixes.share_unlabelled`, its sequence mixers' ``chunk``), where that saves at
    least ``min_saved`` tokens.
    """

    collator: Any
    labelled_logits: bool = False
    unlabelled_token: int | None = None
    share_prefixes: bool = False
    chunk: int = 1
    min_saved: int = MIN_TOKENS_SAVED

    def __call__(self, rows: list[Mapping[str, Any]]) -> Any:
        batch = collate_naming_examples(self.collator, split_packed_rows(rows))  # errors name dataset indices
        if self.unlabelled_token is not None and "labels" in batch:
            batch["labels"] = batch["labels"].masked_fill(batch["input_ids"] == self.unlabelled_token, -100)
        if self.share_prefixes and "labels" in batch:
            batch = share_unlabelled(batch, self.chunk, self.min_saved)
        return hold_labelled_logits(batch) if self.labelled_logits else batch


@dataclass
class WholeBatches:
    """accelerate's ``dispatch_batches`` kept off: it loads batches on the main process and slices every tensor by
    rows for the processes, and a packed batch is one row (its boundaries would be cut to one number). Refused when
    asked for; when left unset (accelerate would dispatch an iterable dataset's batches) it is turned off — every
    process loads its own examples, the same batches — and :meth:`undo` unsets it again."""

    config: Any
    active: bool = True

    @classmethod
    def apply(cls, trainer: Any) -> WholeBatches | None:
        config = getattr(trainer.accelerator, "dataloader_config", None)
        if config is None or config.dispatch_batches is False:
            return None
        if config.dispatch_batches:
            raise PadfreeError("accelerator_config dispatch_batches=True slices every batch by rows for the "
                               "processes, and a packed batch is one row: set accelerator_config={'dispatch_batches': "
                               "False} (every process then loads its own examples)")
        config.dispatch_batches = False
        return cls(config)

    def undo(self) -> None:
        if self.active:
            self.config.dispatch_batches = None
            self.active = False


def signature_columns(trainer: Any, assembly: Assembly, extra: tuple[str, ...] = ()) -> list[str]:
    """The trainer's signature columns plus every key the task's collator reads (and ``extra``).

    A collator whose keys depend on the dataset (e.g. the embedding task's ``<column>_input_ids``) says which
    dataset columns it reads through a ``dataset_columns(names)`` method; a vision-language family's collator names
    its pixels and grids in ``media_keys`` (kept whatever the model's forward signature says).
    """
    task = assembly.plan.task
    media = getattr(assembly.collator, "media_keys", None) or ()
    keys = ["input_ids", *task.required_keys, *task.token_keys, *task.example_keys, *media, *extra]
    reads = getattr(assembly.collator, "dataset_columns", None)
    if reads is not None:
        for _, dataset in trainer_datasets(trainer):
            keys += reads(getattr(dataset, "column_names", None) or [])
    return list(dict.fromkeys((*(trainer._signature_columns or ()), *keys)))


def detach(value: Any) -> Any:
    """``value`` detached: a tensor, or a tuple of them (anything else as it is)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(detach(v) for v in value)
    return value


def same_labels(labels: Any, step_labels: Any) -> bool:
    """Whether ``labels`` are the training step's ``step_labels``: that tensor, or an equal copy of it (compared only
    when not the tensor itself, so no device sync where ``_prepare_inputs`` kept the step's tensor)."""
    if labels is step_labels:
        return labels is not None
    return (isinstance(labels, torch.Tensor) and isinstance(step_labels, torch.Tensor)
            and labels.shape == step_labels.shape and torch.equal(labels, step_labels.to(labels.device)))


@dataclass
class TrainerPatch:
    """What :meth:`wrap` changed on a trainer, and how to change it back (:meth:`undo`).

    Subclasses implement :meth:`claims`, :meth:`compute_loss` and :meth:`prediction_step`, and may override
    :meth:`make_collator`, :meth:`check` and :attr:`extra_columns`.
    """

    #: A short name of the trainer family, for ``describe()`` and messages.
    kind: ClassVar[str] = "trainer"
    #: Dataset columns the collator reads besides the task's keys (TRL's ``seq_lengths``, which it splits rows by).
    extra_columns: ClassVar[tuple[str, ...]] = ("seq_lengths",)
    #: Whether the patch trains under ``sequence_parallel.size > 1`` (its loss through ``assembly.forward``, which
    #: slices the group's row, normalised by the label count of every rank); refused otherwise.
    sequence_parallel: ClassVar[bool] = False
    #: Whether its ``prediction_step`` under ``sequence_parallel.size > 1`` hands the trainer each rank's own
    #: examples' outputs — the group's per-token slices gathered back (HF ``Trainer``), or outputs computed for the
    #: rank's own examples (pooled tasks, TRL's reward scores) — so that ``compute_metrics`` / ``predict`` see what one
    #: process sees; refused otherwise.
    gathers_logits: ClassVar[bool] = False
    #: Whether the patch shares repeated prompts (``prefix_sharing``, decided by its own checks); ``prefix_sharing: on``
    #: is refused otherwise.
    shares_prompts: ClassVar[bool] = False
    #: Whether the patch lays the trainer's micro-batches in prompt groups (``batching.group_prefixes``); refused
    #: otherwise.
    groups_prefixes: ClassVar[bool] = False

    trainer: Any
    assembly: Assembly
    saved: dict[str, Any] = field(default_factory=dict)
    neftune: PackedNeftune | None = None
    whole_batches: WholeBatches | None = None
    #: The trainer's ``training_step`` as it was (the class's, or an instance attribute), when batches hold labelled
    #: logits; and, while it runs, the batch's labels tensor and what was held for it (:meth:`labelled_logits_of`).
    own_training_step: Any = None
    in_step: tuple[Any, dict[str, Any]] | None = None
    active: bool = True
    #: Every row's share of a token budget, counted at :meth:`wrap` for image-text rows
    #: (:meth:`count_image_text_rows`); ``None``: the dataset's own lengths.
    loads: Any = None
    #: Whether the token budget also keeps ``batching.max_pixels_per_batch``; ``accelerate()`` refuses it otherwise.
    budgets_pixels: bool = False
    #: The batching plan written into checkpoints and checked on resuming (:mod:`.resume`).
    resume: ResumeGuard | None = None

    # -- what a subclass says ----------------------------------------------------------------------------------

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        """Whether this patch knows ``trainer`` (its class, and that it keeps the methods the patch replaces)."""
        raise NotImplementedError

    @classmethod
    def runs_trainer_collator(cls, trainer: Any) -> bool:
        """Whether :meth:`make_collator` runs the trainer's own collator (on each example alone) rather than replace
        it: then it is not refused as a collator that builds features (default: no)."""
        return False

    def make_collator(self) -> Any:
        """The trainer's new ``data_collator`` (default: the assembly's collator, as a :class:`TrainerCollator`)."""
        return TrainerCollator(self.assembly.collator)

    def check(self) -> None:
        """Refuse, before anything changes, what this trainer cannot do padding-free (default: nothing more)."""

    def compute_loss(self, model: Any, inputs: Mapping, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The trainer's ``compute_loss`` on a packed batch."""
        raise NotImplementedError

    def prediction_step(self, model: Any, inputs: Mapping, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """The trainer's ``prediction_step`` on a packed batch."""
        raise NotImplementedError

    # -- install / undo ----------------------------------------------------------------------------------------

    @classmethod
    def wrap(cls, trainer: Any, assembly: Assembly) -> TrainerPatch | None:
        """``cls(trainer, assembly)`` installed, or ``None`` when :meth:`claims` says no (``wrap_trainer``'s answer)."""
        if not cls.claims(trainer):
            return None
        check_parallelism(trainer, assembly.config, None if cls.sequence_parallel else
                          f"its trainer plugin ({cls.__name__}) does not train sequence-parallel",
                          gathers_logits=cls.gathers_logits)
        if not cls.shares_prompts:
            refuse_prefix_sharing(trainer, assembly.config, cls.__name__)
        if assembly.config.batching.group_prefixes and not cls.groups_prefixes:
            raise ConfigError(f"batching.group_prefixes with {type(trainer).__name__}: its plugin ({cls.__name__}) "
                              "keeps the trainer's own batches (prompt groups are laid out for HF Trainer and "
                              "SFTTrainer). Remove batching.group_prefixes")
        if trainer.model is None or unwrap_model(trainer.model) is not assembly.model:
            raise PadfreeError("the assembly was built for another model than trainer.model")
        if not cls.runs_trainer_collator(trainer):
            check_collator(trainer.data_collator)
        patch = cls(trainer, assembly)
        collator = patch.make_collator()
        unlabelled = check_datasets(trainer, collator.collator if isinstance(collator, TrainerCollator) else collator)
        patch.check()
        patch.whole_batches = WholeBatches.apply(trainer)
        try:
            patch.drop_unlabelled(unlabelled)
            patch.count_image_text_rows(collator)
            patch.install(collator)
        except BaseException:  # an error part-way leaves the trainer as it was
            patch.undo()
            raise
        return patch

    def drop_unlabelled(self, unlabelled: Mapping[str, np.ndarray]) -> None:
        """Drop, with a warning naming them, the rows whose every label truncation to ``max_length`` erases
        (``on_overlong: truncate``; ``unlabelled``: their indices by dataset name, from
        :func:`~padfree_plugins.integrations.checks.check_datasets`), as TRL drops such examples: they would train
        on nothing. The datasets are put back by :meth:`undo`."""
        if not unlabelled:
            return
        trainer, max_length = self.trainer, getattr(self.assembly.collator, "max_length", None)
        for name in ("train_dataset", "eval_dataset"):
            self.saved[name] = own_attribute(trainer, name)
        for what, rows in unlabelled.items():
            warnings.warn(unlabelled_message(rows.tolist(), rows.size, max_length, f" of the {what} dataset",
                                             dropped=True), stacklevel=4)
        if "train" in unlabelled:
            trainer.train_dataset = without_rows(trainer.train_dataset, unlabelled["train"])
        evals = trainer.eval_dataset
        if isinstance(evals, Mapping):
            trainer.eval_dataset = {key: without_rows(dataset, unlabelled[f"eval ({key})"])
                                    if f"eval ({key})" in unlabelled else dataset for key, dataset in evals.items()}
        elif "eval" in unlabelled:
            trainer.eval_dataset = without_rows(evals, unlabelled["eval"])

    def install(self, collator: Any) -> None:
        """Put ``collator``, the signature columns, the loss, evaluation, token counting, the token-budget dataloader
        and packed NEFTune on the trainer, saving what each replaces (for :meth:`undo`)."""
        trainer = self.trainer
        for name in ("data_collator", "_signature_columns"):
            self.saved[name] = getattr(trainer, name)
        for name in ("compute_loss", "prediction_step", "loss_is_scaled_for_ga", "_track_num_input_tokens"):
            self.saved[name] = own_attribute(trainer, name)
        trainer.data_collator = collator
        trainer._set_signature_columns_if_needed()
        indexed = isinstance(collator, TrainerCollator)  # its rows carry their dataset index, for its errors
        trainer._signature_columns = signature_columns(trainer, self.assembly,
                                                       (*self.extra_columns, *((INDEX_KEY,) if indexed else ())))
        if indexed:
            self.saved["_get_dataloader"] = own_attribute(trainer, "_get_dataloader")
            trainer._get_dataloader = IndexingDataloaders(trainer._get_dataloader)
        trainer.compute_loss = self.compute_loss
        trainer.prediction_step = self.prediction_step
        trainer._track_num_input_tokens = self.track_num_input_tokens
        if getattr(collator, "labelled_logits", False):
            self.saved["training_step"] = own_attribute(trainer, "training_step")
            self.own_training_step = trainer.training_step
            trainer.training_step = self.training_step
        if uses_token_budget(self.assembly.config):
            self.saved["get_train_dataloader"] = own_attribute(trainer, "get_train_dataloader")
            trainer.get_train_dataloader = self.train_dataloader
        self.resume = ResumeGuard.install(trainer, lambda: plan_fingerprint(trainer, self.assembly.config,
                                                                            self.planned_lengths), self.saved)
        if getattr(trainer, "neftune_noise_alpha", None) is not None:  # NEFTune scaled per example, as padded
            self.saved["neftune_noise_alpha"] = own_attribute(trainer, "neftune_noise_alpha")
            embeddings = unwrap_model(trainer.model).get_input_embeddings()
            self.neftune = PackedNeftune.install(embeddings, trainer.neftune_noise_alpha)
            trainer.neftune_noise_alpha = None

    def undo(self) -> None:
        """Restore everything :meth:`install` replaced. Safe twice."""
        if not self.active:
            return
        restore_attributes(self.trainer, self.saved)
        if self.resume is not None:
            self.resume.remove()
        if self.whole_batches is not None:
            self.whole_batches.undo()
        if self.neftune is not None:
            self.neftune.remove()
        self.active = False

    # -- what the trainer calls, shared ------------------------------------------------------------------------

    def track_num_input_tokens(self, inputs: Mapping) -> None:
        """``include_num_input_tokens_seen``: a packed batch has no padding, so ``non_padding`` counts every token (the
        trainer would count the tokens unequal to the pad id, dropping real ones where pad is eos, say); a batch with
        shared prefixes counts its examples' tokens whole, as padded."""
        trainer = self.trainer
        name = getattr(trainer.model, "main_input_name", "input_ids")
        if trainer.args.include_num_input_tokens_seen != "non_padding" or name not in inputs:
            return type(trainer)._track_num_input_tokens(trainer, inputs)
        tokens = torch.as_tensor(inputs.get(WHOLE_TOKENS_KEY, inputs[name].numel()), device=trainer.args.device,
                                 dtype=torch.int64)
        trainer.state.num_input_tokens_seen += trainer.accelerator.gather(tokens).sum().item()

    def training_step(self, model: Any, inputs: Mapping, *args: Any, **kwargs: Any) -> Any:
        """The trainer's own ``training_step`` on ``inputs`` without the held labelled logits: ``model(**inputs)``
        there returns every position's logits, as padded. :meth:`labelled_logits_of` hands them to the plugin's loss
        of this very batch (one that carries its labels tensor)."""
        inputs, held = take_labelled_logits(inputs)
        outer, self.in_step = self.in_step, (None if held is None else (inputs.get("labels"), held))
        try:
            return self.own_training_step(model, inputs, *args, **kwargs)
        finally:
            self.in_step = outer

    def labelled_logits_of(self, inputs: Mapping) -> tuple[Mapping, dict[str, Any] | None]:
        """``inputs`` without the held labelled logits, and those held for it: its own (a batch straight from the
        collator) or, inside :meth:`training_step`, the step's batch's when ``inputs`` carries that batch's labels
        (the tensor itself: ``_prepare_inputs`` keeps tensors already on the device; or an equal copy: on CPU under
        several processes it copies them to ``cpu:0``; the held positions depend on the labels alone). A batch with
        other labels gets none, and so every position's logits."""
        inputs, held = take_labelled_logits(inputs)
        if held is None and self.in_step is not None and same_labels(inputs.get("labels"), self.in_step[0]):
            held = self.in_step[1]
        return inputs, held

    def train_dataloader(self) -> Any:
        """``batching.strategy: tokens``: micro-batches filled up to a token budget
        (:mod:`padfree_plugins.batching`)."""
        return trainer_train_dataloader(self.trainer, self.assembly.config, self.trainer.data_collator,
                                        lengths=self.planned_lengths())

    def planned_lengths(self) -> Any:
        """Every row's share of the token budget, as the dataloader and the checkpoints' batching plan count it
        (``None``: the sampler reads the training set's ``input_ids``)."""
        return self.loads

    def count_image_text_rows(self, collator: Any) -> None:
        """A token budget of image-text rows, where the dataset's ``input_ids`` do not say it all — rows processed at
        collate time (TRL's vision rows: no token ids yet), or ``max_pixels_per_batch`` set: each row's tokens
        (image placeholders counted) and pixels counted once here, by the collator's own per-example processing
        (``collator``'s ``example``, else the row as it is) and the family's
        :meth:`~padfree_plugins.packing.multimodal.MultimodalCollator.media_pixels`. A row over either budget is
        refused (:func:`~padfree_plugins.integrations.checks.image_text_loads`)."""
        config, media, dataset = self.assembly.config, self.assembly.collator, self.trainer.train_dataset
        if not uses_token_budget(config) or not isinstance(media, MultimodalCollator) or dataset is None or \
                not hasattr(dataset, "__len__"):
            return
        columns = getattr(dataset, "column_names", None) or ()
        if "input_ids" in columns and config.batching.max_pixels_per_batch is None:
            return  # the placeholders are in the token ids, which the sampler counts
        example_of = getattr(getattr(collator, "collator", collator), "example", dict)
        tokens, pixels = np.zeros(len(dataset), dtype=np.int64), np.zeros(len(dataset), dtype=np.int64)
        for index in range(len(dataset)):
            example = example_of(dict(dataset[index]))
            tokens[index] = int(np.asarray(example["input_ids"]).size)
            pixels[index] = media.media_pixels(example)
        self.loads = image_text_loads(type(self.trainer).__name__, tokens, pixels, config.batching)
        self.budgets_pixels = config.batching.max_pixels_per_batch is not None

    def neftune_scope(self, inputs: Mapping) -> Any:
        """The block in which the embeddings' forwards belong to ``inputs`` (for packed NEFTune, when on)."""
        return self.neftune.for_batch(inputs) if self.neftune is not None else contextlib.nullcontext()

    def repad_metric_inputs(self, batch_as_given: Any, inputs: Mapping) -> None:
        """``include_for_metrics=["inputs"]``: the trainer reads the model's main input from the batch it handed
        to ``prediction_step``; a packed row ``[1, T]`` becomes ``[n, L_max]``, padded with the tokenizer's pad id
        (as a padding collator pads), so that every example is one row of the inputs ``compute_metrics`` sees."""
        if "inputs" not in (self.trainer.args.include_for_metrics or ()):
            return
        name = getattr(self.trainer.model, "main_input_name", "input_ids")
        if not isinstance(batch_as_given, dict) or name not in inputs:
            return
        pad = getattr(self.trainer.processing_class, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(self.assembly.model, "config", None), "pad_token_id", None)
        batch_as_given[name] = self.repad(inputs[name], inputs, -100 if pad is None else pad)

    def repad(self, value: Any, batch: Mapping, fill: float | None) -> Any:
        """A packed per-token tensor ``[1, T, ...]`` -> ``[n, L_max, ...]``; anything else unchanged."""
        per_token = (isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == 1
                     and value.shape[1] == packed_tokens(batch))
        if not per_token:
            return value
        padded, mask = self.assembly.reverter(value.unsqueeze(-1) if value.ndim == 2 else value, batch)
        if value.ndim == 2:
            padded = padded.squeeze(-1)
        if fill is not None:
            padded = padded.masked_fill(~mask.bool().reshape(mask.shape + (1,) * (padded.ndim - 2)), fill)
        return padded
