"""TRL's own multi-turn tool calling in GRPO (``GRPOTrainer(tools=[add])``) trained packed, prompts shared as a tree.

TRL runs the tool loop inside generation: a completion that calls a tool gets the tool's response appended (the chat
template's tool turn) and generation continues after it, once more per ``max_tool_calling_iterations``. Every
log-probability forward then holds ``prompt + completion``, the completion with its inner tool turns; TRL leaves the
tool-response tokens in the forward and drops them from the loss with its ``tool_mask`` (the model never sees it).
The prompts of later tool turns (``prompt + completion + tool response``) go to ``generate()`` only, which runs
padded as always, so the trie of a log-probability call shares prompt levels only: a completion's tokens predict
labels, and a tool turn inside it is never shared.

The setup:

* The tests' tokenizer with a chat template that renders tools (a ``tools:`` header, assistant tool calls as
  ``<call>{json}</call>``, ``tool:`` turns) and a response template that parses those calls (TRL's
  ``parse_response``, transformers' ``response_template``); ``add``, a deterministic calculator.
* Forced tool calls: a tiny random model never writes a JSON tool call, so each of the two calls used
  (``add(2, 3)``, ``add(4, 1)``) is one added token of the tokenizer whose text is the whole rendered call (the role
  markers are single tokens too: short tool turns), and TRL's ``generation_kwargs`` give ``generate()`` a
  ``sequence_bias``: the call tokens and EOS favoured (+2.5, +3.5: in every step completions call the tool, most end
  after a few tokens), EOS forced right after a call. A calling completion so ends its turn, the tool responds, and
  generation continues after the response (twice at most: ``max_tool_calling_iterations=2``); the learning rate
  (1e-3) takes the policy away from the reference model (kl > 0.05) within the 20 steps.
* 16 prompts of one token length (TRL left-pads prompts, and the padded forward counts pads in the positions:
  prompts share tokens at equal positions only): 2 episodes of a tool-using conversation (a question, a tool call,
  its response, an answer) under the tools header, each ending in 8 different 5-word user turns. Two completions per
  prompt, 8 rows per call: 4 prompts, two of them at least from one episode, so every call's trie is 3 levels deep
  (the header, an episode's history, a prompt) under its completions.

Against TRL's padded run (tests/test_trl_rl.py's comparison, 20 steps, ``prefix_sharing: on``): the same
completions (with their tool turns), every logged value — the tool-call frequency among them — within 1e-4 of its
scale, every fused forward packed and shared, every call's trie at least 3 levels deep; a branch that attends to its
sibling branch fails the comparison. Measured here: 40 fused calls, trees of depth 3 and 4, 90 completions with an
inner tool turn (780 tool-response tokens masked); the largest difference 0.7% of its tolerance (entropy 4.8e-7,
grad_norm 1.8e-7, kl 4e-8).
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import random
import shutil
import tempfile

import datasets
import pytest
import torch
from transformers import AddedToken

from padfree_plugins.testing.faults import branch_sees_a_sibling_branch
from tests import test_trl_rl
from tests.conftest import tiny_model

trl = pytest.importorskip("trl")

#: Tools in a ``tools:`` header, an assistant's tool calls as ``<call>{json}</call>``, each turn ended as TRL's tool
#: loop needs it (an assistant turn by EOS; prefix-preserving, so TRL keeps it for training).
CHAT_TEMPLATE = (
    "{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}assistant: {{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<call>{{ call.function | tojson }}</call>{% endfor %}</s>"
    "{%- else %}{{ message.role }}: {{ message.content }}{{ '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}")
#: How TRL parses a completion (transformers' ``response_template``): the tool calls' JSON, then the text to EOS.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "assistant: ",
    "fields": {"tool_calls": {"open": "<call>", "close_pattern": r"</call>\s*", "repeats": True, "content": "json",
                              "transform": {"type": "function", "function": "{content}"}},
               "content": {"close_pattern": r"</s>\s*", "content": "text"}}}
#: The tests' tokenizer padding on the left (tests/test_trl_rl.py's, which the runs here replace).
LEFT_PADDING_TOKENIZER = test_trl_rl.left_padding_tokenizer
#: The chat template's role markers, one token each (short tool turns).
ROLES = ("tools:", "user:", "assistant:", "tool:")
#: The calls the model can make, each one token.
CALLS = ((2, 3), (4, 1))
#: The logit bias of each tool call and of EOS in generation (:func:`forced_calls`).
CALL_BIAS, EOS_BIAS = 2.5, 3.5
#: Completions' tokens at most, tool turns included.
MAX_COMPLETION = 24
#: A larger step than tests/test_trl_rl.py's: the policy leaves the reference model (kl > 0.05) within the 20 steps.
LEARNING_RATE = 1e-3
#: Words of one token each after a space (the tests' tokenizer's).
WORDS = " tiny corpus for tokenizer a".split()


def add(a: int, b: int) -> int:
    """Adds two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def call_text(a: int, b: int) -> str:
    """The chat template's rendering of the call ``add(a, b)``."""
    return "<call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "</call>"


