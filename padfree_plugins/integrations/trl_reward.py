"""The plugin for TRL ``RewardTrainer`` (and subclasses that keep its ``compute_loss`` and ``prediction_step``): the
chosen and rejected texts of a batch packed into one row, scored per text
by the model's sequence-classification head, and TRL's loss and metrics computed from those scores.

TRL's ``DataCollatorForPreference`` pads the chosen texts, then the rejected ones, into ``[2n, L]``;
:class:`PreferenceCollator` packs them in the same order, so ``logits[:n]`` are the chosen scores and ``logits[n:]``
the rejected ones, as there. :func:`preference_loss` is TRL's ``compute_loss`` on those scores: the Bradley-Terry
loss ``-logsigmoid(chosen - rejected [- margin])`` (plus ``center_rewards_coefficient``), and the metrics TRL logs
(``num_tokens``, min / mean / max reward, accuracy, margin) — ``num_tokens`` counts real tokens, as TRL's attention
mask does.

With ``prefix_sharing`` (on a decoder whose attention backend takes shared prefixes), the tokens a pair's texts
begin with (TRL writes ``prompt + chosen`` and ``prompt + rejected``) are computed once: a decoder reads them
causally, so each text's score is the one it has whole. What is shared stops before either text's scored token (its
last token that is not the pad id, as the model's head picks it), so that each text keeps it in its own segment. On a
hybrid each text's sequence mixers start from the prompt's state; a prompt is shared only where that saves the mixers'
chunks (:func:`~padfree_plugins.packing.prefixes.prefix_tree`), and a batch that keeps some in every text says so in a
warning.

Under ``sequence_parallel.size: N`` each rank's base model runs its slice of the group's joined row and each rank
scores its own texts from their hidden states, brought from the slices that computed them: the loss, TRL's metrics
and the scores ``prediction_step`` returns (what ``compute_metrics`` and ``predict`` get) are each rank's own texts',
as under data parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import BatchError, ConfigError
from padfree_plugins.integrations.base import TrainerPatch, keeps_methods, library_class
from padfree_plugins.integrations.checks import check_sequence_parallel, check_whole_rows_budget, shares_prefixes
from padfree_plugins.packing.collator import as_examples
from padfree_plugins.modeling.mixers import mixer_chunk
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, share_packed, shared_layout, tokens_saved

#: The token-id columns of a tokenized preference dataset, in the order TRL's collator stacks them.
PREFERENCE_COLUMNS = ("chosen_ids", "rejected_ids")
#: Keys of a shared batch: the segment that ends each text (``[2n]``, chosen first), and the texts' tokens whole.
TEXT_SEGMENTS_KEY, TEXT_TOKENS_KEY = "text_segments", "text_tokens"


def scored_token(text: list[int], pad_token_id: int | None) -> int:
    """The index of the token a decoder's head scores ``text`` by: its last that is not the pad id (its first when
    all are), as :func:`padfree_plugins.modeling.heads._last_not_pad`."""
    if pad_token_id is None:
        return len(text) - 1
    return next((i for i in range(len(text) - 1, -1, -1) if text[i] != pad_token_id), 0)


def shared_length(a: list[int], b: list[int], pad_token_id: int | None) -> int:
    """How many tokens a pair's texts ``a`` and ``b`` share: those both begin with, up to (not including) either
    text's scored token."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(common, scored_token(a, pad_token_id), scored_token(b, pad_token_id))


def pair_lengths(dataset: Any, share: bool, pad_token_id: int | None, chunk: int = 1) -> np.ndarray:
    """The tokens of every pair of a tokenized preference dataset as its packed row holds them at most: both texts,
    what they share once when ``share`` (and the sharing pays for the model's mixer ``chunk``: see
    :func:`~padfree_plugins.packing.prefixes.prefix_tree`)."""
    lengths = []
    for a, b in zip(*(dataset[key] for key in PREFERENCE_COLUMNS)):
        common = shared_length(a, b, pad_token_id) if share else 0
        prefixes = [(common, None)] * 2 if 0 < common < min(len(a), len(b)) else [None, None]
        lengths.append(len(a) + len(b) - tokens_saved(shared_layout([len(a), len(b)], prefixes, chunk)))
    return np.asarray(lengths, dtype=np.int64)


