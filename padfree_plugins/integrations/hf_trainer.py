"""The plugin for HF ``transformers.Trainer`` (and subclasses that keep its ``compute_loss`` and
``prediction_step``).

* **compute_loss** calls ``assembly.forward(model, batch, **loss_kwargs)`` and reads ``.loss`` — the contract that
  lets task plugins (embeddings, classification) bring their own per-example heads to the same wrapper. It passes
  ``num_items_in_batch`` when the trainer counts it (gradient accumulation) and applies
  ``average_tokens_across_devices`` exactly as the trainer would. Label smoothing and a ``compute_loss_func``
  compute the loss from the logits, as the trainer does.
* **labelled logits only** (``causal_lm``): the loss call gets ``logits_to_keep`` / ``shift_labels``, so the LM head
  runs only where a label counts. The collator holds them aside (:mod:`~padfree_plugins.packing.labelled_logits`)
  and only :meth:`~HFTrainerPatch.compute_loss` passes them to the model, when it returns the loss alone and the
  loss is the model's: any other forward on the batch (a subclass's ``training_step``, a caller of
  ``compute_loss(..., return_outputs=True)``, evaluation's logits) gets every position's logits, as padded.
* **tiled loss** (``memory.tile_tokens``, :mod:`~padfree_plugins.modeling.tiling`): the loss call's labelled
  positions go through the LM head and the cross-entropy in tiles (label smoothing included), recomputed in the
  backward; a ``compute_loss_func`` is refused there.
* **prediction_step** (``evaluate`` / ``predict``): per-token outputs come back packed ``[1, T, ...]`` and are
  re-padded to ``[n, L_max, ...]`` (labels with -100) so that ``compute_metrics`` sees the shapes it always saw; a
  task forward with ``for_metrics`` chooses what it gets itself (one entry per dataset row).
* **sequence parallelism** (``sequence_parallel.size: N``): each rank's own micro-batch goes to
  ``assembly.forward``, which computes this rank's slice of the group's row; ``num_items_in_batch`` counted over
  every rank (``average_tokens_across_devices``) and the loss times the number of processes make the training, and
  the logged loss (the mean over ranks), those of one process on the global batch. Evaluation's per-token outputs
  (``predict``, ``compute_metrics``) are the group's slices gathered back into the row, each rank keeping its own
  micro-batch's tokens (``SequenceParallelForward.own_tokens``), then re-padded as above: every rank hands the
  trainer its own examples, so its gather over processes counts each example once. A task that pools whole
  examples (``seq_cls``, ``embedding``, ``reranker``; ``SequenceParallelForward.pooled``) computes its own
  examples' outputs and loss on each rank, as under data parallelism. A loss the trainer computes from the logits
  (label smoothing, ``compute_loss_func``) is refused.

:class:`HFTrainerPatch` is also the base of TRL's ``SFTTrainer`` plugin (:mod:`.trl_sft`), which changes only
what its methods below say they are for.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.batching.prefix_groups import PrefixGroupSampler
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.base import (
    TrainerCollator,
    TrainerPatch,
    detach,
    keeps_methods,
    library_class,
)
from padfree_plugins.integrations.checks import (
    check_token_budget,
    language_modeling_pad_id,
    sequence_parallel_size,
    shares_prefixes,
)
from padfree_plugins.integrations.resume import batching_seed
from padfree_plugins.modeling.mixers import mixer_chunk
from padfree_plugins.modeling.patching import own_attribute, unwrap_model
from padfree_plugins.modeling.tiling import SMOOTHING_KEYWORD
from padfree_plugins.packing.labelled_logits import (
    drop_labelled_logits,
    take_labelled_logits,
    with_labelled_logits,
)
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, on_device, whole_examples

logger = logging.getLogger("padfree_plugins")


def uses_own_loss(trainer: Any) -> bool:
    """Label smoothing or a ``compute_loss_func``: the loss is computed from the logits, outside the model. TRL's
    DFT loss (``loss_type: dft``) is computed from the fused log-probabilities, label smoothing or not."""
    if getattr(trainer.args, "loss_type", "nll") == "dft":
        return trainer.compute_loss_func is not None  # TRL refuses the pair itself
    return trainer.label_smoother is not None or trainer.compute_loss_func is not None


class HFTrainerPatch(TrainerPatch):
    """``transformers.Trainer`` trained padding-free."""

    kind = "hf"
    sequence_parallel = True
    gathers_logits = True
    shares_prompts = True
    groups_prefixes = True

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        return keeps_methods(trainer, library_class(trainer, "transformers", "Trainer"))

    def make_collator(self) -> TrainerCollator:
        causal_lm = self.assembly.plan.task.name == "causal_lm"
        share = shares_prefixes(self.trainer, self.assembly, prompt_column=False, refusal=self.why_not_shared())
        return TrainerCollator(self.assembly.collator, self.labelled_logits(),
                               language_modeling_pad_id(self.trainer) if causal_lm else None,
                               share_prefixes=share, chunk=mixer_chunk(self.assembly.model) if share else 1)

    def why_not_shared(self) -> str | None:
        """Why this trainer's examples cannot share the unlabelled tokens they begin with (``prefix_sharing``; the
        checks every trainer shares come after: :func:`~padfree_plugins.integrations.checks.why_prompts_not_shared`),
        or ``None``."""
        task = self.assembly.plan.task.name
        if task != "causal_lm":
            return f"task {task} trains every example whole (prefixes are shared for causal_lm)"
        if getattr(self.trainer, "neftune_noise_alpha", None) is not None:
            return "NEFTune scales its noise by each example's length, which a shared row splits"
        if getattr(self.trainer.args, "torch_compile", False):
            return ("torch_compile: the model's guard reads a shared row's structure on the host, which a compiled graph "
                    "cannot")
        return None

    def check(self) -> None:
        check_token_budget(self.trainer, self.assembly.config)
        self.check_sequence_parallel()
        self.check_tiled_loss()
        self.check_prompt_groups()

    def check_prompt_groups(self) -> None:
        """``batching.group_prefixes``: the training set must have a length and token rows (``input_ids``) to read
        every row's prompt from."""
        if not self.assembly.config.batching.group_prefixes:
            return
        dataset = self.trainer.train_dataset
        columns = getattr(dataset, "column_names", None)
        if dataset is None or not hasattr(dataset, "__len__") or (columns is not None and "input_ids" not in columns):
            raise ConfigError(
                "batching.group_prefixes reads every training row's prompt (its unlabelled input_ids) to group them: "
                f"{type(self.trainer).__name__}'s training set has no length or no input_ids column (an iterable "
                "dataset, rows processed at collate time). Remove batching.group_prefixes")

    def grouped_sampler(self, train_dataset: Any = None) -> PrefixGroupSampler:
        """``batching.group_prefixes``: the trainer's train sampler, micro-batches of whole prompt groups
        (:mod:`padfree_plugins.batching.prefix_groups`)."""
        dataset = self.trainer.train_dataset if train_dataset is None else train_dataset
        return PrefixGroupSampler.of(dataset, self.trainer.args.per_device_train_batch_size,
                                     batching_seed(self.trainer, self.assembly.config))

    def tiles_loss(self) -> bool:
        """Whether ``memory`` tiles the LM head and loss of this causal-LM training."""
        memory = self.assembly.config.memory
        return (memory.tile_tokens is not None and memory.tile_loss
                and self.assembly.plan.task.name == "causal_lm")

    def smooths_tiled(self) -> bool:
        """Whether the tiled loss computes the trainer's label smoothing (HF ``Trainer`` with ``tile_loss``, a label
        smoother and no ``compute_loss_func``, labelled logits possible, no sequence parallelism)."""
        trainer = self.trainer
        return (self.kind == "hf" and self.tiles_loss() and trainer.label_smoother is not None
                and trainer.compute_loss_func is None and not self.splits_rows() and self.can_label_logits())

    def own_loss(self) -> bool:
        """Whether the loss is computed from every position's logits outside the model (:func:`uses_own_loss`,
        unless the tiled loss smooths the labels itself)."""
        return uses_own_loss(self.trainer) and not self.smooths_tiled()

    def check_tiled_loss(self) -> None:
        """``memory.tile_loss``: refuse a ``compute_loss_func`` (it reads the whole row's logits, which the tiled
        loss never builds); say once where label smoothing still computes its loss from every position's logits."""
        if not self.tiles_loss():
            return
        if self.trainer.compute_loss_func is not None:
            raise PadfreeError(
                "memory.tile_tokens with a compute_loss_func: the function computes the loss from the logits of the "
                "whole row, which the tiled loss never builds. Drop compute_loss_func, or set memory.tile_loss: false "
                "(the MLP is still tiled)")
        if self.trainer.label_smoother is not None and not self.smooths_tiled():
            logger.warning(
                "padfree-plugins: memory.tile_loss does not apply with label_smoothing_factor here: labelled logits "
                "are off (task option labelled_logits_only: false, or the model's forward takes no logits_to_keep), "
                "so the trainer's label smoother reads every position's logits, built for the whole row (the MLP is "
                "still tiled)")

    def splits_rows(self) -> bool:
        """Whether each rank computes a slice of its group's row (``sequence_parallel.size > 1``)."""
        return sequence_parallel_size(self.assembly.config) > 1

    def pools_examples(self) -> bool:
        """Whether the task's forward pools whole examples (seq_cls, embedding, reranker): under sequence parallelism
        its outputs are this rank's own examples already (not per token of its slice)."""
        return bool(getattr(self.assembly.forward, "pools_examples", False))

    def check_sequence_parallel(self) -> None:
        """Under sequence parallelism: refuse a loss the trainer computes from the logits, which are this rank's
        slice of the group's row while its labels are its own micro-batch's."""
        task = self.assembly.plan.task.name
        if self.splits_rows() and task != "causal_lm" and not self.pools_examples():
            raise PadfreeError(
                f"sequence_parallel.size: {sequence_parallel_size(self.assembly.config)} with task: {task}: under "
                f"sequence parallelism {type(self.trainer).__name__} trains causal language models and the tasks "
                "that pool whole examples (seq_cls, embedding, reranker). Use sequence_parallel.size: 1 for this "
                "task")
        if self.splits_rows() and uses_own_loss(self.trainer):
            raise PadfreeError(
                f"sequence_parallel.size: {sequence_parallel_size(self.assembly.config)} with label smoothing or a "
                "compute_loss_func: the trainer computes that loss from the logits, which under sequence parallelism "
                "are this rank's slice of its group's row, not its own micro-batch. Use the model's loss (no "
                "label_smoothing_factor, no compute_loss_func) or sequence_parallel.size: 1")

    def install(self, collator: Any) -> None:
        super().install(collator)
        if self.assembly.config.batching.group_prefixes:
            self.saved["_get_train_sampler"] = own_attribute(self.trainer, "_get_train_sampler")
            self.trainer._get_train_sampler = self.grouped_sampler
        scaled = getattr(self.assembly.forward, "loss_is_scaled_for_ga", None)
        if scaled is not None and not self.own_loss():
            # a task forward that says whether it normalises by num_items_in_batch itself (a loss the trainer
            # computes — label smoothing, compute_loss_func — is the trainer's to scale)
            self.trainer.loss_is_scaled_for_ga = scaled

    # -- what a trainer built on Trainer changes (TRL's SFTTrainer: see trl_sft) --------------------------------

    def labelled_logits(self) -> bool:
        """Whether batches hold ``logits_to_keep`` / ``shift_labels`` for the loss: the task's collator asks for it,
        the loss is the model's (label smoothing and a ``compute_loss_func`` read every position's logits), and the
        model's forward takes ``logits_to_keep``."""
        return self.can_label_logits() and not self.own_loss()

    def can_label_logits(self) -> bool:
        """Whether the task's collator asks for labelled logits and the model's forward takes ``logits_to_keep``."""
        if not getattr(self.assembly.collator, "labelled_logits_only", False):
            return False
        return "logits_to_keep" in inspect.signature(type(self.assembly.model).forward).parameters

    def model_kwargs(self, fused: bool) -> dict[str, Any]:
        """Keyword arguments for the model besides the batch (``fused``: the loss needs no logits)."""
        return {}

    def passes_num_items(self) -> bool:
        """Whether the model gets ``num_items_in_batch`` (and so normalises by it)."""
        return bool(self.trainer.model_accepts_loss_kwargs)

    def loss_of(self, outputs: Any, inputs: Mapping, num_items_in_batch: Any) -> torch.Tensor:
        """The loss of a forward whose loss is the model's."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs[0]
        if loss is None:
            task = self.assembly.plan.task.name
            raise PadfreeError(
                f"the model returned no loss for task {task!r}: does the batch carry labels"
                f"{' and does task_options name a loss' if task == 'embedding' else ''}? Batch keys: "
                f"{', '.join(inputs)}"
            )
        return loss

    def own_loss_and_outputs(self, model: Any, inputs: Mapping, kwargs: dict[str, Any],
                             num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
        """The trainer's loss from the logits (label smoothing, ``compute_loss_func``)."""
        trainer = self.trainer
        labels = inputs["labels"]
        kwargs.pop("num_items_in_batch", None)
        outputs = self.assembly.forward(model, {k: v for k, v in inputs.items() if k != "labels"}, **kwargs)
        if trainer.compute_loss_func is not None:
            loss = trainer.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        else:
            loss = trainer.label_smoother(outputs, labels, shift_labels=self.assembly.plan.task.name == "causal_lm",
                                          num_items_in_batch=num_items_in_batch)
        return loss, outputs

    def add_aux_loss(self, loss: torch.Tensor, outputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """Terms the trainer adds to the model's loss after scaling it (none: the model's loss includes them)."""
        return loss

    def evaluates_through_loss(self) -> bool:
        """Whether evaluation with labels computes its loss through :meth:`compute_loss` (not the model's own)."""
        return uses_own_loss(self.trainer)

    def eval_loss_and_outputs(self, model: Any, inputs: Mapping, num_items: Any) -> tuple[torch.Tensor, Any]:
        """Evaluation's loss and outputs when :meth:`evaluates_through_loss`."""
        return self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)

    def counts_eval_items(self) -> bool:
        """Whether evaluation counts ``num_items_in_batch``, as the trainer's own ``prediction_step`` does."""
        return True

    def metric_outputs(self, outputs: Any) -> Any:
        """The ``(name, value)`` pairs of the outputs that ``compute_metrics`` gets as logits."""
        return outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)

    # -- what the trainer calls ---------------------------------------------------------------------------------

    def compute_loss(self, model: Any, inputs: Mapping, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The loss of a packed batch, through ``assembly.forward`` (the trainer's ``compute_loss``)."""
        inputs, held = self.labelled_logits_of(inputs)
        if SHARED_PREFIXES_KEY in inputs:
            inputs = on_device(inputs, inputs["input_ids"].device)
        smoothed = (not return_outputs and held is not None and "labels" in inputs and self.smooths_tiled())
        own_loss = uses_own_loss(self.trainer) and "labels" in inputs and not smoothed
        if own_loss or return_outputs:  # the logits of every position are wanted
            inputs = drop_labelled_logits(inputs)
        elif held is not None and "labels" in inputs:
            inputs = with_labelled_logits(inputs, held)
        kwargs = self.model_kwargs(fused=not own_loss)
        if smoothed:  # the tiled loss computes the label smoother's loss
            kwargs[SMOOTHING_KEYWORD] = float(self.trainer.label_smoother.epsilon)
        if num_items_in_batch is not None and self.passes_num_items():
            kwargs["num_items_in_batch"] = num_items_in_batch
        with self.neftune_scope(inputs):
            if own_loss:
                loss, outputs = self.own_loss_and_outputs(model, inputs, kwargs, num_items_in_batch)
            else:
                outputs = self.assembly.forward(model, inputs, **kwargs)
                loss = self.loss_of(outputs, inputs, num_items_in_batch)
        loss = self.scale_for_devices(loss, num_items_in_batch)
        if not own_loss:
            loss = self.add_aux_loss(loss, outputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def scale_for_devices(self, loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        """``average_tokens_across_devices``: ``num_items_in_batch`` counts every rank's tokens, and DDP averages
        the gradients over ranks, so the loss is multiplied back by the number of ranks (as the trainers do). Not
        for a loss the trainer knows is a per-batch mean (``loss_is_scaled_for_ga`` False)."""
        trainer = self.trainer
        counted = self.passes_num_items() or trainer.compute_loss_func is not None
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
        if SHARED_PREFIXES_KEY in inputs and not prediction_loss_only:  # per-token outputs of every example whole
            inputs = whole_examples(take_labelled_logits(inputs)[0])
        has_labels = bool(trainer.label_names) and all(inputs.get(k) is not None for k in trainer.label_names)
        loss_without_labels = not trainer.label_names
        num_items = (trainer._get_num_items_in_batch([inputs], trainer.args.device)
                     if has_labels and self.counts_eval_items() else None)
        if prediction_loss_only and not (has_labels or loss_without_labels):
            return (None, None, None)
        with torch.no_grad(), trainer.compute_loss_context_manager():
            if prediction_loss_only and has_labels:  # the loss alone: the labelled logits held for it, if any
                return (self.compute_loss(model, inputs, num_items_in_batch=num_items).detach().mean(), None, None)
            inputs, _ = take_labelled_logits(inputs)
            if has_labels and self.evaluates_through_loss():
                loss, outputs = self.eval_loss_and_outputs(model, inputs, num_items)
            else:
                kwargs = self.model_kwargs(fused=False)
                if num_items is not None and trainer.model_accepts_loss_kwargs:
                    kwargs["num_items_in_batch"] = num_items
                batch = inputs if has_labels else {k: v for k, v in inputs.items() if k not in trainer.label_names}
                outputs = self.assembly.forward(model, drop_labelled_logits(batch), **kwargs)
                loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
                if loss is not None and (has_labels or loss_without_labels):
                    loss = self.scale_for_devices(loss, num_items)
                else:
                    loss = None
        loss = None if loss is None else loss.detach().mean()
        if prediction_loss_only:
            return (loss, None, None)
        self.repad_metric_inputs(batch_as_given, inputs)
        for_metrics = getattr(self.assembly.forward, "for_metrics", None)
        if for_metrics is not None:
            logits, labels = for_metrics(outputs, inputs)  # a bare encoder's batch labels count (no label_names)
            return (loss, detach(logits), detach(labels) if has_labels or loss_without_labels else None)
        if ignore_keys is None:
            ignore_keys = list(getattr(getattr(unwrap_model(model), "config", None), "keys_to_ignore_at_inference",
                                       ["past_key_values"]))
        skip = (*ignore_keys, "loss")
        kept = [(k, v) for k, v in self.metric_outputs(outputs) if k not in skip and v is not None]
        values = [v for _, v in kept]
        if self.splits_rows() and not self.pools_examples():  # this rank's slice -> its own micro-batch's tokens
            values = self.assembly.forward.own_tokens(kept, inputs)
        logits = tuple(self.repad(v, inputs, None) for v in values)
        labels = None
        if has_labels:
            labels = tuple(self.repad(inputs[k], inputs, -100) for k in trainer.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        logits = logits[0] if len(logits) == 1 else logits
        return (loss, detach(logits), detach(labels))


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """HF ``Trainer``, and subclasses that keep its ``compute_loss`` and ``prediction_step``."""
    return HFTrainerPatch.wrap(trainer, assembly)
