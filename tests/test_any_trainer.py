"""Any ``transformers.Trainer`` (plugin ``any_trainer``): a subclass with its own ``compute_loss``, which no trainer
plugin knows, trains padding-free through ``unpad`` — its collator, loss and evaluation kept — with the padded curve,
left and right padding, gradient accumulation, LoRA; the padded forwards really are packed; refusals leave the
trainer as it was."""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from padfree_plugins import ConfigError, PadfreeError, PluginError, accelerate, patch_of
from padfree_plugins.modeling.unpad import UnpadPatch
from tests.conftest import tiny_config, tiny_model
from tests.test_trainer import STEPS, assert_same_curve, losses, rows, tokenizer

peft = pytest.importorskip("peft")


class SmoothedLossTrainer(Trainer):
    """A loss of one's own, as transformers' docs write one: the labels taken out of the batch, the model run on the
    rest, a label-smoothed cross-entropy with per-token weights computed from ``outputs.logits`` (shifted by one),
    normalised by ``num_items_in_batch`` (so gradient accumulation is exact)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits, target = outputs.logits[:, :-1].float(), labels[:, 1:]
        per_token = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, label_smoothing=0.1,
                                    reduction="none")
        weight = 1.0 + (target % 3 == 0).float()  # a weight per target token: some tokens count double
        count = (target != -100).sum() if num_items_in_batch is None else num_items_in_batch
        loss = (per_token * weight).sum() / count
        return (loss, outputs) if return_outputs else loss


def first_token_unlabelled(data: list[dict]) -> list[dict]:
    """Every example's first label -100, as collators and chat templates leave it (a left-padded row's first token
    would otherwise be predicted from a pad)."""
    return [{**row, "labels": [-100] + row["labels"][1:]} for row in data]


def smoothed_trainer(side: str = "right", *, lora: bool = False, data: list[dict] | None = None, **overrides):
    """The tiny Llama of tests/test_trainer.py in a :class:`SmoothedLossTrainer`, its collator padding on ``side``
    (a batch of 2, accumulation 2)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2), attn_implementation="sdpa")
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj", "gate_proj"]))
    padding = copy.deepcopy(tokenizer())
    padding.padding_side = side
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, per_device_eval_batch_size=5,
                    learning_rate=3e-3 if lora else 1e-3, logging_steps=1, save_strategy="no", report_to="none",
                    seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    settings.update(overrides)
    data = first_token_unlabelled(rows()) if data is None else data
    return SmoothedLossTrainer(model=model, args=TrainingArguments(**settings),
                               train_dataset=datasets.Dataset.from_list(data),
                               eval_dataset=datasets.Dataset.from_list(first_token_unlabelled(rows(13, seed=1))),
                               data_collator=DataCollatorForSeq2Seq(padding, padding=True, label_pad_token_id=-100))


def padded_curve(**options) -> tuple[list[float], float]:
    trainer = smoothed_trainer(**options)
    trainer.train()
    return losses(trainer), trainer.evaluate()["eval_loss"]


def forward_hooks(model) -> int:
    return sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules())


@pytest.mark.parametrize("side,lora", [("right", False), ("left", False), ("left", True)],
                         ids=["right", "left", "left-lora"])
def test_a_trainer_with_its_own_loss_trains_the_padded_curve(side, lora, packed_calls, caplog):
    """Every training forward packed inside the model; the loss curve and the evaluation loss are the padded ones;
    ``undo`` gives back the trainer's own methods and the unpatched model."""
    want, want_eval = padded_curve(side=side, lora=lora)
    assert packed_calls == []
    trainer = smoothed_trainer(side, lora=lora)
    methods, hooks = (trainer.compute_loss, trainer.prediction_step), forward_hooks(trainer.model)
    collator = trainer.data_collator
    with caplog.at_level(logging.WARNING, logger="padfree_plugins"):
        acceleration = accelerate(trainer, {"task": "causal_lm"})
    said = [r.getMessage() for r in caplog.records if "generic path" in r.getMessage()]
    assert len(said) == 1 and "SmoothedLossTrainer" in said[0] and "compute_loss" in said[0]
    assert acceleration.trainer_plugin == "any_trainer" and acceleration.trainer_patch.kind == "any"
    assert trainer.data_collator is collator  # the trainer's own, padding
    trainer.train()
    assert packed_calls == [True] * STEPS * 2, "every padded training forward (2 per step) must be packed"
    assert_same_curve(losses(trainer), want)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_eval, abs=1e-5)
    assert packed_calls == [True] * STEPS * 2, "unpad: auto leaves evaluation padded"
    acceleration.undo()
    assert (trainer.compute_loss, trainer.prediction_step) == methods
    assert not {"compute_loss", "prediction_step"} & set(vars(trainer))
    assert patch_of(trainer.model) is None and forward_hooks(trainer.model) == hooks


