"""Prefix trees in TRL's trainers: multi-turn conversations whose rows share more than one prompt level.

* DPO on multi-turn conversations: each pair's prompt is an episode's conversation up to a turn (the previous
  turn's chosen answer included), every episode under one system text. Rows begin at column 0 in TRL's batches, so
  a micro-batch's pairs of one episode share its conversation up to the earlier turn, under the system text every
  pair shares: trees of depth 2 and 3.
* GRPO on turn-level prompts of multi-turn episodes: every prompt the same number of tokens (TRL left-pads prompts,
  and the padded forward counts pads in the positions: prompts share tokens at equal positions only), an episode's
  history shared by its turns, the system text by every episode, each prompt's completions under it.

Against TRL's padded run (tests/test_trl_preference.py's and tests/test_trl_rl.py's settings, 20 steps): every
logged value within 1e-4 of its scale, every packed forward shared and trees deeper than one level in many calls;
a branch that attends to its sibling branch fails each comparison.
"""

from __future__ import annotations

import contextlib
import functools
import random

import datasets
import pytest

from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.testing.faults import branch_sees_a_sibling_branch
from tests import test_trl_preference, test_trl_rl

trl = pytest.importorskip("trl")

#: Words of one token each after a space (the test tokenizer's): a text of ``a`` and ``n`` of them is ``n + 1``
#: tokens long.
WORDS = " tiny corpus for tokenizer a".split()


def text(rng: random.Random, count: int) -> str:
    return "".join(f" {rng.choice(WORDS)}" for _ in range(count))


@functools.lru_cache(maxsize=1)
def conversations() -> datasets.Dataset:
    """40 DPO pairs: 4 episodes of 10 turns under one system text; turn ``k``'s prompt is the episode up to its
    ``k``-th user message (earlier turns' chosen answers included)."""
    rng = random.Random(0)
    system = "a" + text(rng, 12)
    rows = []
    for _ in range(4):
        conversation = system
        for _ in range(10):
            conversation += text(rng, rng.randint(1, 4))  # the user's message
            chosen, rejected = text(rng, rng.randint(1, 5)), text(rng, rng.randint(1, 5))
            rows.append({"prompt": conversation, "chosen": chosen, "rejected": rejected})
            conversation += chosen
    return datasets.Dataset.from_list(rows)


def dpo(accelerated: bool, fault=None) -> tuple[list[dict], list[tuple[int, int]]]:
    """20 DPO steps on :func:`conversations` (a reference model, sigmoid loss); the log history and, per packed
    attention call, the prompts its row shares and its tree's depth."""
    with record_attention_calls() as calls, (fault or contextlib.nullcontext)():
        history = test_trl_preference.run("dpo", accelerated, dataset=conversations())
    return history, [(call.shared_prompts, call.shared_depth) for call in calls]


@functools.lru_cache(maxsize=1)
def dpo_padded() -> list[dict]:
    return dpo(False)[0]


def test_dpo_on_multi_turn_conversations_shares_trees_and_trains_the_padded_run():
    got, shared = dpo(True)
    test_trl_preference.assert_same_run(got, dpo_padded())
    assert shared and all(prompts >= 1 for prompts, _ in shared), shared[:8]
    deep = sum(depth >= 2 for _, depth in shared) / len(shared)
    assert deep > 0.5, f"only {deep:.0%} of the calls share more than one level"


def test_dpo_tree_comparison_fails_on_a_branch_that_sees_its_sibling():
    got, _ = dpo(True, branch_sees_a_sibling_branch)
    with pytest.raises(AssertionError, match="logged values off"):
        test_trl_preference.assert_same_run(got, dpo_padded())


@functools.lru_cache(maxsize=1)
def turn_prompts() -> datasets.Dataset:
    """16 GRPO prompts of 41 tokens each: 2 episodes' histories (20 words) under one system text (20 words), each
    ending in 8 different 5-word user turns."""
    rng = random.Random(7)  # completions of 5 lengths
    system = "a" + text(rng, 15)
    prompts = [system + history + text(rng, 5) for history in (text(rng, 20), text(rng, 20)) for _ in range(8)]
    return datasets.Dataset.from_list([{"prompt": prompt} for prompt in prompts])


def grpo(packed_calls: list | None, fault=None) -> test_trl_rl.Run:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_trl_rl, "prompts", turn_prompts)
        return test_trl_rl.train("grpo", packed_calls is not None, packed_calls, fault=fault, loss_type="grpo")


@functools.lru_cache(maxsize=1)
def grpo_padded() -> test_trl_rl.Run:
    return grpo(None)


def test_grpo_on_turn_level_prompts_shares_trees_and_trains_the_padded_run(packed_calls):
    got = grpo(packed_calls)
    test_trl_rl.assert_same_run(got, grpo_padded(), "trl_grpo")
    deep = sum(depth >= 2 for depth in got.shared_depths) / len(got.shared_depths)
    assert deep > 0.3, f"only {deep:.0%} of the calls share more than one level"


def test_grpo_tree_comparison_fails_on_a_branch_that_sees_its_sibling(packed_calls):
    got = grpo(packed_calls, branch_sees_a_sibling_branch())
    assert "grad_norm" in test_trl_rl.beyond_tolerance(got, grpo_padded())
