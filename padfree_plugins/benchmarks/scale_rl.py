"""The GRPO and DPO steps of ``bench scale`` (``--steps dpo,grpo``): one TRL trainer step's log-probability, loss and
backward work on a group of sequences totalling ``tokens`` real tokens, at SP = 1 (``ddp``) and SP = N.

Each variant is a TRL trainer of its own (``trl.DPOTrainer`` / ``trl.GRPOTrainer`` on the benchmark's model),
accelerated by :func:`~padfree_plugins.integrations.accelerate.accelerate` with ``prefix_sharing: off`` (every
sequence whole in the packed row, so that both variants compute the same ``tokens`` tokens) and, for ``sp<N>``,
``sequence_parallel: {size: N}``. A step is ``trainer.compute_loss(DDP(model), inputs)`` then ``backward()``: TRL's
own loss code on the per-token log-probabilities of TRL's fused head (:mod:`~padfree_plugins.integrations.trl_fused`),
no optimizer step.

* **DPO**: :data:`DPO_PAIRS` preference pairs (prompt + chosen, prompt + rejected: ``2 x pairs`` sequences), collated
  by TRL's own collator; the step includes the reference model's forward (no gradient), as TRL's does without
  ``precompute_ref_log_probs``. The policy is the reference plus a little noise
  (:func:`~padfree_plugins.benchmarks.preference.drifted`), or DPO's loss would be log 2 whatever the log-probabilities.
* **GRPO**: :data:`GRPO_GROUPS` groups of :data:`GRPO_GENERATIONS` completions after a prompt, laid out as
  ``_generate_and_score_completions`` returns them (prompts left-padded, completions right-padded, group-normalised
  advantages, ``num_items_in_batch`` over all ranks), TRL's defaults (``beta`` 0: no reference model; loss ``dapo``),
  ``old_per_token_logps`` fixed noise about ``log(1 / vocab)`` (the policy that generated, from which the trained
  one has drifted: without it the ratio is exactly 1 and the loss does not depend on the log-probabilities).

``ddp``: every rank computes the whole group (the same on every rank, as ``bench scale``'s ``ddp`` trains the same
row on every rank); ``sp<N>``: rank ``r`` holds the ``r``-th of N equal shares of the group's sequences (its
micro-batch, as under data parallelism) and the group's packed rows are joined into one row of ``tokens`` tokens, of
which each rank computes ``tokens / N``. The mean of the ranks' losses is the group's loss in both (TRL normalises
DPO per pair and GRPO's ``dapo`` by the completion tokens of all ranks), which the benchmark checks.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch

from padfree_plugins.errors import PadfreeError

RL_STEPS = ("dpo", "grpo")
DPO_PAIRS = 8
GRPO_GROUPS, GRPO_GENERATIONS = 2, 8
#: The tokenizer's pad and EOS ids (:func:`~padfree_plugins.benchmarks.preference.tokenizer`); token ids start above.
PAD, EOS, FIRST_TOKEN = 0, 2, 3
#: The policy's drift from DPO's reference model (× each weight's std).
DRIFT = 0.05


def sequences_of(step: str) -> int:
    """Sequences of the group (DPO: two per pair)."""
    return 2 * DPO_PAIRS if step == "dpo" else GRPO_GROUPS * GRPO_GENERATIONS


def check_world(step: str, world: int) -> None:
    units = DPO_PAIRS if step == "dpo" else GRPO_GROUPS * GRPO_GENERATIONS
    if units % world:
        raise PadfreeError(f"--steps {step}: the group's {units} {'pairs' if step == 'dpo' else 'completions'} "
                           f"must split evenly over --world {world}: use 2, 4 or 8 processes")


def _split(total: int, parts: int, generator: torch.Generator, low: int = 2) -> list[int]:
    """``total`` cut into ``parts`` lengths of at least ``low``, varied (a third to five thirds of the mean)."""
    weights = torch.empty(parts).uniform_(1 / 3, 5 / 3, generator=generator)
    lengths = [max(low, int(w)) for w in (weights / weights.sum() * total).tolist()]
    lengths[-1] += total - sum(lengths)
    if lengths[-1] < low:  # pragma: no cover - only for rows far below the minimum
        raise PadfreeError(f"--tokens {total} is too few for {parts} sequences")
    return lengths


def _ids(count: int, vocab: int, generator: torch.Generator) -> list[int]:
    return torch.randint(FIRST_TOKEN, vocab, (count,), generator=generator).tolist()


def dpo_pairs(tokens: int, vocab: int, seed: int) -> list[dict]:
    """:data:`DPO_PAIRS` tokenized pairs whose two sequences (prompt + chosen, prompt + rejected) hold ``tokens``
    tokens in all; a prompt about 30% of a pair's tokens, answers ending with EOS."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for budget in _split(tokens, DPO_PAIRS, generator, low=12):
        prompt = max(1, int(budget * 0.3 / 2))
        chosen, rejected = _split(budget - 2 * prompt, 2, generator)
        pairs.append({"prompt_ids": _ids(prompt, vocab, generator),
                      "chosen_ids": _ids(chosen - 1, vocab, generator) + [EOS],
                      "rejected_ids": _ids(rejected - 1, vocab, generator) + [EOS]})
    return pairs