def test_a_left_padded_first_token_with_a_label_runs_padded(packed_calls, monkeypatch):
    """Left padding and examples whose first token has a label: padded, a pad's logits predict it. The batch's
    labels, which this trainer takes out before calling the model, are shown to unpad, so those calls run padded and
    the curve stays the padded one; without that it is not (the test can tell)."""
    data = rows()
    assert any(row["labels"][0] != -100 for row in data)
    want, _ = padded_curve(side="left", data=data)
    trainer = smoothed_trainer("left", data=data)
    accelerate(trainer, {"task": "causal_lm"})
    trainer.train()
    assert 0 < packed_calls.count(False) < packed_calls.count(True), "some calls packed, those with such rows not"
    assert_same_curve(losses(trainer), want)

    monkeypatch.setattr(UnpadPatch, "labels_for_loss", lambda self, labels: contextlib.nullcontext())
    unguarded = smoothed_trainer("left", data=data)
    accelerate(unguarded, {"task": "causal_lm"})
    unguarded.train()
    assert max(abs(a - b) for a, b in zip(losses(unguarded), want)) > 1e-3


def test_unpad_always_packs_evaluation_too(packed_calls):
    want_eval = smoothed_trainer().evaluate()["eval_loss"]
    trainer = smoothed_trainer()
    accelerate(trainer, {"task": "causal_lm", "unpad": "always"})
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_eval, abs=1e-5)
    assert packed_calls and all(packed_calls)


def test_the_specific_plugins_still_win():
    """A trainer that keeps transformers' compute_loss and prediction_step stays with hf_trainer (packed batches)."""
    trainer = Trainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")),
                      args=TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none"),
                      train_dataset=datasets.Dataset.from_list(rows(8)))
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert acceleration.trainer_plugin == "hf_trainer"
    acceleration.undo()


def assert_untouched(trainer, hooks: int) -> None:
    assert not {"compute_loss", "prediction_step"} & set(vars(trainer))
    assert isinstance(trainer.data_collator, DataCollatorForSeq2Seq)
    assert patch_of(trainer.model) is None and trainer.model.config._attn_implementation == "sdpa"
    assert forward_hooks(trainer.model) == hooks


@pytest.mark.parametrize("config,error,message", [
    ({"unpad": "off"}, ConfigError, "own compute_loss .*unpad: off"),
    ({"batching": {"strategy": "tokens", "max_tokens_per_batch": 256}}, ConfigError,
     "batching.strategy: tokens .*own collator .*pads"),
    ({"plugins": {"block": ["any_trainer"]}}, PluginError, "no plugin knows how to make SmoothedLossTrainer"),
], ids=["unpad-off", "token-budget", "blocked"])
def test_what_the_generic_path_cannot_do_is_refused_and_the_trainer_left_alone(config, error, message):
    trainer = smoothed_trainer()
    hooks = forward_hooks(trainer.model)
    with pytest.raises(error, match=message):
        accelerate(trainer, {"task": "causal_lm", **config})
    assert_untouched(trainer, hooks)


def test_neftune_is_refused():
    trainer = smoothed_trainer(neftune_noise_alpha=5.0)
    hooks = forward_hooks(trainer.model)
    with pytest.raises(PadfreeError, match="neftune_noise_alpha with SmoothedLossTrainer"):
        accelerate(trainer, {"task": "causal_lm"})
    assert_untouched(trainer, hooks)


def test_an_encoder_is_refused_unpad_packs_decoders_only():
    model = tiny_model("bert", "seq_cls", num_labels=2)
    trainer = SmoothedLossTrainer(model=model, args=TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none"),
                                  train_dataset=datasets.Dataset.from_list(rows(8)))
    with pytest.raises(PadfreeError, match="own compute_loss .*decoders only; BertForSequenceClassification is an "
                                           "encoder"):
        accelerate(trainer, {"task": "seq_cls"})
    assert "compute_loss" not in vars(trainer) and patch_of(model) is None


