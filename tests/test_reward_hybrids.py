"""TRL ``RewardTrainer`` on hybrid reward models through ``accelerate()``: a Qwen3.5-shaped model (gated DeltaNet and
short-conv layers beside attention) with each pair's prompt shared, and Jamba (Mamba1 layers beside attention), whose
prompts are not shared (the reason said; ``prefix_sharing: on`` refused with it), give TRL's padded run.

* Every text of a pair is ``prompt + answer``; the model's head scores each at its last token. With
  ``prefix_sharing`` the prompt is held once in the packed row and each answer's mixers start from the prompt's state
  (its recurrent state and conv taps), so each score is the one the text has whole. Transformers' gated delta rule
  pads every run to 64-token chunks, and a prompt is shared only where that saves chunks
  (:func:`~padfree_plugins.packing.prefixes.prefix_tree`): the prompts begin with a system text of 70 tokens.
* The decays are slow (``A_log`` log(0.01), ``dt_bias`` -4): a state carried wrongly from the prompt shows.
* 8 SGD steps: every logged value (loss, grad norm, rewards, margin, token count) within 1e-4 of its scale, the
  accuracies up to the pairs whose margin rounding could flip. SGD, not AdamW: its first step normalises every
  gradient element, so elements of ~1e-7 that packed and padded compute with a relative difference of ~2e-6 move the
  weights by ±lr apart (measured: the grad norm of step 2 off by 3e-4 of its value under AdamW at lr 3e-3, while the
  first step's gradients agree to 4e-6 of each tensor's largest element). The gradients are checked directly too:
  every parameter's gradient of the first batch within 1e-4 of the tensor's largest element.
* A faulty shared row (each answer's mixers starting from zeros instead of its prompt's state) fails the comparison.
* Prompts shorter than a chunk stay in each text (sharing them would pad more chunks than the texts whole), and a
  warning says so.

No Mamba2 hybrid (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1) has a sequence-classification head in transformers
5.23, so none can be a RewardTrainer's model.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from contextlib import nullcontext

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from padfree_plugins import ConfigError, accelerate, patch_of
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY
from padfree_plugins.testing.faults import completions_start_from_zero
from tests.conftest import tiny_config
from tests.hybrids_common import HYBRIDS, slow
from tests.test_reward import assert_accuracies, logged, preference_rows, recording_pair_margins
from tests.test_trainer import tokenizer
from tests.ties import flip_shares

trl = pytest.importorskip("trl")

STEPS = 8
#: Each prompt's first words: 70 tokens, more than one 64-token chunk of the gated delta rule.
SYSTEM = " ".join(["a tiny corpus for the tokenizer"] * 14)
#: Model type: whether its pairs' prompts are shared.
CASES = {"qwen3_5_text": True, "jamba": False}
#: The values the comparison leaves out: what the schedule alone sets; the accuracy (a share of pairs, compared up to
#: its near-ties).
NOT_COMPARED = {"epoch", "learning_rate", "accuracy"}


@functools.lru_cache(maxsize=None)
def pairs(system: str) -> datasets.Dataset:
    """tests/test_reward.py's 40 pairs with prompts, each prompt after ``system``."""
    rows = preference_rows(40, 0, prompts=True)
    return datasets.Dataset.from_list([{**row, "prompt": f"{system}{row['prompt']}"} for row in rows])


def reward_trainer(model_type: str, packed: bool, sharing: str = "auto", system: str | None = None):
    """TRL's RewardTrainer on the tiny ``model_type`` hybrid (slow decays, weights of 0.1 spread as in
    tests/test_reward.py), SGD; accelerated when ``packed``. ``system``: the text before every prompt (by default
    :data:`SYSTEM` where prompts are shared, none for Jamba, whose Mamba1 scan, a python loop over tokens, then runs
    short texts)."""
    torch.manual_seed(0)
    tok = copy.deepcopy(tokenizer())
    config = tiny_config(model_type, **{**HYBRIDS[model_type], "num_labels": 1, "vocab_size": len(tok),
                                        "initializer_range": 0.1})
    model = slow(AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa"))
    args = trl.RewardConfig(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                            learning_rate=1e-2, optim="sgd", logging_steps=1, save_strategy="no", report_to="none",
                            seed=0, disable_tqdm=True, bf16=False, dataloader_pin_memory=False)
    system = (f"{SYSTEM} " if CASES[model_type] else "") if system is None else system
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=pairs(system), processing_class=tok)
    if packed:
        accelerate(trainer, {"prefix_sharing": sharing})
    return trainer


