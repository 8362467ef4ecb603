"""TRL's GRPO and RLOO on hybrid policies with shared prompts: a Qwen3.5-shaped model (gated DeltaNet and short-conv
layers beside attention), a Bamba-shaped Mamba2 hybrid and LFM2 (short convolutions), trained through the
``trl_grpo`` / ``trl_rloo`` plugins with ``prefix_sharing: auto`` (the default), give TRL's padded run over 20 steps —
every logged value within 1e-4 of its scale, the same completions at every step — and every fused forward is packed
with its prompts shared; each completion's mixers start from its prompt's state (tests/test_hybrid_prefixes.py proves
one call exact per family). Each deliberate fault (a completion's mixers starting from zeros, continuing its
sibling's state, its conv taps reaching into its sibling) fails the comparison.

The setup is tests/test_trl_rl.py's (same prompts, reward, settings), with the tiny Llama swapped for the hybrid: its
decays slow (``A_log`` log(0.01), ``dt_bias`` -4), so that a state carried wrongly from a prompt shows, and its EOS
row of the LM head scaled so that completions end after 1…10 tokens."""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile

import pytest
import torch

from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.testing.faults import completions_continue_a_sibling, completions_start_from_zero, \
    conv_taps_reach_into_a_sibling
from tests import test_trl_rl
from tests.hybrids_common import hybrid_model
from tests.test_hybrid_lfm2 import model_of as lfm2_model
from tests.hybrids_common import slow

trl = pytest.importorskip("trl")


@functools.lru_cache(maxsize=None)
def hybrid_dir(model_type: str) -> str:
    """The tiny ``model_type`` hybrid, slow decays, EOS logit large often enough for completions of many lengths."""
    tok = test_trl_rl.left_padding_tokenizer()
    tokens = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id)
    model = lfm2_model(model_type, **tokens) if model_type.startswith("lfm2") else hybrid_model(model_type, **tokens)
    model = slow(model.float())
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 40
    path = tempfile.mkdtemp(prefix=f"padfree-trl-{model_type}-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


#: Families whose mixers pad every run to a chunk (64 tokens for transformers' gated delta rule, the config's
#: chunk_size for Mamba2): a prompt is shared only where that saves chunks (padfree_plugins.packing.prefixes.
#: prefix_tree), so their prompts begin with a long system text.
CHUNKED = {"qwen3_5_text", "bamba"}
SYSTEM = " ".join(["a tiny corpus for the tokenizer"] * 14)
SHORT_PROMPTS = test_trl_rl.prompts


@functools.lru_cache(maxsize=1)
def long_prompts():
    """tests/test_trl_rl.py's prompts after :data:`SYSTEM`: 70 tokens and more, each of another length."""
    return SHORT_PROMPTS().map(lambda row: {"prompt": f"{SYSTEM} {row['prompt']}"})


def use_model(patch: pytest.MonkeyPatch, model_type: str) -> None:
    patch.setattr(test_trl_rl, "model_dir", lambda: hybrid_dir(model_type))
    if model_type in CHUNKED:
        patch.setattr(test_trl_rl, "prompts", long_prompts)


@functools.lru_cache(maxsize=None)
def padded(model_type: str, kind: str) -> test_trl_rl.Run:
    with pytest.MonkeyPatch.context() as patch:
        use_model(patch, model_type)
        return test_trl_rl.train(kind, False, loss_type="grpo") if kind == "grpo" else test_trl_rl.train(kind, False)


def accelerated(model_type: str, kind: str, packed_calls: list, fault=None) -> test_trl_rl.Run:
    options = dict(loss_type="grpo") if kind == "grpo" else {}
    with pytest.MonkeyPatch.context() as patch:
        use_model(patch, model_type)
        return test_trl_rl.train(kind, True, packed_calls, fault=fault, **options)


#: A gated-DeltaNet hybrid, a Mamba2 hybrid, a short-conv hybrid.
MODELS = ["qwen3_5_text", "bamba", "lfm2"]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("model_type", MODELS)
def test_a_hybrid_shares_prompts_and_trains_the_padded_run(model_type, kind, packed_calls):
    want = padded(model_type, kind)
    got = accelerated(model_type, kind, packed_calls)
    # every fused forward packed, every attention call of it sharing prompts, the same completions, every logged
    # value within 1e-4 of its scale, and the padded run really trains
    test_trl_rl.assert_same_run(got, want, f"trl_{kind}")


@pytest.mark.parametrize("fault", [completions_start_from_zero, completions_continue_a_sibling,
                                   conv_taps_reach_into_a_sibling])
def test_grpo_on_a_hybrid_fails_on_a_wrong_state(fault, packed_calls):
    want = padded("qwen3_5_text", "grpo")
    got = accelerated("qwen3_5_text", "grpo", packed_calls, fault=fault())
    assert got.shared_prompts and all(got.shared_prompts)
    assert "grad_norm" in test_trl_rl.beyond_tolerance(got, want), "a wrong mixer state went unnoticed"


def dpo_run(accelerated: bool, fault=None) -> tuple[list[dict], list[int]]:
    """tests/test_trl_preference.py's 20 DPO steps (sigmoid loss, a reference model) with the Qwen3.5-shaped hybrid as
    the policy; its log history and, per packed attention call, the prompts its row shares."""
    from tests import test_trl_preference
    from tests.test_trainer import tokenizer

    def policy(dtype: torch.dtype = torch.float32):
        return slow(hybrid_model("qwen3_5_text", vocab_size=len(tokenizer()))).to(dtype).train()

    def long_pairs(count: int = 40):
        return original_pairs(count).map(lambda row: {"prompt": f"{SYSTEM} {row['prompt']}"})

    original_pairs = test_trl_preference.pairs
    with pytest.MonkeyPatch.context() as patch, fault or contextlib.nullcontext(), \
            record_attention_calls() as calls:
        patch.setattr(test_trl_preference, "policy", policy)
        patch.setattr(test_trl_preference, "pairs", long_pairs)
        history = test_trl_preference.run("dpo", accelerated)
    return history, [call.shared_prompts for call in calls]


@functools.lru_cache(maxsize=1)
def dpo_padded() -> list[dict]:
    return dpo_run(False)[0]


def test_dpo_on_a_qwen3_5_hybrid_shares_prompts_and_trains_the_padded_run():
    from tests.test_trl_preference import assert_same_run

    got, shared = dpo_run(True)
    assert shared and all(prompts >= 1 for prompts in shared), shared[:8]  # every packed call shares its prompts
    assert_same_run(got, dpo_padded())


def test_dpo_on_a_qwen3_5_hybrid_fails_when_completions_start_from_zero():
    from tests.test_trl_preference import assert_same_run

    got, shared = dpo_run(True, completions_start_from_zero())
    assert shared and all(shared)
    with pytest.raises(AssertionError, match="logged values off"):
        assert_same_run(got, dpo_padded())
