"""DPO and GRPO benchmarks: TRL's trainers padded vs padfree-plugins' generic path vs its native plugins, on the
same model, the same batches and the same weights, measured in one run.

Four variants, each a TRL trainer of its own (a copy of the same policy and reference model):

* ``padded``: TRL as it is (not accelerated): every log-probability forward on TRL's padded batch;
* ``generic``: ``accelerate(trainer, {"task": "causal_lm", "plugins": {"block": ["trl_dpo"]}})`` (``trl_grpo``):
  plugin ``any_trainer``, the padded batch packed inside the policy's body only (``unpad``), hidden states
  scattered back to the padded shape and TRL's fused head run at every padded position. The reference model is
  not the trainer's model, so this path leaves it as it is: DPO's reference forward runs padded;
* ``native``: ``accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "off"})`` (plugin ``trl_dpo`` /
  ``trl_grpo``): every fused log-probability forward, the policy's and DPO's reference's, on the packed row of
  real tokens, every example whole (prompts not shared)
  (:class:`~padfree_plugins.integrations.trl_fused.PackedFusedHead`), TRL's loss code unchanged;
* ``shared``: the same with ``prefix_sharing: on``: each pair's / group's prompt once in the packed row, its
  completions after it (:mod:`padfree_plugins.packing.prefixes`). Its ``vs native`` column is its real tokens/s over
  ``native``'s beside the ideal, the tokens ``native``'s policy computes over those ``shared``'s computes.

The prompts are a share of each sequence (``prompt_share``; by default 60% for DPO, 75% for GRPO with 8 completions
per prompt): their mean length is that share of a sequence whose answer has the answers' mean (the table's title
gives the share measured).

What is timed is the trainer step's log-probability, loss and backward work: ``trainer.compute_loss(model, inputs)``
then ``loss.backward()``, no optimizer step (every variant keeps the same weights, so losses and gradients can be
compared). DPO's ``compute_loss`` includes the reference model's forward (no ``precompute_ref_log_probs``).
GRPO's generation is not timed (it is the same padded ``model.generate`` in every variant, and a random model
would not stop where a length law says): its batches are built as ``_generate_and_score_completions`` returns
them — ``prompt_ids`` / ``prompt_mask`` left-padded and ``completion_ids`` / ``completion_mask`` right-padded with
TRL's own ``pad``, completions ending with EOS, group-normalised ``advantages``, ``num_items_in_batch`` and the
reference model's ``ref_per_token_logps`` (TRL's ``_get_per_token_logps_and_entropies``, padded, once per batch),
the same as ``old_per_token_logps`` (``num_iterations=2``: the policy that generated, from which the trained one
has drifted; without them the ratio is exactly 1 and the loss hardly depends on the log-probabilities), ``beta`` >
0 and the default loss type (``dapo``).

Lengths come from lognormal laws (:func:`~padfree_plugins.benchmarks.lengths.mixture_lengths`) chosen so that the
padded batch is about 60% padding: DPO pairs a prompt with a chosen and a rejected answer (TRL pads prompt +
chosen and prompt + rejected, ``2 × pairs`` rows, to the longest); GRPO repeats each prompt for its
``num_generations`` completions, whose lengths vary widely (clipped to ``max_completion_length``).

GRPO's ``tree`` law (``bench grpo --law tree``) builds multi-turn episodes instead (:func:`grpo_tree_batch`): one
per batch, its turn 1 under two alternatives at turn 2, each under two at turn 3, the batch's completions (turn 4)
spread over these four prompts. Rows share an episode's turns only at equal positions (TRL's padded forward counts
the left pads in its positions), so a turn's alternatives have equal lengths. ``shared`` then holds each common turn
once (the trie of the prompts, :func:`~padfree_plugins.packing.prefixes.prefix_tree`); its ideal is set beside the
one of sharing whole prompts only (depth 1, :func:`depth1_tokens`), and it is held to :data:`TREE_OF_IDEAL` of its
own.

Any supported decoder can stand in for the tiny Llama (``model_config``: a config.json, as ``bench sft``'s): hybrids
(gated DeltaNet, Mamba2) too, whose sequence mixers continue each shared prefix's state into its children; where
their torch kernels pad every run to a chunk, a prefix is shared only where it saves chunks, and the ideal is counted
on the rows the model actually computes. A config without experts (Granite-4.0-H's dense shape) gets
``router_aux_loss_coef = 0``: there is no router loss to count.

The policy is its reference plus a little noise (:func:`drifted`: ``drift`` × each weight's std), as a policy some
way into training: at the start, policy and reference are equal and DPO's loss is log 2 whatever the
log-probabilities, which would compare nothing.

Every variant runs one untimed step per batch first: it is the warm-up, the memory figure
(:func:`~padfree_plugins.benchmarks.measure.saved_activation_bytes`: the activations autograd keeps for backward,
the part padding inflates), the loss and gradient compared with ``padded``, and the packing check: a forward
pre-hook on the first decoder layer of the policy (and of DPO's reference) records the rows each forward ran on;
a ``generic`` or ``native`` policy forward that did not run on one packed row of the batch's real tokens stops the
benchmark (:class:`NotPacked`), so no row can be a padded run in disguise. Then ``rounds`` timed rounds, every
batch through every variant in an order that rotates each round; figures are medians over rounds, speedups taken
within a round before the median.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from padfree_plugins.benchmarks.lengths import Mixture, mixture_lengths
from padfree_plugins.benchmarks.measure import saved_activation_bytes, torch_threads
from padfree_plugins.benchmarks.sft import MODEL_SIZES, BenchSettings, build_model
from padfree_plugins.errors import PadfreeError

VARIANTS = ("padded", "generic", "native", "shared")
#: The TRL trainers benchmarked, by name: the builtin plugin that is blocked for the ``generic`` variant.
NATIVE_PLUGINS = {"dpo": "trl_dpo", "grpo": "trl_grpo"}
#: DPO: chosen and rejected token lengths; the prompts' median follows from the prompt share (:func:`prompt_law`).
DPO_ANSWERS: Mixture = ((1.0, 48, 0.9),)
#: GRPO: completion token lengths (16 completions, 8 per prompt); the prompts' as for DPO.
GRPO_COMPLETIONS: Mixture = ((1.0, 48, 1.0),)
#: The prompts' spread (lognormal sigma).
PROMPT_SIGMA = 0.6
#: The default share of each sequence that is prompt: DPO's preference sets, GRPO's long problems with short
#: completions.
PROMPT_SHARES = {"dpo": 0.6, "grpo": 0.75}
GRPO_GENERATIONS = 8
GRPO_MAX_COMPLETION = 256
#: The first ids of the tokenizer (:func:`tokenizer`): pad, bos, eos. Random token ids start above them.
PAD, EOS, FIRST_TOKEN = 0, 2, 3
#: The targets: real tokens/s over padded as a share of the ideal speedup, activation memory over padded,
#: loss difference from padded (relative and absolute).
TARGETS = {"of_ideal": 0.85, "memory_ratio": 0.5, "loss_diff": 1e-6}
#: The ``shared`` variant's targets: real tokens/s over ``native`` (at the default prompt shares), activation memory
#: at most this share of ``native``'s (:data:`SHARED_MEMORY`), the same loss difference.
SHARED_TARGETS = {"dpo": 1.3, "grpo": 2.4}
SHARED_MEMORY = {"dpo": 1.0, "grpo": 0.5}
#: GRPO's length laws: ``lognormal`` (each group of :data:`GRPO_GENERATIONS` completions under a prompt of its own),
#: ``tree`` (multi-turn episodes whose rollouts branch: :func:`grpo_tree_batch`).
GRPO_LAWS = ("lognormal", "tree")
#: The tree law's episodes: turn 1 (the history) then :data:`TREE_BRANCHES` alternatives at turns 2 and 3 each; the
#: prompts (turns 1-3) end where the rollouts' completions (turn 4) start.
TREE_BRANCHES = (2, 2)
#: The tree law's share of each prompt that is turn 1 (turns 2 and 3 split the rest).
TREE_HISTORY = 0.6
#: The tree law's target: ``shared`` at least this share of its ideal speed over ``native``.
TREE_OF_IDEAL = 0.85
#: At any other prompt share (a prompt-light run: little to share) sharing must cost nothing measurable: ``shared`` at
#: least this share of ``native``'s speed (the noise of interleaved rounds on a shared machine).
SHARED_FLOOR = 0.95


@dataclass
class PreferenceSettings:
    trainer: str = "dpo"  # dpo or grpo
    model_size: str = "tiny"  # a key of bench sft's MODEL_SIZES
    dtype: str = "float32"  # or float64: the body exact to ~1e-16 (TRL's fused head computes in float32 anyway)
    batch_size: int | None = None  # DPO: pairs (2 rows each), default 8; GRPO: completions, default 16
    batches: int = 3
    rounds: int = 3
    seed: int = 0
    threads: int | None = 1  # torch intra-op threads (None: torch's choice)
    drift: float = 0.05  # policy = reference + noise of this share of each weight's std
    beta: float | None = None  # None: DPO 0.1 (TRL's default), GRPO 0.04 (TRL's default, 0, has no KL term)
    prompt_share: float | None = None  # of each sequence's tokens; None: PROMPT_SHARES[trainer]
    model_config: str | None = None  # a config.json (any supported decoder, as bench sft's) instead of model_size
    law: str = "lognormal"  # GRPO: a key of GRPO_LAWS

    def model_name(self) -> str:
        return self.model_config or f"Llama {self.model_size}"

    def share(self) -> float:
        return PROMPT_SHARES[self.trainer] if self.prompt_share is None else self.prompt_share

    def rows_per_batch(self) -> int:
        return self.pairs_or_completions() * (2 if self.trainer == "dpo" else 1)

    def pairs_or_completions(self) -> int:
        return self.batch_size or (8 if self.trainer == "dpo" else 16)


@dataclass
class PreferenceRow:
    variant: str
    rows: int  # padded rows per batch
    real_tokens: int  # over all batches
    padding_fraction: float
    tokens_per_s: float
    step_ms: float
    memory_bytes: int
    loss: float  # the first batch's
    loss_rel_diff: float  # largest over the batches, vs padded
    loss_abs_diff: float
    grad_rel_diff: float  # largest ||grad - grad padded|| / ||grad padded|| over the batches
    packed: str  # which forwards ran on the packed row: "none", "policy", "policy + reference"
    speedup_vs_padded: float = 1.0
    ideal_speedup: float = 1.0
    of_ideal: float = float("nan")
    memory_ratio: float = 1.0
    tokens_computed: int = 0  # by the policy's first layer, over the batches' untimed steps
    speedup_vs_native: float = float("nan")  # shared only: real tokens/s over native's
    ideal_vs_native: float = float("nan")  # shared only: the tokens native computes / the tokens shared computes
    memory_vs_native: float = float("nan")
    shared_target: float = float("nan")  # shared only: the speedup over native to reach (SHARED_TARGETS; tree:
    # TREE_OF_IDEAL of its ideal)
    shared_memory_target: float = float("nan")  # shared only: the memory over native's to stay under
    depth1_vs_native: float = float("nan")  # shared only: the ideal of sharing each row's whole prompt only (depth 1)
    prompt_share: float = float("nan")  # of the padded run's real tokens (each prompt as often as it computes it)

    def targets(self) -> dict[str, bool]:
        """Whether this row meets each of :data:`TARGETS` (the ``padded`` row is the baseline: none); the
        ``shared`` row is held to :data:`SHARED_TARGETS` against ``native``."""
        if self.variant == "padded":
            return {}
        loss = max(self.loss_rel_diff, self.loss_abs_diff) <= TARGETS["loss_diff"]
        if self.variant == "shared":
            return {"vs native": self.speedup_vs_native >= self.shared_target,
                    "memory": self.memory_vs_native <= self.shared_memory_target, "loss": loss}
        return {"speed": self.of_ideal >= TARGETS["of_ideal"], "memory": self.memory_ratio <= TARGETS["memory_ratio"],
                "loss": loss}


@dataclass
class PreferenceResult:
    settings: PreferenceSettings
    rows: list[PreferenceRow]
    environment: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"settings": asdict(self.settings), "environment": self.environment, "targets": TARGETS,
                           "rows": [{**asdict(r), "targets met": r.targets()} for r in self.rows]}, indent=2)


def default_share(settings: PreferenceSettings) -> bool:
    return settings.prompt_share is None or settings.prompt_share == PROMPT_SHARES[settings.trainer]


def shared_target(settings: PreferenceSettings, ideal: float = math.nan) -> float:
    """The speed over ``native`` that ``shared`` must reach: :data:`SHARED_TARGETS` at the default prompt share,
    :data:`SHARED_FLOOR` at any other; the tree law: :data:`TREE_OF_IDEAL` of its ``ideal``."""
    if settings.law == "tree":
        return TREE_OF_IDEAL * ideal
    return SHARED_TARGETS[settings.trainer] if default_share(settings) else SHARED_FLOOR


def shared_memory_target(settings: PreferenceSettings) -> float:
    """The activation memory over ``native``'s that ``shared`` must stay under: :data:`SHARED_MEMORY` at the default
    prompt share, ``native``'s at any other (and on trees)."""
    return SHARED_MEMORY[settings.trainer] if default_share(settings) and settings.law != "tree" else 1.0


