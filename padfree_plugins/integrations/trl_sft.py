"""The plugin for TRL ``SFTTrainer`` (and subclasses that keep its ``compute_loss`` and ``prediction_step``).

It trains as HF ``Trainer`` does (:class:`~padfree_plugins.integrations.hf_trainer.HFTrainerPatch`), with TRL's
specifics done as TRL does them: rows TRL packed itself (``packing=True``, a ``seq_lengths`` column) split back
into their examples, the loss from the fused LM head's log-probabilities (``fused_lm_head=True``: no logits
materialised; NLL or DFT), the MoE ``aux_loss`` term, and TRL's metrics (``mean_token_accuracy``, ``entropy``,
``num_tokens``, ``aux_loss``) recorded as TRL records them.

TRL refuses a custom collator when its own ``padding_free=True`` is set and requires ``max_length=None`` for
padding-free training without packing. Neither applies here: build the SFTTrainer normally (its own collator, any
``max_length`` — it truncates during dataset preparation), then accelerate it; the collator is swapped after
construction.

**Vision datasets** (``images`` / ``image`` columns; TRL refuses its own ``padding_free`` for them): TRL's
``DataCollatorForVisionLanguageModeling`` renders, tokenizes and processes the images at collate time, so it is kept
and run on each example alone (:class:`ExampleByExample`) — exactly the processor's output and TRL's labels (its
completion / assistant masks applied) — and those examples are packed by the vision-language family's multimodal
collator (each example's pixels beside its tokens, its mRoPE positions its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.base import TrainerCollator, keeps_methods, library_class
from padfree_plugins.integrations.checks import (
    check_token_budget,
    note_trl_eval_packing,
    sequence_parallel_size,
    shares_prefixes,
)
from padfree_plugins.integrations.hf_trainer import HFTrainerPatch, uses_own_loss
from padfree_plugins.packing.batch import INDEX_KEY
from padfree_plugins.packing.prefixes import WHOLE_TOKENS_KEY


def sft_loss(trainer: Any, outputs: Any, num_items_in_batch: Any) -> torch.Tensor:
    """The loss TRL's ``compute_loss`` makes from the fused LM head's per-token log-probabilities: NLL, or DFT
    (``loss_type: dft``, each token's loss weighted by its detached probability), over ``num_items_in_batch``
    (else the batch's labelled tokens)."""
    per_token = -outputs.log_probs
    if getattr(trainer.args, "loss_type", "nll") == "dft":
        per_token = per_token * outputs.log_probs.exp().detach()
    count = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    return per_token.sum() / torch.as_tensor(count).clamp(min=1)


def sft_aux_loss(trainer: Any, outputs: Any, num_items_in_batch: Any) -> torch.Tensor | float:
    """TRL's MoE load-balancing term: ``router_aux_loss_coef × aux_loss`` per micro-batch, spread over the
    accumulation steps when the trainer counts ``num_items_in_batch`` (added after the rank scaling, as TRL)."""
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss is None or not getattr(trainer, "aux_loss_enabled", False):
        return 0.0
    steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
    return trainer.router_aux_loss_coef * aux_loss / steps


def record_sft_metrics(trainer: Any, outputs: Any, inputs: Mapping) -> None:
    """TRL's bookkeeping around the fused loss: entropy, token accuracy, tokens seen, MoE aux loss."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    mode = "train" if trainer.model.training else "eval"
    gather = trainer.accelerator.gather_for_metrics
    label_mask = getattr(outputs, "label_mask", None)
    if label_mask is not None:
        num_valid = gather(label_mask.sum()).sum()
        for name, value in (("entropy", getattr(outputs, "entropy", None)),
                            ("mean_token_accuracy", getattr(outputs, "is_top1", None))):
            if value is not None:
                total = gather(value.detach().sum()).sum()
                metrics[mode][name].append((total / num_valid).item() if num_valid > 0 else 0.0)
    if mode == "train" and hasattr(trainer, "_total_train_tokens"):
        tokens = inputs.get(WHOLE_TOKENS_KEY, inputs["input_ids"].shape[-1])  # shared prefixes counted per example
        multiple = trainer.args.pad_to_multiple_of if getattr(trainer, "padding_free", False) else None
        if multiple:  # TRL's padding-free collator pads the row to a multiple, and counts that padding
            tokens = -(-tokens // multiple) * multiple
        tokens = torch.tensor(tokens, device=inputs["input_ids"].device)
        trainer._total_train_tokens += gather(tokens).sum().item() // getattr(trainer, "_tp_size", 1)
    if hasattr(trainer, "_total_train_tokens"):
        metrics[mode]["num_tokens"] = [trainer._total_train_tokens]
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss is not None:
        metrics[mode]["aux_loss"].append(gather(aux_loss.detach()).mean().item())


def vision_collator(trainer: Any) -> Any | None:
    """The trainer's collator when it is TRL's own ``DataCollatorForVisionLanguageModeling`` (that class, not a
    subclass: one that changed what it builds is refused like any custom collator), else ``None``."""
    kind = type(trainer.data_collator)
    if kind.__name__ == "DataCollatorForVisionLanguageModeling" and kind.__module__.startswith("trl."):
        return trainer.data_collator
    return None


@dataclass
class ExampleByExample:
    """TRL's vision-language collator (``processing``) run on each row alone, then packed by ``collator`` (the
    assembly's multimodal collator): a batch of one is exactly what the processor and TRL make for that example;
    its padding (``pad_to_multiple_of``), if any, is stripped by its ``attention_mask`` from every per-token value."""

    processing: Any
    collator: Any

    @property
    def media_keys(self) -> tuple[str, ...] | None:
        return getattr(self.collator, "media_keys", None)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> Any:
        return self.collator([self.example(row) for row in rows])

    def example(self, row: Mapping[str, Any]) -> dict[str, Any]:
        output = self.processing([dict(row)])  # a copy: TRL's collator rewrites an ``image`` column in its rows
        keep = output["attention_mask"][0].bool()
        media = self.media_keys or ()
        example = {}
        for key, value in output.items():
            per_token = key not in media and isinstance(value, torch.Tensor) and value.shape[:2] == (1, keep.numel())
            if key != "attention_mask":
                example[key] = value[0][keep] if per_token else value
        if INDEX_KEY in row:  # the row's dataset index, which the collator's errors name
            example[INDEX_KEY] = row[INDEX_KEY]
        return example


class SFTTrainerPatch(HFTrainerPatch):
    """TRL ``SFTTrainer`` trained padding-free: HF ``Trainer``'s patch with TRL's loss, metrics and model flags."""

    kind = "sft"

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        return keeps_methods(trainer, library_class(trainer, "trl", "SFTTrainer"))

    @classmethod
    def runs_trainer_collator(cls, trainer: Any) -> bool:
        return vision_collator(trainer) is not None

    def make_collator(self) -> TrainerCollator:
        processing = vision_collator(self.trainer)
        if processing is None:
            return super().make_collator()
        shares_prefixes(self.trainer, self.assembly, prompt_column=False, refusal=self.why_not_shared())
        return TrainerCollator(ExampleByExample(processing, self.assembly.collator))

    def why_not_shared(self) -> str | None:
        if vision_collator(self.trainer) is not None:
            return "image-text SFT rows are processed one by one at collate time, and not shared yet"
        return super().why_not_shared()

    def check(self) -> None:
        check_token_budget(self.trainer, self.assembly.config)
        note_trl_eval_packing(self.trainer)
        if self.splits_rows() and getattr(self.trainer, "aux_loss_enabled", False):
            raise ConfigError(
                f"SFTTrainer with the MoE router aux loss under sequence parallelism (sequence_parallel.size: "
                f"{sequence_parallel_size(self.assembly.config)}): TRL adds its load-balancing term after the rank "
                "scaling, which does not yet take each rank's share of its group's row (HF Trainer and the plain "
                "loop do). Set router_aux_loss_coef=0.0, train with HF Trainer, or sequence_parallel.size: 1")
        if vision_collator(self.trainer) is not None and getattr(self.assembly.collator, "media_keys", None) is None:
            raise PadfreeError(
                f"the SFTTrainer's dataset holds images (TRL's vision-language collator), but the "
                f"{self.assembly.plan.architecture.name} plugin packs text only: the packed batch would lose the "
                "pixels. Vision-language families are packed by their own plugins (padfree-plugins list: qwen2_vl, "
                "qwen2_5_vl …); to add one, see docs/writing-a-plugin.md")

    def labelled_logits(self) -> bool:
        return False  # TRL's fused LM head builds no logits for unlabelled positions anyway

    def model_kwargs(self, fused: bool) -> dict[str, Any]:
        """TRL's model flags: no cache, the fused LM head when no logits are needed, MoE router logits."""
        kwargs: dict[str, Any] = {"use_cache": False}
        if fused:
            kwargs["fused_lm_head"] = True
        if getattr(self.trainer, "aux_loss_enabled", False):
            kwargs["output_router_logits"] = True
        return kwargs

    def passes_num_items(self) -> bool:
        return True  # TRL's loss normalises by num_items_in_batch itself

    def loss_of(self, outputs: Any, inputs: Mapping, num_items_in_batch: Any) -> torch.Tensor:
        record_sft_metrics(self.trainer, outputs, inputs)
        if num_items_in_batch is None and self.splits_rows():
            # evaluation (TRL counts no items there), or a model without loss kwargs: a slice's own count would
            # weigh the group's slices unequally; the group's count times its size is the mean over the group's row
            # (as SequenceParallelForward does without a count), and the trainer's mean over ranks that row's loss
            group = self.assembly.forward.group
            count = outputs.label_mask.sum()
            torch.distributed.all_reduce(count, group=group.group)
            return sft_loss(self.trainer, outputs, count) * group.size
        return sft_loss(self.trainer, outputs, num_items_in_batch)

    def own_loss_and_outputs(self, model: Any, inputs: Mapping, kwargs: dict[str, Any],
                             num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
        loss, outputs = super().own_loss_and_outputs(model, inputs, kwargs, num_items_in_batch)
        with torch.no_grad():  # TRL records its metrics from a fused forward beside this loss, as here
            fused = self.assembly.forward(model, inputs, **self.model_kwargs(fused=True))
            record_sft_metrics(self.trainer, fused, inputs)
        return loss, outputs

    def add_aux_loss(self, loss: torch.Tensor, outputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        return loss + sft_aux_loss(self.trainer, outputs, num_items_in_batch)

    def evaluates_through_loss(self) -> bool:
        return True  # TRL's fused loss and metrics, as in training

    def eval_loss_and_outputs(self, model: Any, inputs: Mapping, num_items: Any) -> tuple[torch.Tensor, Any]:
        loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)
        if not uses_own_loss(self.trainer):
            # the fused LM head builds no logits: one more forward for them, as TRL itself does
            outputs = self.assembly.forward(model, {k: v for k, v in inputs.items() if k != "labels"},
                                            **self.model_kwargs(fused=False))
        return loss, outputs

    def counts_eval_items(self) -> bool:
        return False  # as TRL's prediction_step

    def metric_outputs(self, outputs: Any) -> Any:
        return [("logits", outputs["logits"])]  # TRL hands metrics the logits alone (no aux loss, router logits)


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``SFTTrainer``, and subclasses that keep its ``compute_loss`` and ``prediction_step``."""
    return SFTTrainerPatch.wrap(trainer, assembly)