def pair_prefixes(batch: Mapping, pad_token_id: int | None) -> list[tuple[int, tuple] | None]:
    """What each text of a packed batch of ``n`` chosen then ``n`` rejected texts may share with its pair's other
    text (as :func:`padfree_plugins.packing.prefixes.shared_layout` takes it): the tokens both begin with, up to
    (not including) either text's scored token; ``None`` where that is nothing."""
    ids, cu = batch["input_ids"].reshape(-1).tolist(), batch["cu_seq_lens_q"].tolist()
    texts = [ids[start:end] for start, end in zip(cu, cu[1:])]
    pairs = len(texts) // 2
    prefixes: list[tuple[int, tuple] | None] = [None] * len(texts)
    for chosen, rejected in zip(range(pairs), range(pairs, 2 * pairs)):
        a, b = texts[chosen], texts[rejected]
        length = shared_length(a, b, pad_token_id)
        if length > 0:
            prefixes[chosen] = prefixes[rejected] = (length, tuple(a[:length]))
    return prefixes


@dataclass
class PreferenceCollator:
    """Rows ``{chosen_ids, rejected_ids[, margin]}`` -> one packed batch of every chosen text, then every rejected
    one (``collator``: the ``seq_cls`` task's), plus ``margin`` ``[n]`` when the rows carry one. ``share_prefixes``:
    the tokens a pair's texts begin with are held once (:func:`pair_prefixes`); the batch then says which segment
    ends each text (:data:`TEXT_SEGMENTS_KEY`) and how many tokens the texts hold whole (:data:`TEXT_TOKENS_KEY`)."""

    collator: Any
    share_prefixes: bool = False
    pad_token_id: int | None = None
    #: The chunk the model's sequence mixers pad each shared segment to (:func:`~padfree_plugins.modeling.mixers.
    #: mixer_chunk`).
    chunk: int = 1
    id_columns = PREFERENCE_COLUMNS  # what the dataset check reads (see padfree_plugins.packing.datacheck)

    @property
    def packing(self) -> Any:
        return getattr(self.collator, "packing", self.collator)

    def __call__(self, rows: list[Mapping[str, Any]]) -> dict[str, Any]:
        rows = as_examples(rows)
        missing = [key for key in PREFERENCE_COLUMNS if rows and key not in rows[0]]
        if missing:
            raise BatchError(f"preference rows need {' and '.join(PREFERENCE_COLUMNS)} (what RewardTrainer's dataset "
                             f"preparation writes); missing {', '.join(missing)}")
        batch = self.collator([{"input_ids": row[key]} for key in PREFERENCE_COLUMNS for row in rows])
        if self.share_prefixes:
            tokens = batch.num_tokens
            batch, ends = share_packed(batch, pair_prefixes(batch, self.pad_token_id), self.chunk)
            if SHARED_PREFIXES_KEY in batch:
                batch[TEXT_SEGMENTS_KEY], batch[TEXT_TOKENS_KEY] = torch.tensor(ends), tokens
        if "margin" in rows[0]:
            batch["margin"] = torch.tensor([row["margin"] for row in rows], dtype=torch.float)
        return batch