def test_trl_dpo_trains_the_padded_curve_through_the_generic_path(packed_calls):
    """TRL's ``DPOTrainer`` (its own ``compute_loss``: prompt + chosen and prompt + rejected, right-padded, through
    its fused LM head), with its own plugin blocked (``plugins: {block: [trl_dpo]}``), takes the generic path: 10 steps of sigmoid DPO with a reference model give the padded curve
    within 1e-4, every policy forward packed. (``bf16=False``: DPOConfig turns bf16 autocast on even on a CPU, and
    under it padded and packed differ by bf16 rounding, both sides alike.)"""
    import random

    trl = pytest.importorskip("trl")
    tok = tokenizer()
    rng = random.Random(0)
    words = "a tiny corpus for the tokenizer".split()

    def text(most):
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, most)))

    pairs = datasets.Dataset.from_list([{"prompt": text(12), "chosen": text(15), "rejected": text(15)}
                                        for _ in range(24)])

    def curve(accelerated):
        torch.manual_seed(0)
        model = tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tok)).train()
        with tempfile.TemporaryDirectory() as out:
            args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=4, max_steps=10, learning_rate=1e-3,
                                 logging_steps=1, report_to=[], seed=0, beta=0.1, save_strategy="no", use_cpu=True,
                                 bf16=False)
            trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                                     train_dataset=pairs, processing_class=copy.deepcopy(tok))
            config = {"task": "causal_lm", "plugins": {"block": ["trl_dpo"]}}
            acceleration = accelerate(trainer, config) if accelerated else None
            assert acceleration is None or acceleration.trainer_plugin == "any_trainer"
            trainer.train()
            if acceleration is not None:
                acceleration.undo()
        return losses(trainer)

    want = curve(False)
    packed_calls.clear()
    got = curve(True)
    assert len(got) == len(want) == 10 and packed_calls and all(packed_calls)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    assert max(want) - min(want) > 0.05, "the reference did not train: the comparison would prove little"


@pytest.mark.parametrize("lmbda", [0.0, 0.5])
def test_trl_gkd_trains_the_padded_curve_through_the_generic_path(lmbda, packed_calls):
    """TRL's ``GKDTrainer`` (experimental; on-policy distillation) needs the student's and the teacher's whole
    next-token distributions at every completion position, which TRL's fused head (log-probabilities of the labels)
    does not give, so it takes the generic path: the student's layers run packed, the LM head and the generalised JSD
    on the padded logits. 20 steps, off-policy (``lmbda`` 0) and half on-policy (student generations), give the padded
    run's loss and grad norm within 1e-4 relative."""
    import random

    gkd = pytest.importorskip("trl.experimental.gkd")
    from tests.test_trl_preference import assert_same_run, words

    tok = copy.deepcopy(tokenizer())
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    chats = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": question},
                                                      {"role": "assistant", "content": answer}]}
                                        for question, answer in zip(words(40, 5), words(40, 6))])

    def run(accelerated):
        student = tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tok)).train()
        teacher = tiny_model("llama", "causal_lm", num_key_value_heads=2, vocab_size=len(tok), seed=1)
        with tempfile.TemporaryDirectory() as out:
            args = gkd.GKDConfig(output_dir=out, per_device_train_batch_size=4, max_steps=20, learning_rate=1e-3,
                                 logging_steps=1, report_to=[], seed=0, save_strategy="no", use_cpu=True, bf16=False,
                                 lmbda=lmbda, max_new_tokens=8, disable_tqdm=True)
            trainer = gkd.GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=chats,
                                     processing_class=tok)
            acceleration = accelerate(trainer, {"task": "causal_lm"}) if accelerated else None
            assert acceleration is None or acceleration.trainer_plugin == "any_trainer"
            random.seed(0)  # GKD draws on- or off-policy per step from Python's generator
            trainer.train()
            if acceleration is not None:
                acceleration.undo()
        return trainer.state.log_history

    want = run(False)
    packed_calls.clear()
    got = run(True)
    assert packed_calls and all(packed_calls)
    assert_same_run(got, want)