class NotPacked(PadfreeError):
    """A ``generic``, ``native`` or ``shared`` policy forward that did not run on the packed row (``shared``: that
    held no prompt once): its row would time padding (or time ``native``)."""


# -- models, trainers, batches -------------------------------------------------------------------------------------


def tokenizer() -> Any:
    """A small local tokenizer (pad 0, bos 1, eos 2): TRL's trainers want one; token ids are drawn at random."""
    from padfree_plugins.data.tokenizer import train_tokenizer

    return train_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=280)


def drifted(model: torch.nn.Module, drift: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` whose every weight moved by Gaussian noise of ``drift`` × its std (seeded)."""
    moved = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in moved.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * drift * (parameter.std() if parameter.numel() > 1 else 1.0))
    return moved


def random_ids(count: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random token ids above the tokenizer's special ones."""
    return torch.randint(FIRST_TOKEN, vocab, (count,), generator=generator)


def drawn_lengths(law: Mixture, count: int, seed: int, high: int) -> list[int]:
    """``count`` token lengths from ``law``, at least 2 (an answer holds a token and its EOS), at most ``high``."""
    return mixture_lengths(law, count, seed, 2, high)


def prompt_law(answers: Mixture, share: float) -> Mixture:
    """Prompt lengths whose mean is ``share`` of a sequence whose answer has the mean of ``answers`` (lognormal
    means: ``median · exp(sigma² / 2)``)."""
    (_, median, sigma), = answers
    mean = median * math.exp(sigma ** 2 / 2) * share / (1 - share)
    return ((1.0, max(1.0, mean / math.exp(PROMPT_SIGMA ** 2 / 2)), PROMPT_SIGMA),)


def dpo_examples(pairs: int, vocab: int, seed: int, high: int, share: float = PROMPT_SHARES["dpo"]) -> list[dict]:
    """Tokenized preference pairs as TRL's DPO dataset holds them; chosen and rejected end with EOS; prompts about
    ``share`` of each sequence."""
    generator = torch.Generator().manual_seed(seed)
    prompts = drawn_lengths(prompt_law(DPO_ANSWERS, share), pairs, seed, high // 2)
    chosen, rejected = (drawn_lengths(DPO_ANSWERS, pairs, seed + offset, high // 4) for offset in (1, 2))

    def answer(n: int) -> list[int]:
        return [*random_ids(n - 1, vocab, generator).tolist(), EOS]

    return [{"prompt_ids": random_ids(p, vocab, generator).tolist(), "chosen_ids": answer(c),
             "rejected_ids": answer(r)} for p, c, r in zip(prompts, chosen, rejected)]


def grpo_batch(completions: int, vocab: int, seed: int, high: int,
               share: float = PROMPT_SHARES["grpo"]) -> dict[str, torch.Tensor]:
    """A generated GRPO batch as ``_generate_and_score_completions`` returns it (without the reference
    log-probabilities, added by :func:`with_reference_logps`); prompts about ``share`` of each sequence."""
    from trl.trainer.utils import pad

    generator = torch.Generator().manual_seed(seed)
    groups = completions // GRPO_GENERATIONS
    prompt_lengths = [n for n in drawn_lengths(prompt_law(GRPO_COMPLETIONS, share), groups, seed,
                                               high - GRPO_MAX_COMPLETION)
                      for _ in range(GRPO_GENERATIONS)]
    prompt_of_group = [random_ids(n, vocab, generator) for n in prompt_lengths[::GRPO_GENERATIONS]]
    prompts = [ids for ids in prompt_of_group for _ in range(GRPO_GENERATIONS)]
    completion_lengths = drawn_lengths(GRPO_COMPLETIONS, completions, seed + 1, GRPO_MAX_COMPLETION)
    answers = [torch.cat([random_ids(n - 1, vocab, generator), torch.tensor([EOS])]) for n in completion_lengths]
    rewards = torch.randn(groups, GRPO_GENERATIONS, generator=generator)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    completion_mask = pad([torch.ones(n, dtype=torch.long) for n in completion_lengths], 0, "right")
    return {"prompt_ids": pad(prompts, PAD, "left"),
            "prompt_mask": pad([torch.ones(n, dtype=torch.long) for n in prompt_lengths], 0, "left"),
            "completion_ids": pad(answers, PAD, "right"), "completion_mask": completion_mask,
            "advantages": advantages.reshape(-1), "num_items_in_batch": completion_mask.sum()}


def grpo_tree_batch(completions: int, vocab: int, seed: int, high: int,
                    share: float = PROMPT_SHARES["grpo"]) -> dict[str, torch.Tensor]:
    """A generated GRPO batch of one multi-turn episode (:func:`grpo_batch`'s layout): turn 1 (its history, about
    :data:`TREE_HISTORY` of each prompt), then :data:`TREE_BRANCHES` alternatives at turn 2 and, under each, at turn
    3; each of the leaves (turns 1-3: a prompt) is followed by ``completions`` / leaves rollouts (turn 4), a group of
    its own. The alternatives of a turn have equal lengths, so every prompt has the same length: left-padded to none,
    the prompts' common turns stand at equal positions, as the trie (:func:`~padfree_plugins.packing.prefixes.
    prefix_tree`) shares them. Prompts are about ``share`` of each sequence."""
    from trl.trainer.utils import pad

    first, second = TREE_BRANCHES
    leaves = first * second
    if completions % leaves:
        raise PadfreeError(f"--law tree spreads each batch's completions over {leaves} prompts: give a multiple of "
                           f"{leaves}, not {completions}")
    generator = torch.Generator().manual_seed(seed)
    prompt, = drawn_lengths(prompt_law(GRPO_COMPLETIONS, share), 1, seed, high - GRPO_MAX_COMPLETION)
    prompt = max(prompt, 3)
    history = max(1, round(prompt * TREE_HISTORY))
    turn2 = max(1, (prompt - history) // 2)
    turn3 = max(1, prompt - history - turn2)
    root = random_ids(history, vocab, generator)
    prompts = []
    for _ in range(first):
        branch = random_ids(turn2, vocab, generator)
        prompts += [torch.cat([root, branch, random_ids(turn3, vocab, generator)]) for _ in range(second)]
    per_leaf = completions // leaves
    rows = [ids for ids in prompts for _ in range(per_leaf)]
    completion_lengths = drawn_lengths(GRPO_COMPLETIONS, completions, seed + 1, GRPO_MAX_COMPLETION)
    answers = [torch.cat([random_ids(n - 1, vocab, generator), torch.tensor([EOS])]) for n in completion_lengths]
    rewards = torch.randn(leaves, per_leaf, generator=generator)
    spread = rewards.std(1, keepdim=True) if per_leaf > 1 else torch.ones(leaves, 1)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (spread + 1e-4)
    completion_mask = pad([torch.ones(n, dtype=torch.long) for n in completion_lengths], 0, "right")
    return {"prompt_ids": torch.stack(rows), "prompt_mask": torch.ones(completions, len(rows[0]), dtype=torch.long),
            "completion_ids": pad(answers, PAD, "right"), "completion_mask": completion_mask,
            "advantages": advantages.reshape(-1), "num_items_in_batch": completion_mask.sum()}


def depth1_tokens(inputs: dict[str, torch.Tensor]) -> int:
    """The tokens a GRPO batch's policy forward computes when only whole prompts are shared (depth 1): each distinct
    prompt (tokens and positions) once, less its last token (which every row keeps, as it predicts the row's first
    completion token), then every row's last prompt token and completion."""
    groups: dict[tuple, int] = {}
    for ids, mask in zip(inputs["prompt_ids"].tolist(), inputs["prompt_mask"].tolist()):
        key = tuple((token, position) for position, (token, real) in enumerate(zip(ids, mask)) if real)
        groups[key] = groups.get(key, 0) + 1
    real = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    return real - sum((count - 1) * (len(key) - 1) for key, count in groups.items())


def with_reference_logps(trainer: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with ``ref_per_token_logps`` computed as TRL's generation step does (the reference model, padded),
    and the same as ``old_per_token_logps``: the policy that generated, which the trained one has drifted from."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.ref_model, input_ids, mask,
                                                           batch["completion_ids"].size(1))[0]
    return {**batch, "ref_per_token_logps": logps, "old_per_token_logps": logps}


def prompt_tokens_of(trainer_name: str, inputs: dict[str, torch.Tensor]) -> int:
    """The prompt tokens of the padded batch ``inputs``, each prompt counted in every row that holds it."""
    if trainer_name == "dpo":
        return int(inputs["attention_mask"].sum() - inputs["completion_mask"].sum())
    return int(inputs["prompt_mask"].sum())


def attention_mask_of(trainer_name: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The attention mask of the policy's forward on ``inputs``: its ones are the real tokens."""
    if trainer_name == "dpo":
        return inputs["attention_mask"]
    return torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)


def build_trainer(settings: PreferenceSettings, policy: torch.nn.Module, reference: torch.nn.Module,
                  reference_dir: str, output_dir: str) -> Any:
    """A TRL trainer (``settings.trainer``) on a copy of ``policy``; DPO's reference a copy of ``reference``, GRPO's
    loaded by TRL from ``reference_dir`` (where ``reference`` is saved)."""
    import datasets
    import trl

    model = copy.deepcopy(policy).train()
    common = dict(output_dir=output_dir, per_device_train_batch_size=settings.pairs_or_completions(), report_to=[],
                  bf16=False, use_cpu=True, save_strategy="no", seed=settings.seed)
    if settings.trainer == "dpo":
        args = trl.DPOConfig(**common, max_length=None, beta=0.1 if settings.beta is None else settings.beta)
        pairs = datasets.Dataset.from_list([{"prompt": "a tiny", "chosen": " corpus", "rejected": " tokenizer"}] * 2)
        return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(reference).eval(), args=args,
                              train_dataset=pairs, processing_class=tokenizer())
    model.config._name_or_path = reference_dir  # GRPO builds its reference model from the policy's path
    args = trl.GRPOConfig(**common, num_generations=GRPO_GENERATIONS, max_completion_length=GRPO_MAX_COMPLETION,
                          num_iterations=2, beta=0.04 if settings.beta is None else settings.beta)
    prompts = datasets.Dataset.from_list([{"prompt": "a tiny"}] * GRPO_GENERATIONS)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=prompts, processing_class=tokenizer())
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets: one micro-batch per optimizer step
    return trainer


def accelerate_variant(trainer: Any, variant: str, trainer_name: str) -> Any:
    """``trainer`` made ``variant`` (see the module docstring): the :class:`Acceleration`, or ``None`` for padded."""
    from padfree_plugins.integrations.accelerate import accelerate

    if variant == "padded":
        return None
    block = [NATIVE_PLUGINS[trainer_name]] if variant == "generic" else []
    # native: every example whole in the packed row; shared: each pair's / group's prompt once
    sharing = "on" if variant == "shared" else "off"
    return accelerate(trainer, {"task": "causal_lm", "plugins": {"block": block}, "prefix_sharing": sharing})


# -- measuring ------------------------------------------------------------------------------------------------------


def first_layer(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_decoder().layers[0]


@contextmanager
def rows_seen(model: torch.nn.Module | None) -> Iterator[list[tuple[int, int]]]:
    """The ``(rows, tokens per row)`` of the hidden states each forward of ``model``'s first decoder layer gets."""
    seen: list[tuple[int, int]] = []
    if model is None:
        yield seen
        return

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden.shape[0], hidden.shape[1]))

    handle = first_layer(model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def all_packed(seen: list[tuple[int, int]], real_tokens: int) -> bool:
    return bool(seen) and all(shape == (1, real_tokens) for shape in seen)


def all_shared(seen: list[tuple[int, int]], real_tokens: int) -> bool:
    """Every forward on one packed row that holds fewer tokens than the batch's real ones (its prompts once)."""
    return bool(seen) and all(rows == 1 and tokens < real_tokens for rows, tokens in seen)


def gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@dataclass
class Variant:
    """One variant's trainer, and what its untimed steps found."""

    name: str
    trainer: Any
    acceleration: Any
    seconds: list[float] = field(default_factory=list)  # per round, over all batches
    memory: int = 0
    losses: list[float] = field(default_factory=list)
    gradients: list[torch.Tensor] = field(default_factory=list)
    packed_policy: list[bool] = field(default_factory=list)
    packed_reference: list[bool] = field(default_factory=list)
    tokens_computed: int = 0  # by the policy's first layer in the untimed steps

    def loss(self, inputs: dict) -> torch.Tensor:
        return self.trainer.compute_loss(self.trainer.model, inputs)

    def timed_step(self, inputs: dict) -> float:
        self.trainer.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        self.loss(inputs).backward()
        return time.perf_counter() - start

    def checked_step(self, inputs: dict, real_tokens: int, reference: torch.nn.Module | None) -> None:
        """The untimed step: activation memory, loss, gradient, and whether the forwards ran packed."""
        model = self.trainer.model
        model.zero_grad(set_to_none=True)
        losses = []

        def step() -> torch.Tensor:
            losses.append(self.loss(inputs))
            return losses[-1]

        with rows_seen(model) as policy_rows, rows_seen(reference) as reference_rows:
            self.memory = max(self.memory, saved_activation_bytes(step))
        self.losses.append(float(losses[0].detach()))
        self.gradients.append(gradient(model))
        model.zero_grad(set_to_none=True)
        self.tokens_computed += sum(rows * tokens for rows, tokens in policy_rows)
        check = all_shared if self.name == "shared" else all_packed
        self.packed_policy.append(check(policy_rows, real_tokens))
        self.packed_reference.append(check(reference_rows, real_tokens))
        if self.name != "padded" and not self.packed_policy[-1]:
            held = "fewer than the batch's" if self.name == "shared" else "the batch's"
            raise NotPacked(f"a {self.name} policy forward did not run on one packed row of {held} {real_tokens} "
                            f"real tokens (its first layer saw rows x tokens {policy_rows}): the row would time a "
                            f"{'native' if self.name == 'shared' else 'padded'} run")

    def packed(self) -> str:
        if not all(self.packed_policy):
            return "none"
        return "policy + reference" if self.packed_reference and all(self.packed_reference) else "policy"


def run_preference_benchmark(settings: PreferenceSettings,
                             progress: Callable[[str], None] | None = None) -> PreferenceResult:
    """Measure the three variants of ``settings.trainer`` on the same batches; see the module docstring."""
    if settings.trainer not in NATIVE_PLUGINS:
        raise PadfreeError(f"unknown trainer {settings.trainer!r}; choose from {', '.join(NATIVE_PLUGINS)}")
    if settings.law not in GRPO_LAWS or (settings.law != "lognormal" and settings.trainer != "grpo"):
        raise PadfreeError(f"unknown length law {settings.law!r} for {settings.trainer}; choose from "
                           f"{', '.join(GRPO_LAWS if settings.trainer == 'grpo' else GRPO_LAWS[:1])}")
    if settings.model_config is None and settings.model_size not in MODEL_SIZES:
        raise PadfreeError(f"unknown model size {settings.model_size!r}; choose from {', '.join(MODEL_SIZES)}")
    if settings.dtype not in ("float32", "float64"):
        raise PadfreeError(f"--dtype must be float32 or float64 (on CPU), not {settings.dtype!r}")
    if settings.trainer == "grpo" and settings.pairs_or_completions() % GRPO_GENERATIONS:
        raise PadfreeError(f"--batch-size {settings.batch_size}: GRPO batches hold {GRPO_GENERATIONS} completions "
                           f"per prompt: give a multiple of {GRPO_GENERATIONS}")
    say = progress or (lambda _: None)
    with torch_threads(settings.threads), tempfile.TemporaryDirectory() as scratch:
        reference = build_model(BenchSettings(model_size=settings.model_size, seed=settings.seed,
                                              model_config=settings.model_config)).eval()
        if getattr(reference.config, "num_local_experts", None) == 0:  # no experts (Granite-4.0-H's dense shape):
            reference.config.router_aux_loss_coef = 0.0  # no router loss, which TRL would count (and sharing refuse)
        policy = drifted(reference, settings.drift, settings.seed + 1).train()
        for model in (reference, policy):  # float64: the float32 run's very weights, upcast
            model.to(getattr(torch, settings.dtype))
        reference.save_pretrained(Path(scratch) / "reference")
        variants = []
        say(f"{settings.trainer}: building the trainers ({', '.join(VARIANTS)})")
        try:
            for name in VARIANTS:
                trainer = build_trainer(settings, policy, reference, str(Path(scratch) / "reference"),
                                        str(Path(scratch) / name))
                variants.append(Variant(name, trainer, accelerate_variant(trainer, name, settings.trainer)))
            rows = _measure(settings, variants, policy.config, say)
        finally:
            for variant in variants:
                if variant.acceleration is not None:
                    variant.acceleration.undo()
    import transformers
    import trl

    environment = {"trainer": {"dpo": "trl.DPOTrainer", "grpo": "trl.GRPOTrainer"}[settings.trainer],
                   "model": f"{type(policy).__name__} {settings.model_config or settings.model_size}",
                   "torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                   "device": "cpu", "threads": settings.threads or torch.get_num_threads(),
                   "plugins": {v.name: (v.acceleration.describe()["wrapper"] if v.acceleration else "none")
                               for v in variants}}
    try:
        environment["load average (1, 5, 15 min)"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        pass
    return PreferenceResult(settings, rows, environment)


def _batches(settings: PreferenceSettings, variants: list[Variant], config: Any) -> list[dict]:
    vocab, high = config.vocab_size, config.max_position_embeddings
    batches = []
    for b in range(settings.batches):
        seed = settings.seed + 1000 * (b + 1)
        if settings.trainer == "dpo":
            collate = variants[0].trainer.data_collator  # TRL's own collator (no variant changes it)
            batches.append(dict(collate(dpo_examples(settings.pairs_or_completions(), vocab, seed, high,
                                                     settings.share()))))
        else:
            law = grpo_tree_batch if settings.law == "tree" else grpo_batch
            batch = law(settings.pairs_or_completions(), vocab, seed, high, settings.share())
            batches.append(with_reference_logps(variants[0].trainer, batch))
    return batches


def _measure(settings: PreferenceSettings, variants: list[Variant], config: Any,
             say: Callable[[str], None]) -> list[PreferenceRow]:
    return measure_batches(settings, variants, _batches(settings, variants, config), say)


def measure_batches(settings: PreferenceSettings, variants: list[Variant], batches: list[dict],
                    say: Callable[[str], None]) -> list[PreferenceRow]:
    """The untimed checked steps, then ``settings.rounds`` interleaved timed rounds of every variant on
    ``batches``; a row per variant (the first is the padded baseline, one is ``native``)."""
    masks = [attention_mask_of(settings.trainer, inputs) for inputs in batches]
    real = [int(mask.sum()) for mask in masks]
    padding = 1 - sum(real) / sum(mask.numel() for mask in masks)
    for variant in variants:  # the untimed steps: warm-up, memory, loss, gradient, packing
        say(f"{settings.trainer} {variant.name}: untimed steps (warm-up, memory, loss and gradient checks)")
        reference = getattr(variant.trainer, "ref_model", None) if settings.trainer == "dpo" else None
        for inputs, tokens in zip(batches, real):
            variant.checked_step(inputs, tokens, reference)
    for r in range(settings.rounds):
        shift = r % len(variants)
        order = variants[shift:] + variants[:shift]
        spent = {v.name: 0.0 for v in variants}
        for inputs in batches:
            for variant in order:
                spent[variant.name] += variant.timed_step(inputs)
        for variant in variants:
            variant.seconds.append(spent[variant.name])
        say(f"{settings.trainer} round {r + 1}/{settings.rounds}: "
            + ", ".join(f"{name} {sum(real) / seconds:,.0f} tok/s" for name, seconds in spent.items()))
    padded = variants[0]
    native = next(variant for variant in variants if variant.name == "native")
    ideal = 1 / (1 - padding)
    prompt_share = sum(prompt_tokens_of(settings.trainer, inputs) for inputs in batches) / sum(real)
    rows = []
    for variant in variants:
        shared = {}
        if variant.name == "shared":
            ideal_shared = native.tokens_computed / variant.tokens_computed
            depth1 = (native.tokens_computed / sum(map(depth1_tokens, batches)) if settings.trainer == "grpo"
                      else math.nan)
            shared = dict(
                speedup_vs_native=statistics.median(n / t for n, t in zip(native.seconds, variant.seconds)),
                ideal_vs_native=ideal_shared, memory_vs_native=variant.memory / native.memory,
                shared_target=shared_target(settings, ideal_shared),
                shared_memory_target=shared_memory_target(settings), depth1_vs_native=depth1)
        speedup = statistics.median(p / t for p, t in zip(padded.seconds, variant.seconds))
        median = statistics.median(variant.seconds)
        rows.append(PreferenceRow(
            variant=variant.name, rows=masks[0].shape[0], real_tokens=sum(real), padding_fraction=padding,
            tokens_per_s=sum(real) / median, step_ms=median / len(batches) * 1e3, memory_bytes=variant.memory,
            loss=variant.losses[0],
            loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(variant.losses, padded.losses)),
            loss_abs_diff=max(abs(a - b) for a, b in zip(variant.losses, padded.losses)),
            grad_rel_diff=max(float((g - p).norm() / p.norm()) for g, p in zip(variant.gradients, padded.gradients)),
            packed=variant.packed(), speedup_vs_padded=speedup, ideal_speedup=ideal,
            of_ideal=speedup / ideal if variant is not padded else math.nan,
            memory_ratio=variant.memory / padded.memory, tokens_computed=variant.tokens_computed,
            prompt_share=prompt_share, **shared))
    return rows


# -- output ---------------------------------------------------------------------------------------------------------

#: The table's columns, and each row's cell in them.
COLUMNS: dict[str, Callable[[PreferenceRow], str]] = {
    "variant": lambda r: r.variant,
    "padding": lambda r: f"{r.padding_fraction:.0%}",
    "real tok/s": lambda r: f"{r.tokens_per_s:,.0f}",
    "step ms": lambda r: f"{r.step_ms:,.0f}",
    "loss": lambda r: f"{r.loss:.4f}",
    "vs padded": lambda r: f"{r.speedup_vs_padded:.2f}x",
    "of ideal": lambda r: "-" if r.variant == "padded" else f"{r.of_ideal:.0%} of {r.ideal_speedup:.2f}x",
    "vs native": lambda r: (f"{r.speedup_vs_native:.2f}x (ideal {r.ideal_vs_native:.2f}x"
                            + (f", depth 1 {r.depth1_vs_native:.2f}x" if r.depth1_vs_native == r.depth1_vs_native
                               else "") + f"; target {r.shared_target:.2f}x)"
                            if r.variant == "shared" else "-"),
    "memory vs native": lambda r: (f"{r.memory_vs_native:.2f}x (target {r.shared_memory_target:g}x)"
                                   if r.variant == "shared" else "-"),
    "activation MiB": lambda r: f"{r.memory_bytes / 2**20:,.1f}",
    "memory vs padded": lambda r: f"{r.memory_ratio:.2f}x",
    "loss rel. diff": lambda r: f"{r.loss_rel_diff:.1e}",
    "loss abs. diff": lambda r: f"{r.loss_abs_diff:.1e}",
    "grad rel. diff": lambda r: f"{r.grad_rel_diff:.1e}",
    "packed forwards": lambda r: r.packed,
    "targets met": lambda r: ", ".join(f"{k} {'yes' if ok else 'no'}" for k, ok in r.targets().items()) or "-",
}


def cells(row: PreferenceRow) -> list[str]:
    return [cell(row) for cell in COLUMNS.values()]


def title(result: PreferenceResult) -> str:
    s = result.settings
    per_prompt = (s.pairs_or_completions() // math.prod(TREE_BRANCHES) if s.law == "tree" else GRPO_GENERATIONS)
    unit = "pairs" if s.trainer == "dpo" else f"completions ({per_prompt} per prompt)"
    law = f", {TREE_BRANCHES[0]}x{TREE_BRANCHES[1]}-branch episode trees" if s.law == "tree" else ""
    return (f"{result.environment['trainer']} compute_loss + backward, {s.model_name()}, {s.dtype} cpu{law}, "
            f"{s.pairs_or_completions()} {unit} = {s.rows_per_batch()} padded rows, {s.batches} batches x "
            f"{s.rounds} interleaved rounds, prompts {result.rows[0].prompt_share:.0%} of the tokens: real tokens/s "
            "(the padded run's real tokens, each prompt counted as often as it computes it, for every variant), "
            "medians")


def markdown(result: PreferenceResult) -> str:
    lines = [f"| {' | '.join(COLUMNS)} |", f"|{' --- |' * len(COLUMNS)}"]
    lines += [f"| {' | '.join(cells(row))} |" for row in result.rows]
    return "\n".join([f"{title(result)}\n", *lines, "", f"environment: {json.dumps(result.environment)}", ""])


def write_outputs(result: PreferenceResult, out: Path) -> dict[str, Path]:
    """``bench_<trainer>.json`` and ``bench_<trainer>.md`` (the table) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{result.settings.trainer}"
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(result.to_json())
    paths["markdown"].write_text(markdown(result))
    return paths