def text_scores(logits: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """Per-text scores ``[2n, 1]`` (chosen first) from the per-segment ones of a packed batch (a shared batch holds a
    segment for each shared prefix too)."""
    segments = inputs.get(TEXT_SEGMENTS_KEY)
    return logits if segments is None else logits.index_select(0, segments.to(logits.device))


def preference_loss(trainer: Any, logits: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """TRL's reward loss on per-text scores ``logits`` ``[2n, 1]`` (chosen first), with TRL's metrics recorded."""
    mode = "train" if trainer.model.training else "eval"
    chosen, rejected = torch.chunk(logits.squeeze(-1), chunks=2)
    margin = inputs.get("margin")
    difference = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(difference).mean()
    if trainer.args.center_rewards_coefficient is not None:
        loss = loss + trainer.args.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    accelerator, metrics = trainer.accelerator, trainer._metrics[mode]
    if mode == "train":
        tokens = torch.tensor(inputs.get(TEXT_TOKENS_KEY, inputs["input_ids"].shape[-1]), device=logits.device)
        trainer._total_train_tokens += accelerator.gather_for_metrics(tokens).sum().item() // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    with torch.no_grad():
        rewards = accelerator.gather(logits)
        metrics["min_reward"].append(rewards.min().item())
        metrics["mean_reward"].append(rewards.mean().item())
        metrics["max_reward"].append(rewards.max().item())
        accuracy = accelerator.gather_for_metrics((chosen > rejected).float().mean()).mean()
        metrics["accuracy"].append(accuracy.item())
        metrics["margin"].append(accelerator.gather_for_metrics((chosen - rejected).mean()).mean().item())
    return loss


class RewardTrainerPatch(TrainerPatch):
    """TRL ``RewardTrainer`` trained padding-free: every pair's texts packed into one row, TRL's loss and metrics
    from the per-text scores of the ``seq_cls`` head."""

    kind = "reward"
    sequence_parallel = True  # each rank scores its own texts (hidden states from the slices that computed them)
    gathers_logits = True  # prediction_step hands compute_metrics those scores: each rank's own texts'
    shares_prompts = True

    @classmethod
    def claims(cls, trainer: Any) -> bool:
        return keeps_methods(trainer, library_class(trainer, "trl", "RewardTrainer"))

    def make_collator(self) -> PreferenceCollator:
        """The pairs packed, sharing what each pair's texts begin with where ``prefix_sharing`` applies (a
        :class:`ConfigError` under ``on`` where it cannot, before anything changes)."""
        share = shares_prefixes(self.trainer, self.assembly, prompt_column=False)
        self.pairs = PreferenceCollator(self.assembly.collator, share,
                                        self.assembly.model.config.get_text_config().pad_token_id,
                                        mixer_chunk(self.assembly.model))
        return self.pairs

    def pair_lengths(self) -> np.ndarray:
        """Every training pair's tokens as its packed row holds them (:func:`pair_lengths`)."""
        return pair_lengths(self.trainer.train_dataset, self.pairs.share_prefixes, self.pairs.pad_token_id,
                            self.pairs.chunk)

    def check(self) -> None:
        """``batching.strategy: tokens``: every pair (never split) within the budget."""
        batching = self.assembly.config.batching
        if batching.strategy != "tokens":
            return
        check_whole_rows_budget(self.trainer, batching, self.pair_lengths, "pair")

    def planned_lengths(self) -> np.ndarray:
        """``batching.strategy: tokens``: every pair's tokens, for micro-batches of whole pairs up to the budget and
        for the checkpoints' batching plan."""
        return self.pair_lengths()

    def compute_loss(self, model: Any, inputs: Mapping, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """TRL's own loss and metrics on the per-text scores."""
        batch = {k: v for k, v in inputs.items() if k != "margin"}
        shared = batch.get(SHARED_PREFIXES_KEY)
        if shared is not None:
            batch[SHARED_PREFIXES_KEY] = shared.to(batch["input_ids"].device)
        with self.neftune_scope(inputs):
            outputs = self.assembly.forward(model, batch)
        outputs.logits = text_scores(outputs.logits, inputs)
        loss = preference_loss(self.trainer, outputs.logits, inputs)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model: Any, inputs: Mapping, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """As ``Trainer``'s own ``prediction_step`` on TRL's loss: the loss and every text's score."""
        trainer = self.trainer
        batch_as_given = inputs
        inputs = trainer._prepare_inputs(inputs)
        with torch.no_grad(), trainer.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return (loss.detach(), None, None)
        self.repad_metric_inputs(batch_as_given, whole_texts(inputs))
        # labels: the empty tuple of TRL's empty label_names, without which compute_metrics is never called
        return (loss.detach(), outputs.logits.detach(), ())


def whole_texts(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """The tokens and boundaries of a packed batch's texts whole (a shared batch's prefixes repeated in each text of
    their pair: what ``include_for_metrics=["inputs"]`` shows); any other batch as it is."""
    shared = inputs.get(SHARED_PREFIXES_KEY)
    if shared is None:
        return inputs
    index, bounds = shared.whole(inputs[TEXT_SEGMENTS_KEY].tolist())
    ids = inputs["input_ids"]
    longest = int(bounds.diff().max())
    return {"input_ids": ids.index_select(1, index.to(ids.device)), "cu_seq_lens_q": bounds.to(ids.device),
            "max_length_q": longest}


@hookimpl(trylast=True)
def trainer_config(trainer, config):
    """A RewardTrainer trains a sequence classifier: the task is ``seq_cls``."""
    if not RewardTrainerPatch.claims(trainer):
        return None
    # under sequence parallelism each rank scores its own texts, their hidden states brought from the slices
    check_sequence_parallel(trainer, config, gathers_logits=RewardTrainerPatch.gathers_logits)
    if config.task == "seq_cls":
        return None
    if config.task != "causal_lm":  # the default: a config that never named a task
        raise ConfigError(f"task: {config.task} in the config, but a RewardTrainer trains a sequence classifier: "
                          "set task: seq_cls, or leave task out")
    return dataclasses.replace(config, task="seq_cls")


@hookimpl(trylast=True)
def wrap_trainer(trainer, assembly, config):
    """TRL ``RewardTrainer``, and subclasses that keep its ``compute_loss`` and ``prediction_step``."""
    return RewardTrainerPatch.wrap(trainer, assembly)