def grpo_group(tokens: int, vocab: int, seed: int) -> list[dict]:
    """:data:`GRPO_GROUPS` groups of :data:`GRPO_GENERATIONS` sequences (a prompt about 40% of each, the group's
    prompt the same in each) holding ``tokens`` tokens in all: per sequence its prompt and completion ids, its
    advantage (rewards normalised in the group) and ``old`` log-probabilities of its completion tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for budget in _split(tokens, GRPO_GROUPS, generator, low=4 * GRPO_GENERATIONS):
        prompt = max(1, int(budget * 0.4 / GRPO_GENERATIONS))
        prompt_ids = _ids(prompt, vocab, generator)
        rewards = torch.randn(GRPO_GENERATIONS, generator=generator)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for completion, advantage in zip(_split(budget - GRPO_GENERATIONS * prompt, GRPO_GENERATIONS, generator),
                                         advantages.tolist()):
            old = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(completion, generator=generator)
            rows.append({"prompt_ids": prompt_ids, "completion_ids": _ids(completion - 1, vocab, generator) + [EOS],
                         "advantage": advantage, "old": old})
    return rows


def grpo_inputs(rows: list[dict], completion_tokens: int) -> dict[str, torch.Tensor]:
    """``rows`` as TRL's generation step hands them to ``compute_loss``; ``completion_tokens``: the completion
    tokens of the whole generation batch, over every rank (TRL's ``num_items_in_batch``)."""
    from trl.trainer.utils import pad

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.long)

    return {"prompt_ids": pad([torch.tensor(r["prompt_ids"]) for r in rows], PAD, "left"),
            "prompt_mask": pad([ones(len(r["prompt_ids"])) for r in rows], 0, "left"),
            "completion_ids": pad([torch.tensor(r["completion_ids"]) for r in rows], PAD, "right"),
            "completion_mask": pad([ones(len(r["completion_ids"])) for r in rows], 0, "right"),
            "advantages": torch.tensor([r["advantage"] for r in rows]),
            "old_per_token_logps": pad([r["old"] for r in rows], 0.0, "right"),
            "num_items_in_batch": torch.tensor(completion_tokens)}


def build_trainer(step: str, policy: torch.nn.Module, reference: torch.nn.Module | None, per_device: int,
                  output_dir: str) -> Any:
    """A TRL trainer of ``step`` on ``policy`` (DPO's reference model: ``reference``), ``per_device`` pairs or
    completions per rank."""
    import datasets
    import trl

    from padfree_plugins.benchmarks.preference import tokenizer

    common = dict(output_dir=output_dir, per_device_train_batch_size=per_device, report_to=[], bf16=False,
                  use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    if step == "dpo":
        args = trl.DPOConfig(**common, max_length=None, beta=0.1)
        pairs = datasets.Dataset.from_list([{"prompt": "a tiny", "chosen": " corpus", "rejected": " tokenizer"}] * 2)
        return trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=pairs,
                              processing_class=tokenizer())
    args = trl.GRPOConfig(**common, num_generations=GRPO_GENERATIONS, max_completion_length=256)
    prompts = datasets.Dataset.from_list([{"prompt": "a tiny"}] * GRPO_GENERATIONS)
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=prompts, processing_class=tokenizer())
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets: one micro-batch per optimizer step
    return trainer


class RLVariant:
    """One variant (``ddp`` or ``sp<N>``, see :mod:`padfree_plugins.benchmarks.scale`) of a DPO or GRPO step on
    this rank: the trainer built and accelerated, the rank's inputs, the model under DDP; the interface of
    :class:`~padfree_plugins.benchmarks.scale.Variant`."""

    def __init__(self, step: str, model: torch.nn.Module, variant: str, tokens: int, vocab: int, seed: int,
                 sequence_parallel: dict | None) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from padfree_plugins.benchmarks.preference import drifted
        from padfree_plugins.integrations.accelerate import accelerate

        self.name, self.variant = step, variant
        world, rank = dist.get_world_size(), dist.get_rank()
        units = dpo_pairs(tokens, vocab, seed) if step == "dpo" else grpo_group(tokens, vocab, seed)
        size = len(units) if sequence_parallel is None else len(units) // world  # the whole group, or a share
        mine = units if sequence_parallel is None else units[rank * size:(rank + 1) * size]
        reference = None
        if step == "dpo":
            reference, model = copy.deepcopy(model).eval(), drifted(model, DRIFT, seed)
        self.trainer = build_trainer(step, model, reference, len(mine), tempfile.mkdtemp(prefix="padfree-scale-"))
        config: dict[str, Any] = {"task": "causal_lm", "prefix_sharing": "off"}
        if sequence_parallel is not None:
            config["sequence_parallel"] = sequence_parallel
        self.acceleration = accelerate(self.trainer, config)
        if step == "dpo":
            self.inputs = dict(self.trainer.data_collator(mine))
        else:
            completions = sum(len(u["completion_ids"]) for u in units)
            # TRL's count spans the generation batch of every rank: under ddp every rank holds the whole group
            self.inputs = grpo_inputs(mine, completions * (world if sequence_parallel is None else 1))
        self.module = self.trainer.model
        self.wrapped = DistributedDataParallel(self.module)
        self.rows, self.tokens = (1, tokens) if sequence_parallel is not None else (world, world * tokens)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())

    def loss(self) -> torch.Tensor:
        """The forward: this rank's TRL loss (gradients cleared first)."""
        self.module.zero_grad(set_to_none=True)
        return self.trainer.compute_loss(self.wrapped, self.inputs)

    def step(self) -> None:
        self.loss().backward()

    def check_packed(self) -> None:
        """Raise unless every fused log-probability call so far ran on the packed row (split under SP): a call run
        padded would time TRL's padded forward under this variant's name."""
        calls = self.acceleration.trainer_patch.calls
        if calls.padded_total or not calls.packed:
            raise PadfreeError(f"bench scale, {self.name} step, {self.variant}: the fused log-probability calls did "
                               f"not all run packed ({calls.describe()})")