@functools.lru_cache(maxsize=1)
def _tool_tokenizer():
    tok = LEFT_PADDING_TOKENIZER()
    tok.add_tokens([AddedToken(token, normalized=False) for token in (*ROLES, *(call_text(a, b) for a, b in CALLS))])
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def tool_tokenizer():
    """A fresh copy (trainers mutate theirs) of the tests' left-padding tokenizer with the tool calls as tokens and
    the chat and response templates."""
    return copy.deepcopy(_tool_tokenizer())


@functools.lru_cache(maxsize=1)
def model_dir() -> str:
    """A tiny Llama with the tool tokenizer's vocabulary."""
    model = tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tool_tokenizer()))
    path = tempfile.mkdtemp(prefix="padfree-trl-tools-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


def forced_calls() -> dict:
    """The generation settings that make a random model call the tool: the call tokens and EOS favoured
    (``sequence_bias``: 0.25 to 1 tool calls per completion at each step here, most completions end after a few
    tokens), EOS forced right after a call (so the tool responds, and generation continues after its response)."""
    tok = tool_tokenizer()
    calls = tok.convert_tokens_to_ids([call_text(a, b) for a, b in CALLS])
    bias = [[[call], CALL_BIAS] for call in calls] + [[[call, tok.eos_token_id], 20.0] for call in calls]
    return {"sequence_bias": bias + [[[tok.eos_token_id], EOS_BIAS]]}


def text(rng: random.Random, count: int) -> str:
    return "a" + "".join(f" {rng.choice(WORDS)}" for _ in range(count))


@functools.lru_cache(maxsize=1)
def episodes() -> datasets.Dataset:
    """16 conversational prompts of one token length: 2 episodes (a question, a tool call and its response, an
    answer), each ending in 8 different 5-word user turns."""
    rng = random.Random(0)
    prompts = []
    for a, b in CALLS:
        history = [{"role": "user", "content": text(rng, 6)},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
                   {"role": "tool", "name": "add", "content": str(add(a, b))},
                   {"role": "assistant", "content": text(rng, 4)}]
        turns: set[str] = set()
        while len(turns) < 8:
            turns.add(text(rng, 5))
        prompts += [history + [{"role": "user", "content": turn}] for turn in sorted(turns)]
    return datasets.Dataset.from_list([{"prompt": prompt} for prompt in prompts])


def grpo(packed_calls: list | None, fault=None) -> tuple[test_trl_rl.Run, list[list[list[int]]]]:
    """20 GRPO steps with the tool (padded, or accelerated with ``prefix_sharing: on`` when ``packed_calls`` is a
    list); the run and, per generation, TRL's tool masks (0 at tool-response tokens)."""
    masks: list = []
    loop = trl.GRPOTrainer._tool_call_loop

    def recording_loop(self, *args, **kwargs):
        out = loop(self, *args, **kwargs)
        masks.append(copy.deepcopy(out[0]))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_trl_rl, "prompts", episodes)
        patch.setattr(test_trl_rl, "model_dir", model_dir)
        patch.setattr(test_trl_rl, "left_padding_tokenizer", tool_tokenizer)
        patch.setattr(trl.GRPOTrainer, "_tool_call_loop", recording_loop)
        run = test_trl_rl.train("grpo", packed_calls is not None, packed_calls, fault=fault,
                                config={"prefix_sharing": "on"}, tools=[add], loss_type="grpo",
                                num_generations=2, max_completion_length=MAX_COMPLETION, max_tool_calling_iterations=2,
                                generation_kwargs=forced_calls(), learning_rate=LEARNING_RATE)
    return run, masks


@functools.lru_cache(maxsize=1)
def grpo_padded() -> tuple[test_trl_rl.Run, list]:
    return grpo(None)


def test_grpo_with_tool_calls_shares_prompt_trees_and_trains_the_padded_run(packed_calls):
    want, masks = grpo_padded()
    got, got_masks = grpo(packed_calls)
    assert got_masks == masks
    # completions with inner tool turns: a tool response (masked) followed by more generated tokens
    inner = [mask for step in masks for mask in step if 0 in mask and mask[-1] == 1]
    assert len(inner) >= 20, f"only {len(inner)} completions hold an inner tool turn"
    calls = [entry["tools/call_frequency"] for entry in want.history]
    assert min(calls) > 0, f"steps without a tool call: {calls}"
    test_trl_rl.assert_same_run(got, want, "trl_grpo")
    assert got.calls.shared == got.calls.packed == want.fused_calls and not got.calls.padded, got.calls.describe()
    assert got.shared_depths and min(got.shared_depths) >= 3, sorted(set(got.shared_depths))


def test_grpo_tool_call_comparison_fails_on_a_branch_that_sees_its_sibling(packed_calls):
    got, _ = grpo(packed_calls, branch_sees_a_sibling_branch())
    assert "grad_norm" in test_trl_rl.beyond_tolerance(got, grpo_padded()[0])