def run(model_type: str, packed: bool, fault=None) -> tuple[list[dict], int, list | None]:
    """The logged steps, the prompts the packed attention calls shared, and (padded) the accuracies' flip shares."""
    trainer = reward_trainer(model_type, packed)
    with recording_pair_margins(trainer.model) if not packed else nullcontext([]) as margins:
        with record_attention_calls() as calls, fault() if fault else nullcontext():
            trainer.train()
    shares = flip_shares(margins, len(margins) // STEPS) if not packed else None
    return logged(trainer), sum(call.shared_prompts for call in calls), shares


@functools.lru_cache(maxsize=None)
def padded(model_type: str) -> tuple[list[dict], int, list | None]:
    return run(model_type, False)


def off_values(got: list[dict], want: list[dict]) -> dict[str, float]:
    """Per logged value beyond 1e-4 of its scale (its largest magnitude over the reference): the worst difference."""
    assert len(got) == len(want) == STEPS
    off = {}
    for key in sorted({key for entry in want for key in entry} - NOT_COMPARED):
        scale = max(max(abs(entry[key]) for entry in want), 1e-2)
        worst = max(abs(g[key] - w[key]) for g, w in zip(got, want))
        if worst > 1e-4 * scale:
            off[key] = worst
    return off


def first_gradients(model_type: str, packed: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of TRL's loss on the first 4 pairs."""
    trainer = reward_trainer(model_type, packed)
    inputs = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    trainer.model.train()
    trainer.compute_loss(trainer.model, inputs).backward()
    return {name: parameter.grad for name, parameter in trainer.model.named_parameters()}



@pytest.mark.parametrize("model_type", CASES)
def test_reward_trainer_on_a_hybrid_trains_trls_padded_run(model_type):
    want, _, shares = padded(model_type)
    got, shared, _ = run(model_type, True)
    assert off_values(got, want) == {}
    assert_accuracies([g["accuracy"] for g in got], [w["accuracy"] for w in want], shares)
    losses = [entry["loss"] for entry in want]
    assert max(losses) - min(losses) > 1e-2, "the loss never moved: the comparison would prove little"
    if CASES[model_type]:
        assert shared >= STEPS * 4, "the pairs' prompts were not shared"  # 4 pairs a step, in each attention layer
    else:
        assert shared == 0
    want_grads, got_grads = first_gradients(model_type, False), first_gradients(model_type, True)
    assert want_grads.keys() == got_grads.keys()
    for name, want_grad in want_grads.items():
        assert want_grad is not None and got_grads[name] is not None, name
        torch.testing.assert_close(got_grads[name], want_grad, rtol=0, atol=1e-4 * float(want_grad.abs().max()),
                                   msg=lambda message, name=name: f"{name}: {message}")


def test_hybrid_reward_comparison_fails_when_answers_start_from_zero_state():
    """Each answer's mixers starting from zeros, not from its shared prompt's state: the rewards are off."""
    got, shared, _ = run("qwen3_5_text", True, completions_start_from_zero)
    assert shared
    off = off_values(got, padded("qwen3_5_text")[0])
    assert {"loss", "mean_reward", "margin"} & off.keys(), off


def test_prompts_shorter_than_a_chunk_stay_in_every_text_and_a_warning_says_so():
    """Prompts of 5-17 tokens on the gated-DeltaNet hybrid: held once, they and each answer would pad to a 64-token
    chunk each, more than the texts whole, so each text keeps its prompt (the chunk rule), and the collator says so
    rather than sharing nothing silently."""
    trainer = reward_trainer("qwen3_5_text", True, system="")
    assert trainer.data_collator.share_prefixes and trainer.data_collator.chunk == 64
    rows = [trainer.train_dataset[i] for i in range(4)]
    with pytest.warns(UserWarning, match="holds some common prefixes in every example, not once: its sequence mixers "
                                         "pad every segment to 64 tokens"):
        batch = trainer.data_collator(rows)
    assert SHARED_PREFIXES_KEY not in batch


def test_prefix_sharing_on_with_a_mamba1_hybrid_is_refused_with_the_reason():
    """Jamba's Mamba1 scan takes no initial state: ``on`` is a ConfigError saying so, the trainer left as it was."""
    trainer = reward_trainer("jamba", False)
    with pytest.raises(ConfigError, match="Mamba1 selective scan .* takes no initial SSM state"):
        accelerate(trainer, {"prefix_sharing": "on"})
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"
    assert patch_of(trainer.model) is None
