"""Padding-free training with HF ``Trainer`` and TRL ``SFTTrainer`` / ``RewardTrainer``:
``accelerate(trainer, "padfree.yaml")``.

Build the trainer as usual (no flag to change, ``remove_unused_columns`` left as it is), then::

    acceleration = padfree_plugins.accelerate(trainer, "padfree.yaml")
    trainer.train()                 # packed batches, same loss as padded
    acceleration.undo()             # optional: the trainer and the model are as before

Before the trainer changes, one that cannot train padding-free (parallelism that splits rows, a ``model_init``,
a custom collator, bad examples, a token budget it cannot keep …) is refused by
:mod:`padfree_plugins.integrations.checks`; the model, assembled first, is then restored. What changes on the
trainer, all of it undone by ``undo()``:

* **the model** is patched by :func:`~padfree_plugins.assembly.assemble` (peft models are unwrapped);
* **data_collator** becomes the assembly's packing collator (:class:`TrainerCollator`; a ``RewardTrainer``'s:
  :class:`~padfree_plugins.integrations.trl_reward.PreferenceCollator`); rows that TRL packed
  itself (``packing=True``, a ``seq_lengths`` column) are split back into their examples first. Only collators
  that pad (:data:`~padfree_plugins.integrations.checks.REPLACEABLE_COLLATORS`) are replaced — any other is refused —
  and a replaced transformers ``DataCollatorForLanguageModeling`` keeps giving no loss to pad-id tokens;
* **batches stay whole**: accelerate's ``dispatch_batches``, left unset, is turned off (:class:`WholeBatches`);
  it would slice a packed row's boundaries;
* **include_num_input_tokens_seen**: every packed token counts (``non_padding`` too: there is no padding);
* **column removal**: the trainer's signature columns gain the task's keys, so ``remove_unused_columns=True``
  (the default) keeps everything the collator needs;
* **compute_loss** calls ``assembly.forward(model, batch, **loss_kwargs)`` and reads ``.loss`` — the contract that
  lets task plugins (embeddings, classification) bring their own per-example heads to the same wrapper. It
  passes ``num_items_in_batch`` when the trainer counts it (gradient accumulation) and applies
  ``average_tokens_across_devices`` exactly as the trainer would (a ``RewardTrainer``: TRL's loss from the
  per-text scores);
* **NEFTune** (``neftune_noise_alpha``): the trainer's hook, which would scale the noise by the packed row's
  length, is replaced by :class:`~padfree_plugins.modeling.neftune.PackedNeftune` (the padded batch's noise);
* **get_train_dataloader**, only with ``batching.strategy: tokens`` in the config: micro-batches filled up to a
  token budget and balanced across ranks (:mod:`padfree_plugins.batching.sampler`);
* **prediction_step** (``evaluate`` / ``predict``) runs padding-free too. Per-token outputs come back packed
  ``[1, T, ...]``; they are re-padded with ``assembly.reverter`` to ``[n, L_max, ...]`` (labels padded with -100)
  so that ``compute_metrics`` and ``preprocess_logits_for_metrics`` see the shapes they always saw; a task forward
  with ``for_metrics`` chooses what they get itself (one entry per dataset row), and with
  ``include_for_metrics=["inputs"]`` the batch's ``input_ids`` are re-padded per example too.

TRL ``SFTTrainer``: it refuses a custom collator when its own ``padding_free=True`` is set and requires
``max_length=None`` for padding-free training without packing. Neither applies here: build the SFTTrainer
normally (its own collator, any ``max_length`` — it truncates during dataset preparation), then accelerate it;
the collator is swapped after construction. Its loss (TRL's fused LM head) and metrics are TRL's
(:mod:`padfree_plugins.integrations.trl_sft`).

TRL ``RewardTrainer``: the task is ``seq_cls``; every pair's chosen and rejected texts are packed into one row and
TRL's loss and metrics computed from the per-text scores (:mod:`padfree_plugins.integrations.trl_reward`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from padfree_plugins.assembly import Assembly, assemble
from padfree_plugins.batching.sampler import trainer_train_dataloader, uses_token_budget
from padfree_plugins.builtin.tasks.causal_lm import drop_labelled_logits, keep_labelled_logits
from padfree_plugins.config.schema import PadfreeConfig, load_config
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.errors import PadfreeError, PluginError
from padfree_plugins.integrations.checks import (
    check_collator,
    check_datasets,
    check_model_given,
    check_parallelism,
    check_token_budget,
    language_modeling_pad_id,
    note_trl_eval_packing,
    trainer_datasets,
)
from padfree_plugins.integrations.trl_reward import PreferenceCollator, preference_loss
from padfree_plugins.integrations.trl_sft import record_sft_metrics, sft_aux_loss, sft_loss, split_packed_row
from padfree_plugins.modeling.neftune import PackedNeftune
from padfree_plugins.modeling.patching import own_attribute, restore_attributes, unwrap_model

ACCELERATION_ATTRIBUTE = "_padfree_acceleration"
TrainerKind = Literal["hf", "sft", "reward"]


# -- which trainers the builtin wrapper knows ------------------------------------------------------------------


def _library_class(trainer: Any, module_prefix: str, name: str) -> type | None:
    for cls in type(trainer).__mro__:
        if cls.__name__ == name and cls.__module__.startswith(module_prefix):
            return cls
    return None


def trainer_kind(trainer: Any) -> TrainerKind | None:
    """``"sft"`` for TRL ``SFTTrainer``, ``"reward"`` for TRL ``RewardTrainer``, ``"hf"`` for transformers
    ``Trainer``, ``None`` for anything else.

    A subclass that overrides ``compute_loss`` or ``prediction_step`` (DPO, sentence-transformers
    trainers, custom ones) is not claimed: what it does with a batch is unknown, so feeding it packed rows could
    be silently wrong. A plugin that knows it can implement ``wrap_trainer``.
    """
    base = _library_class(trainer, "transformers", "Trainer")
    if base is None:
        return None
    sft = _library_class(trainer, "trl", "SFTTrainer")
    reward = _library_class(trainer, "trl", "RewardTrainer")
    owner = sft or reward or base
    cls = type(trainer)
    if cls.compute_loss is not owner.compute_loss or cls.prediction_step is not owner.prediction_step:
        return None
    return "sft" if sft is not None else "reward" if reward is not None else "hf"


# -- the collator as the trainer sees it --------------------------------------------------------------------------


@dataclass
class TrainerCollator:
    """The assembly's collator as a trainer's ``data_collator`` (picklable, for DataLoader workers);
    ``labelled_logits`` adds :func:`~padfree_plugins.builtin.tasks.causal_lm.keep_labelled_logits`'s keys to each batch;
    ``unlabelled_token`` (the pad id of a replaced ``DataCollatorForLanguageModeling``) gets no loss, as there."""

    collator: Any
    labelled_logits: bool = False
    unlabelled_token: int | None = None

    def __call__(self, rows: list[Mapping[str, Any]]) -> Any:
        if rows and isinstance(rows[0], Mapping) and "seq_lengths" in rows[0]:
            rows = [example for row in rows for example in split_packed_row(row)]
        batch = self.collator(rows)
        if self.unlabelled_token is not None and "labels" in batch:
            batch["labels"] = batch["labels"].masked_fill(batch["input_ids"] == self.unlabelled_token, -100)
        return keep_labelled_logits(batch) if self.labelled_logits else batch


def labelled_logits_apply(trainer: Any, assembly: Assembly, kind: TrainerKind) -> bool:
    """Whether batches should carry ``logits_to_keep`` / ``shift_labels``: the ``causal_lm`` task with its option on,
    HF ``Trainer`` (TRL's fused LM head builds no logits anyway), the model's own loss (label smoothing and a
    ``compute_loss_func`` read every position's logits) and a model whose forward takes ``logits_to_keep``."""
    if kind != "hf" or not getattr(assembly.collator, "labelled_logits_only", False) or uses_own_loss(trainer):
        return False
    return "logits_to_keep" in inspect.signature(type(assembly.model).forward).parameters


def uses_own_loss(trainer: Any) -> bool:
    """Label smoothing or a ``compute_loss_func``: the loss is computed from the logits, outside the model. TRL's
    DFT loss (``loss_type: dft``) is computed from the fused log-probabilities, label smoothing or not."""
    if getattr(trainer.args, "loss_type", "nll") == "dft":
        return trainer.compute_loss_func is not None  # TRL refuses the pair itself
    return trainer.label_smoother is not None or trainer.compute_loss_func is not None


def _per_token(value: Any, batch: Mapping) -> bool:
    return (isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == 1
            and value.shape[1] == batch["input_ids"].shape[-1])


# -- the patch ----------------------------------------------------------------------------------------------------



@dataclass
class TrainerPatch:
    """What :meth:`apply` changed on a trainer, and how to change it back (:meth:`undo`)."""

    trainer: Any
    assembly: Assembly
    kind: TrainerKind
    saved: dict[str, Any] = field(default_factory=dict)
    neftune: PackedNeftune | None = None
    whole_batches: WholeBatches | None = None
    active: bool = True

    @classmethod
    def apply(cls, trainer: Any, assembly: Assembly) -> "TrainerPatch":
        kind = trainer_kind(trainer)
        if kind is None:
            raise PadfreeError(f"{type(trainer).__name__} is not a transformers Trainer / TRL SFTTrainer / "
                               "RewardTrainer this wrapper knows (it overrides compute_loss or prediction_step)")
        check_parallelism(trainer)
        if trainer.model is None or unwrap_model(trainer.model) is not assembly.model:
            raise PadfreeError("the assembly was built for another model than trainer.model")
        check_collator(trainer.data_collator)
        unlabelled_token = language_modeling_pad_id(trainer) if assembly.plan.task.name == "causal_lm" else None
        collator = PreferenceCollator(assembly.collator) if kind == "reward" else assembly.collator
        check_datasets(trainer, collator)
        check_token_budget(trainer, kind, assembly.config)
        note_trl_eval_packing(trainer)
        patch = cls(trainer, assembly, kind, whole_batches=WholeBatches.apply(trainer))
        try:
            patch._install(collator if kind == "reward" else TrainerCollator(
                assembly.collator, labelled_logits_apply(trainer, assembly, kind), unlabelled_token))
        except BaseException:  # an error part-way leaves the trainer as it was
            patch.undo()
            raise
        return patch

    def _install(self, collator: Any) -> None:
        """Put ``collator``, the signature columns, the loss, evaluation, token counting, the token-budget dataloader
        and packed NEFTune on the trainer, saving what each replaces (for :meth:`undo`)."""
        trainer, assembly = self.trainer, self.assembly
        for name in ("data_collator", "_signature_columns"):
            self.saved[name] = getattr(trainer, name)
        for name in ("compute_loss", "prediction_step", "loss_is_scaled_for_ga", "_track_num_input_tokens"):
            self.saved[name] = own_attribute(trainer, name)
        trainer.data_collator = collator
        trainer._set_signature_columns_if_needed()
        trainer._signature_columns = _signature_columns(trainer, assembly)
        trainer.compute_loss = self.compute_loss
        trainer.prediction_step = self.prediction_step
        trainer._track_num_input_tokens = self.track_num_input_tokens
        if uses_token_budget(assembly.config):
            self.saved["get_train_dataloader"] = own_attribute(trainer, "get_train_dataloader")
            trainer.get_train_dataloader = self.train_dataloader
        scaled = getattr(assembly.forward, "loss_is_scaled_for_ga", None)
        if scaled is not None and not uses_own_loss(trainer):
            # a task forward that says whether it normalises by num_items_in_batch itself (a loss the trainer
            # computes — label smoothing, compute_loss_func — is the trainer's to scale)
            trainer.loss_is_scaled_for_ga = scaled
        if getattr(trainer, "neftune_noise_alpha", None) is not None:  # NEFTune scaled per example, as padded
            self.saved["neftune_noise_alpha"] = own_attribute(trainer, "neftune_noise_alpha")
            embeddings = unwrap_model(trainer.model).get_input_embeddings()
            self.neftune = PackedNeftune.install(embeddings, trainer.neftune_noise_alpha)
            trainer.neftune_noise_alpha = None

    def undo(self) -> None:
        """Restore the collator, the signature columns and the trainer's own compute_loss / prediction_step."""
        if not self.active:
            return
        restore_attributes(self.trainer, self.saved)
        if self.whole_batches is not None:
            self.whole_batches.undo()
        if self.neftune is not None:
            self.neftune.remove()
        self.active = False

    # -- what the trainer calls ---------------------------------------------------------------------------------

    def track_num_input_tokens(self, inputs: Mapping) -> None:
        """``include_num_input_tokens_seen``: a packed batch has no padding, so ``non_padding`` counts every token (the
        trainer would count the tokens unequal to the pad id, dropping real ones where pad is eos, say)."""
        trainer = self.trainer
        name = getattr(trainer.model, "main_input_name", "input_ids")
        if trainer.args.include_num_input_tokens_seen != "non_padding" or name not in inputs:
            return type(trainer)._track_num_input_tokens(trainer, inputs)
        tokens = torch.as_tensor(inputs[name].numel(), device=trainer.args.device, dtype=torch.int64)
        trainer.state.num_input_tokens_seen += trainer.accelerator.gather(tokens).sum().item()

    def train_dataloader(self) -> Any:
        """``batching.strategy: tokens``: micro-batches filled up to a token budget (:mod:`padfree_plugins.batching.sampler`)."""
        return trainer_train_dataloader(self.trainer, self.assembly.config, self.trainer.data_collator)

    def model_kwargs(self, fused: bool) -> dict[str, Any]:
        """Keyword arguments for the model besides the batch: TRL's fused LM head and MoE router logits."""
        if self.kind != "sft":
            return {}
        kwargs: dict[str, Any] = {"use_cache": False}
        if fused:
            kwargs["fused_lm_head"] = True
        if getattr(self.trainer, "aux_loss_enabled", False):
            kwargs["output_router_logits"] = True
        return kwargs

    def compute_loss(self, model: Any, inputs: Mapping, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The loss of a packed batch, through ``assembly.forward`` (the trainer's ``compute_loss``)."""
        trainer = self.trainer
        if self.kind == "reward":  # TRL's own loss and metrics on the per-text scores (see padfree_plugins.integrations.trl_reward)
            with self._neftune_scope(inputs):
                outputs = self.assembly.forward(model, {k: v for k, v in inputs.items() if k != "margin"})
            loss = preference_loss(trainer, outputs.logits, inputs)
            return (loss, outputs) if return_outputs else loss
        own_loss = uses_own_loss(self.trainer) and "labels" in inputs
        if own_loss or return_outputs:  # the logits of every position are wanted
            inputs = drop_labelled_logits(inputs)
        kwargs = self.model_kwargs(fused=not own_loss)
        if num_items_in_batch is not None and (self.kind == "sft" or trainer.model_accepts_loss_kwargs):
            kwargs["num_items_in_batch"] = num_items_in_batch
        with self._neftune_scope(inputs):
            loss, outputs = self._loss_and_outputs(model, inputs, kwargs, own_loss, num_items_in_batch)
        loss = self._scale_for_devices(loss, num_items_in_batch)
        if self.kind == "sft" and not own_loss:
            loss = loss + sft_aux_loss(trainer, outputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _neftune_scope(self, inputs: Mapping) -> Any:
        """The block in which the embeddings' forwards belong to ``inputs`` (for packed NEFTune, when on)."""
        return self.neftune.for_batch(inputs) if self.neftune is not None else contextlib.nullcontext()

    def _loss_and_outputs(self, model: Any, inputs: Mapping, kwargs: dict[str, Any], own_loss: bool,
                          num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
        """The forward and its loss: the model's own, or the trainer's (label smoothing, ``compute_loss_func``)."""
        trainer = self.trainer
        if own_loss:
            labels = inputs["labels"]
            kwargs.pop("num_items_in_batch", None)
            outputs = self.assembly.forward(model, {k: v for k, v in inputs.items() if k != "labels"}, **kwargs)
            if trainer.compute_loss_func is not None:
                loss = trainer.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            else:
                loss = trainer.label_smoother(outputs, labels, shift_labels=self.assembly.plan.task.name == "causal_lm",
                                              num_items_in_batch=num_items_in_batch)
            if self.kind == "sft":  # TRL records its metrics from a fused forward beside this loss, as here
                with torch.no_grad():
                    fused = self.assembly.forward(model, inputs, **self.model_kwargs(fused=True))
                    record_sft_metrics(trainer, fused, inputs)
        else:
            outputs = self.assembly.forward(model, inputs, **kwargs)
            if self.kind == "sft":
                record_sft_metrics(trainer, outputs, inputs)
                return sft_loss(trainer, outputs, num_items_in_batch), outputs
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs[0]
            if loss is None:
                task = self.assembly.plan.task.name
                raise PadfreeError(
                    f"the model returned no loss for task {task!r}: does the batch carry labels"
                    f"{' and does task_options name a loss' if task == 'embedding' else ''}? Batch keys: "
                    f"{', '.join(inputs)}"
                )
        return loss, outputs

    def _scale_for_devices(self, loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        """``average_tokens_across_devices``: ``num_items_in_batch`` counts every rank's tokens, and DDP averages
        the gradients over ranks, so the loss is multiplied back by the number of ranks (as the trainers do). Not
        for a loss the trainer knows is a per-batch mean (``loss_is_scaled_for_ga`` False)."""
        trainer = self.trainer
        counted = self.kind == "sft" or trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None
        counted = counted and getattr(trainer, "loss_is_scaled_for_ga", None) is not False
        if trainer.args.average_tokens_across_devices and num_items_in_batch is not None and counted:
            loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
        return loss

    def prediction_step(self, model: Any, inputs: Mapping, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """Evaluation / prediction on a packed batch; per-token outputs and labels re-padded for metrics.

        A task forward with ``for_metrics(outputs, batch)`` says itself what ``compute_metrics`` gets (one entry per
        dataset row). With no ``label_names`` (a bare encoder trained for embeddings), a loss the forward returns
        is reported, as the trainer reports one for models that return a loss without labels, and the labels the
        batch carries reach ``compute_metrics``.
        """
        trainer = self.trainer
        batch_as_given = inputs
        inputs = trainer._prepare_inputs(inputs)
        if self.kind == "reward":  # as Trainer's own prediction_step on TRL's loss: the loss and every text's score
            with torch.no_grad(), trainer.compute_loss_context_manager():
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
            if prediction_loss_only:
                return (loss.detach(), None, None)
            if "inputs" in (trainer.args.include_for_metrics or ()):
                self._repad_metric_inputs(batch_as_given, inputs)
            # labels: the empty tuple of TRL's empty label_names, without which compute_metrics is never called
            return (loss.detach(), outputs.logits.detach(), ())
        has_labels = bool(trainer.label_names) and all(inputs.get(k) is not None for k in trainer.label_names)
        loss_without_labels = not trainer.label_names
        num_items = (trainer._get_num_items_in_batch([inputs], trainer.args.device)
                     if has_labels and self.kind == "hf" else None)
        if prediction_loss_only and not (has_labels or loss_without_labels):
            return (None, None, None)
        with torch.no_grad(), trainer.compute_loss_context_manager():
            if prediction_loss_only and has_labels:
                return (self.compute_loss(model, inputs, num_items_in_batch=num_items).detach().mean(), None, None)
            if has_labels and (uses_own_loss(self.trainer) or self.kind == "sft"):
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)
                if self.kind == "sft" and not uses_own_loss(self.trainer):
                    # the fused LM head builds no logits: one more forward for them, as TRL itself does
                    outputs = self.assembly.forward(model, {k: v for k, v in inputs.items() if k != "labels"},
                                                    **self.model_kwargs(fused=False))
            else:
                kwargs = self.model_kwargs(fused=False)
                if num_items is not None and trainer.model_accepts_loss_kwargs:
                    kwargs["num_items_in_batch"] = num_items
                batch = inputs if has_labels else {k: v for k, v in inputs.items() if k not in trainer.label_names}
                outputs = self.assembly.forward(model, drop_labelled_logits(batch), **kwargs)
                loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
                if loss is not None and (has_labels or loss_without_labels):
                    loss = self._scale_for_devices(loss, num_items)
                else:
                    loss = None
        loss = None if loss is None else loss.detach().mean()
        if prediction_loss_only:
            return (loss, None, None)
        if "inputs" in (trainer.args.include_for_metrics or ()):
            self._repad_metric_inputs(batch_as_given, inputs)
        for_metrics = getattr(self.assembly.forward, "for_metrics", None)
        if for_metrics is not None:
            logits, labels = for_metrics(outputs, inputs)  # a bare encoder's batch labels count (no label_names)
            return (loss, _detach(logits), _detach(labels) if has_labels or loss_without_labels else None)
        if ignore_keys is None:
            ignore_keys = list(getattr(getattr(unwrap_model(model), "config", None), "keys_to_ignore_at_inference",
                                       ["past_key_values"]))
        items = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)
        if self.kind == "sft":  # TRL hands metrics the logits alone (not an MoE's aux loss and router logits)
            items = [("logits", outputs["logits"])]
        skip = (*ignore_keys, "loss")
        logits = tuple(self._repad(v, inputs, None) for k, v in items if k not in skip and v is not None)
        labels = None
        if has_labels:
            labels = tuple(self._repad(inputs[k], inputs, -100) for k in trainer.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        logits = logits[0] if len(logits) == 1 else logits
        return (loss, _detach(logits), _detach(labels))

    def _repad_metric_inputs(self, batch_as_given: Any, inputs: Mapping) -> None:
        """``include_for_metrics=["inputs"]``: the trainer reads the model's main input from the batch it handed
        to ``prediction_step``; a packed row ``[1, T]`` becomes ``[n, L_max]``, padded with the tokenizer's pad id
        (as a padding collator pads), so that every example is one row of the inputs ``compute_metrics`` sees."""
        name = getattr(self.trainer.model, "main_input_name", "input_ids")
        if not isinstance(batch_as_given, dict) or name not in inputs:
            return
        pad = getattr(self.trainer.processing_class, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(self.assembly.model, "config", None), "pad_token_id", None)
        batch_as_given[name] = self._repad(inputs[name], inputs, -100 if pad is None else pad)

    def _repad(self, value: Any, batch: Mapping, fill: float | None) -> Any:
        """A packed per-token tensor ``[1, T, ...]`` -> ``[n, L_max, ...]``; anything else unchanged."""
        if not _per_token(value, batch):
            return value
        padded, mask = self.assembly.reverter(value.unsqueeze(-1) if value.ndim == 2 else value, batch)
        if value.ndim == 2:
            padded = padded.squeeze(-1)
        if fill is not None:
            padded = padded.masked_fill(~mask.bool().reshape(mask.shape + (1,) * (padded.ndim - 2)), fill)
        return padded


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value


def _signature_columns(trainer: Any, assembly: Assembly) -> list[str]:
    """The trainer's signature columns plus every key the task's collator reads (and TRL's ``seq_lengths``).

    A collator whose keys depend on the dataset (e.g. the embedding task's ``<column>_input_ids``) says which
    dataset columns it reads through a ``dataset_columns(names)`` method.
    """
    task = assembly.plan.task
    keys = ["input_ids", *task.required_keys, *task.token_keys, *task.example_keys, "seq_lengths"]
    reads = getattr(assembly.collator, "dataset_columns", None)
    if reads is not None:
        for _, dataset in trainer_datasets(trainer):
            keys += reads(getattr(dataset, "column_names", None) or [])
    return list(dict.fromkeys((*(trainer._signature_columns or ()), *keys)))


@dataclass
class WholeBatches:
    """accelerate's ``dispatch_batches`` kept off: it loads batches on the main process and slices every tensor by
    rows for the processes, and a packed batch is one row (its boundaries would be cut to one number). Refused when
    asked for; when left unset (accelerate would dispatch an iterable dataset's batches) it is turned off — every
    process loads its own examples, the same batches — and :meth:`undo` unsets it again."""

    config: Any
    active: bool = True

    @classmethod
    def apply(cls, trainer: Any) -> "WholeBatches | None":
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


# -- the entry point ----------------------------------------------------------------------------------------------


@dataclass
class Acceleration:
    """A trainer made padding-free: the assembly (model, collator, …) and the trainer patch. ``undo()`` reverts."""

    trainer: Any
    assembly: Assembly
    trainer_patch: Any
    active: bool = True

    def undo(self) -> None:
        """Restore the trainer (collator, compute_loss, prediction_step, columns) and the model. Safe twice."""
        if not self.active:
            return
        self.trainer_patch.undo()
        self.assembly.undo()
        if getattr(self.trainer, ACCELERATION_ATTRIBUTE, None) is self:
            delattr(self.trainer, ACCELERATION_ATTRIBUTE)
        self.active = False

    def describe(self) -> dict[str, Any]:
        return {"trainer": type(self.trainer).__name__, "wrapper": type(self.trainer_patch).__name__,
                **self.assembly.describe()}


def accelerate(trainer: Any, config: PadfreeConfig | dict | str | None = None, *,
               host: PluginHost | None = None) -> Acceleration:
    """Make ``trainer`` (HF ``Trainer``, TRL ``SFTTrainer`` / ``RewardTrainer``, or any a plugin knows) train
    padding-free.

    The trainer is changed in place; the returned :class:`Acceleration` undoes it. Bad datasets (examples too long
    for the model, labels not aligned with input_ids), unsupported architectures and unusable attention backends
    are errors here, before training starts.
    """
    config = load_config(config)
    previous = getattr(trainer, ACCELERATION_ATTRIBUTE, None)
    if previous is not None and previous.active:
        raise PadfreeError(f"{type(trainer).__name__} is already padding-free; call .undo() on the first acceleration "
                           "before accelerating it again")
    check_model_given(trainer)
    host = host or PluginHost(block=config.plugins.block)
    config = host.call_first("trainer_config", trainer=trainer, config=config) or config
    assembly = assemble(trainer.model, config, host=host)
    try:
        trainer_patch = host.call_first("wrap_trainer", trainer=trainer, assembly=assembly, config=config)
        if trainer_patch is None:
            raise PluginError(
                f"no plugin knows how to make {type(trainer).__name__} padding-free. The builtin wrapper takes "
                "transformers.Trainer, trl.SFTTrainer and trl.RewardTrainer (and subclasses that keep their "
                "compute_loss and prediction_step); for another trainer install a plugin implementing wrap_trainer, "
                "or use padfree_plugins.assemble() and feed its collator and forward yourself."
            )
    except BaseException:
        assembly.undo()
        raise
    acceleration = Acceleration(trainer, assembly, trainer_patch)
    setattr(trainer, ACCELERATION_ATTRIBUTE, acceleration)
    return acceleration
