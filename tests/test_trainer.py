"""``accelerate(trainer)``: HF Trainer and TRL SFTTrainer train padding-free with the loss curve of padded training.

Every comparison runs the same tiny model (same seed, same data order, dropout 0) twice: padded with the trainer's
usual path, and padding-free after ``accelerate``. Datasets carry -100 prompt masks (completion-only loss) and an
extra string column, and ``remove_unused_columns`` stays at its default.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import tempfile

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from padfree_plugins import BatchError, ConfigError, PadfreeError, PluginError, accelerate, patch_of
from padfree_plugins.data.tokenizer import train_tokenizer
from padfree_plugins.integrations.base import TrainerCollator
from padfree_plugins.integrations.resume import FINGERPRINT_FILE
from padfree_plugins.modeling.neftune import PackedNeftune
from padfree_plugins.packing.collator import split_packed_row
from padfree_plugins.packing.labelled_logits import HELD_KEY
from padfree_plugins.testing.undo import assert_state_restored, model_state
from tests.conftest import tiny_config
from tests.hybrids_common import HYBRIDS, hybrid_model
from tests.test_decoders import DECODERS, causal_lm
from tests.ties import (allowed_flips, assert_same_greedy, excess_over_flips, flip_shares, greedy, label_margins,
                        recording_token_margins)

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")



STEPS = 30
#: Steps of the per-architecture curves (every decoder, every hybrid: ~110 runs): the trainer wiring each family
#: goes through is the same from the first step, a leak shows in the first step's loss, and the families' packed
#: logits are compared per example in tests/test_decoders.py / test_hybrids.py; 8 steps (32 micro-batches with
#: accumulation 4) still move the loss well past the comparison's tolerance.
CURVE_STEPS = 8


def rows(n: int = 64, seed: int = 0, longest: int = 60) -> list[dict]:
    """Random examples of 2..longest tokens; a random prefix of each is a prompt (labels -100)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, longest, (1,), generator=generator))
        ids = torch.randint(5, 128, (length,), generator=generator).tolist()
        prompt = int(torch.randint(0, length // 2 + 1, (1,), generator=generator))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "source": "synthetic"})
    return out


@functools.lru_cache(maxsize=1)
def _trained_tokenizer():
    return train_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=280)


def tokenizer():
    """A fresh copy of the tests' tokenizer: trainers mutate theirs (TRL's ``eos_token`` sets it), and a shared one
    would carry that into whichever test runs next in the same worker."""
    return copy.deepcopy(_trained_tokenizer())


def padded_collator():
    """The padded reference for HF Trainer: right padding, attention mask, -100 labels on padding."""
    return DataCollatorForSeq2Seq(tokenizer(), padding=True, label_pad_token_id=-100)


#: PEFT refuses LoRA on the Mamba mixers' ``out_proj`` of these model types (mamba-ssm's fused CUDA path reads its
#: weight directly, past any adapter), so "all-linear" leaves it out there.
PEFT_REFUSES_OUT_PROJ = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}


def make_trainer(kind: str, packed: bool, *, lora: bool = False, train=None, architecture: str = "",
                 **overrides):
    """A tiny Llama (or ``architecture``, a key of test_decoders.DECODERS or a model type of
    hybrids_common.HYBRIDS) in an HF Trainer or a TRL SFTTrainer."""
    torch.manual_seed(0)
    if architecture in HYBRIDS:
        model = hybrid_model(architecture)
    elif architecture:
        model_type, config = DECODERS[architecture]
        model = causal_lm(model_type, **config)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2),
                                                 attn_implementation="sdpa")
    if lora:
        targets = "all-linear" if architecture else ["q_proj", "v_proj", "gate_proj"]
        excluded = ["out_proj"] if architecture in PEFT_REFUSES_OUT_PROJ else None
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=targets, exclude_modules=excluded))
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                    per_device_eval_batch_size=5, learning_rate=3e-3 if lora else 1e-3, logging_steps=1,
                    save_strategy="no", report_to="none", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    settings.update(overrides)
    train = datasets.Dataset.from_list(rows()) if train is None else train
    evaluation = datasets.Dataset.from_list(rows(13, seed=1))
    if kind == "sft":
        args = trl.SFTConfig(**{"bf16": False, **settings})
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                 processing_class=tokenizer())
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=train,
                          eval_dataset=evaluation, data_collator=padded_collator())
    acceleration = accelerate(trainer, {"task": "causal_lm"}) if packed else None
    return trainer, acceleration


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@functools.lru_cache(maxsize=None)
def padded_run(kind: str, lora: bool = False, accumulation: int = 1) -> tuple[list[float], float]:
    trainer, _ = make_trainer(kind, packed=False, lora=lora, gradient_accumulation_steps=accumulation,
                              per_device_train_batch_size=2 if accumulation > 1 else 4)
    trainer.train()
    return losses(trainer), trainer.evaluate()["eval_loss"]


def assert_same_curve(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    assert want[-1] < want[0] - 0.05, "the reference did not train: the comparison would prove little"


CURVES = {f"{kind}-{variant}": (kind, accumulation, lora) for kind in ("hf", "sft")
          for variant, accumulation, lora in (("full", 1, False), ("accumulation4", 4, False), ("lora", 1, True))}


@pytest.mark.parametrize("kind,accumulation,lora", CURVES.values(), ids=CURVES.keys())
def test_loss_curve_equals_padded(kind, accumulation, lora):
    want, want_eval = padded_run(kind, lora, accumulation)
    trainer, acceleration = make_trainer(kind, packed=True, lora=lora, gradient_accumulation_steps=accumulation,
                                         per_device_train_batch_size=2 if accumulation > 1 else 4)
    assert acceleration.trainer_patch.kind == kind
    trainer.train()
    assert_same_curve(losses(trainer), want)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_eval, abs=1e-5)


#: TRL's own SFT loss reads ``config.num_experts``, which GraniteMoe names ``num_local_experts``: TRL's padded run
#: fails with an AttributeError before any packing is involved (TRL's bug, not one padfree can fix).
TRL_FAILS_PADDED = {"granitemoe"}
#: Tiny models whose AdamW training amplifies float rounding, so that a curve comparison under AdamW says nothing
#: about packing: for the tiny Gemma 4 (test_decoders.DECODERS), two *padded* HF Trainer runs that differ only in
#: padding (``pad_to_multiple_of=16``) split by 2e-2 within 30 steps (3e-3 at lr 3e-4; 9e-3 without its MoE block,
#: 5e-3 / 1e-2 without KV sharing / k=v global layers as well), where the tiny Gemma 3n and Llama stay within 1e-6.
#: Under SGD two padded runs, and padded and packed, agree within 1e-6 over the 30 steps; the loss moves by ~0.07.
SGD_CURVES = {"gemma4"}
ARCHITECTURE_CURVES = [(name, "hf", 4, False) for name in DECODERS] + \
    [(name, "sft", 1, True) for name in DECODERS if name not in TRL_FAILS_PADDED]


def assert_trains_the_padded_curve(architecture: str, kind: str, accumulation: int, lora: bool, **overrides) -> None:
    """:data:`CURVE_STEPS` steps of ``architecture`` padded (right padding), then packed: the loss curves within
    1e-4 (AdamW; SGD for the models of SGD_CURVES)."""
    curves = []
    overrides = {"max_steps": CURVE_STEPS, **overrides}
    for packed in (False, True):
        trainer, _ = make_trainer(kind, packed, lora=lora, architecture=architecture,
                                  gradient_accumulation_steps=accumulation, learning_rate=3e-3 if lora else 1e-3,
                                  per_device_train_batch_size=2 if accumulation > 1 else 4,
                                  **({"optim": "sgd"} if architecture in SGD_CURVES else {}), **overrides)
        if not packed:
            padded = trainer.data_collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
            assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]], "the reference must pad right"
        trainer.train()
        curves.append(losses(trainer))
    padded, packed = torch.tensor(curves[0]), torch.tensor(curves[1])
    assert len(packed) == len(padded) == overrides["max_steps"]
    torch.testing.assert_close(packed, padded, atol=1e-4, rtol=0)
    # random tokens: the loss can only fall to about log(123) from its start, so ask for movement, not a drop
    assert padded.max() - padded.min() > 1e-2, "the loss never moved: the comparison would prove little"


@pytest.mark.parametrize("architecture,kind,accumulation,lora", ARCHITECTURE_CURVES,
                         ids=[f"{name}-{kind}-{'lora' if lora else 'accumulation4'}"
                              for name, kind, _, lora in ARCHITECTURE_CURVES])
def test_every_decoder_trains_the_padded_curve(architecture, kind, accumulation, lora):
    """Each listed decoder, :data:`CURVE_STEPS` steps: HF Trainer with gradient accumulation 4, and TRL SFTTrainer
    with LoRA on every linear layer — the loss curve of padded training within 1e-4 (AdamW; SGD for the models of
    SGD_CURVES)."""
    assert_trains_the_padded_curve(architecture, kind, accumulation, lora)


@pytest.mark.parametrize("architecture,kind,accumulation,lora,strength",
                         [("llama", "hf", 4, False, 1e-3), ("qwen3", "sft", 1, True, 1e-2)],
                         ids=["llama-hf-accumulation4", "qwen3-sft-lora"])
def test_a_curve_comparison_fails_on_a_layer_leaking_across_examples(monkeypatch, architecture, kind, accumulation,
                                                                     lora, strength):
    """The per-architecture curves at :data:`CURVE_STEPS` steps have teeth: with the packed model's first layer
    leaking ``strength`` of the previous example's last token into each example's first, the comparison fails.
    Under LoRA (frozen base weights) a 1e-3 leak stays within the curves' 1e-4 (at 30 steps too): the per-example
    logits tests catch that one."""
    from contextlib import ExitStack

    from padfree_plugins.testing.faults import leak_across_boundaries

    own = make_trainer
    with ExitStack() as leaks:
        def leaking(kind, packed, **settings):
            trainer, acceleration = own(kind, packed, **settings)
            if packed:
                leaks.enter_context(leak_across_boundaries(trainer.model, strength=strength))
            return trainer, acceleration

        monkeypatch.setattr(f"{__name__}.make_trainer", leaking)
        with pytest.raises(AssertionError, match="not close"):
            assert_trains_the_padded_curve(architecture, kind, accumulation, lora)


#: Hybrid families (hybrids_common.HYBRIDS: attention beside gated-DeltaNet, KDA, Mamba1 / Mamba2 mixers, MoE
#: layers with their load-balancing loss where the family computes one), as the decoders above. The padded
#: reference pads on the right, as every curve here (DataCollatorForSeq2Seq with the tokenizer's padding_side;
#: TRL's collator always pads right), and the test checks it: a mixer's conv and scan run left to right, so pad
#: positions after every real token can never reach one — the reference is exact per example by causality alone.
#: Left padding puts the pads first and relies on each mixer masking them out of its conv taps and state
#: (transformers' torch paths do so today: left-padded logits within 7e-7 of each example alone for these 13 tiny
#: models, transformers 5.23), so it is not the reference a packed row must equal.
HYBRID_CURVES = [(name, "hf", 4, False) for name in HYBRIDS] + [(name, "sft", 1, True) for name in HYBRIDS]
#: The SFT curves run with TRL's default gradient checkpointing (the mixers' recomputation restarts at every example
#: too). Granite 4.0-H: TRL's fused SFT loss adds the load-balancing loss reading ``config.num_experts``, which
#: GraniteMoeHybrid names ``num_local_experts`` — TRL's padded run fails with an AttributeError (as for GraniteMoe
#: above), so its SFT curve runs with TRL's ``router_aux_loss_coef=0`` (its HF Trainer curve keeps the aux loss).
HYBRID_SFT_SETTINGS = {"granitemoehybrid": {"router_aux_loss_coef": 0.0}}


@pytest.mark.parametrize("architecture,kind,accumulation,lora", HYBRID_CURVES,
                         ids=[f"{name}-{kind}-{'lora' if lora else 'accumulation4'}"
                              for name, kind, _, lora in HYBRID_CURVES])
def test_every_hybrid_trains_the_padded_curve(architecture, kind, accumulation, lora):
    """Each hybrid family, :data:`CURVE_STEPS` steps: HF Trainer with gradient accumulation 4, and TRL SFTTrainer
    with LoRA on every linear layer — the loss curve of right-padded training within 1e-4 (AdamW)."""
    config = tiny_config(architecture, **HYBRIDS[architecture])
    assert getattr(config, "output_router_logits", False) or not hasattr(config, "router_aux_loss_coef"), \
        "an MoE family with a load-balancing loss trains without it"
    settings = HYBRID_SFT_SETTINGS.get(architecture, {}) if kind == "sft" else {}
    assert_trains_the_padded_curve(architecture, kind, accumulation, lora, **settings)


def test_sft_metrics_are_recorded_like_trl():
    """mean_token_accuracy, entropy and num_tokens (real tokens, no padding) match TRL's padded run."""
    logged = {}
    for packed in (False, True):
        trainer, _ = make_trainer("sft", packed=packed, max_steps=4, logging_steps=2)
        with contextlib.nullcontext() if packed else recording_token_margins(trainer.model) as margins:
            trainer.train()
        logged[packed] = [entry for entry in trainer.state.log_history if "loss" in entry]
        if not packed:  # per logged entry (2 steps), the share of tokens whose accuracy rounding could flip
            shares = flip_shares([torch.cat(rows) for rows in margins], 2)
    for want, got in zip(logged[False], logged[True]):
        assert got["num_tokens"] == want["num_tokens"] > 0
        assert got["entropy"] == pytest.approx(want["entropy"], abs=1e-4)
    accuracies = [[entry["mean_token_accuracy"] for entry in logged[packed]] for packed in (True, False)]
    assert excess_over_flips(*accuracies, shares, "mean_token_accuracy") <= 1e-6


def test_gradient_checkpointing_gives_the_same_curve():
    want, _ = padded_run("hf")
    trainer, _ = make_trainer("hf", packed=True, activation_checkpointing=True)
    trainer.train()
    assert trainer.model.is_activation_checkpointing
    assert_same_curve(losses(trainer), want)


@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_neftune_noise_is_the_padded_noise(kind):
    """``neftune_noise_alpha``: transformers scales the noise by the row length, which on a packed row would be
    every example's tokens together (weaker noise). The packed run draws the padded batch's noise instead, so the
    30-step curve equals padded NEFTune training. As the trainer's own hook, the noise is gone after ``train()``
    (a train-mode forward is deterministic again); undo gives the trainer its own NEFTune back."""
    curves = []
    for packed in (False, True):
        trainer, acceleration = make_trainer(kind, packed, neftune_noise_alpha=1.0)
        trainer.train()
        curves.append(losses(trainer))
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        trainer.model.train()
        assert torch.equal(trainer.model(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    assert_same_curve(curves[1], curves[0])
    without_noise, _ = padded_run(kind)
    assert max(abs(a - b) for a, b in zip(curves[0], without_noise)) > 1e-3, "NEFTune changed nothing"
    embeddings = trainer.model.get_input_embeddings()
    acceleration.undo()
    assert trainer.neftune_noise_alpha == 1.0
    assert not any(isinstance(hook, PackedNeftune) for hook in embeddings._forward_hooks.values())


SFT_LOSSES = {"dft": dict(loss_type="dft"),
              "dft-with-label-smoothing": dict(loss_type="dft", label_smoothing_factor=0.1),
              "moe-aux-accumulation2": dict(architecture="mixtral", gradient_accumulation_steps=2,
                                            per_device_train_batch_size=2)}


@pytest.mark.parametrize("settings", SFT_LOSSES.values(), ids=SFT_LOSSES.keys())
def test_sft_loss_is_trls(settings):
    """The SFT loss is TRL's, computed from the fused log-probabilities: DFT (``loss_type: dft``, where TRL ignores
    label smoothing), and an MoE's load-balancing term spread over accumulation steps. 15-step curves equal
    padded TRL within 1e-4 (relative for DFT, whose losses are small)."""
    curves = []
    for packed in (False, True):
        trainer, _ = make_trainer("sft", packed, max_steps=15, **settings)
        trainer.train()
        curves.append(torch.tensor(losses(trainer)))
    padded, packed = curves
    assert len(packed) == len(padded) == 15
    torch.testing.assert_close(packed, padded, atol=1e-4, rtol=1e-4)
    if settings.get("loss_type") == "dft":
        assert padded.max() < 1.0, "not the DFT loss (NLL here is about 4.9)"


def test_language_modeling_collator_replaced_with_its_labels():
    """transformers' ``DataCollatorForLanguageModeling`` (causal) labels every token but those equal to the pad id
    — real EOS tokens too when the EOS is the pad token. Replaced, it still does: the curve equals padded. A dataset
    ``labels`` column (which that collator overwrites, padfree would keep) is refused."""
    from transformers import DataCollatorForLanguageModeling

    tok = copy.deepcopy(tokenizer())
    tok.pad_token = tok.eos_token
    ends_in_eos = [{"input_ids": row["input_ids"] + [tok.eos_token_id]} for row in rows(32)]
    curves = []
    for packed in (False, True):
        trainer, _ = make_trainer("hf", False, train=datasets.Dataset.from_list(ends_in_eos), max_steps=8)
        trainer.eval_dataset = None  # it carries labels (see the next test)
        trainer.data_collator = DataCollatorForLanguageModeling(tok, mlm=False)
        if packed:
            accelerate(trainer, {"task": "causal_lm"})
        trainer.train()
        curves.append(torch.tensor(losses(trainer)))
    torch.testing.assert_close(curves[1], curves[0], atol=1e-5, rtol=0)
    trainer, _ = make_trainer("hf", False, max_steps=8)  # rows() carry labels
    trainer.data_collator = DataCollatorForLanguageModeling(tok, mlm=False)
    with pytest.raises(PadfreeError, match="overwrites the train dataset's labels"):
        accelerate(trainer, {"task": "causal_lm"})


def test_language_modeling_collator_with_an_eval_labels_column_is_refused():
    """The collator overwrites an eval set's labels too (padded eval_loss 4.8663, packed with the kept -100 masks
    4.8267): refused like a training set's, with every eval set named."""
    from transformers import DataCollatorForLanguageModeling

    unlabelled = datasets.Dataset.from_list([{"input_ids": row["input_ids"]} for row in rows(8)])
    trainer, _ = make_trainer("hf", False, train=unlabelled, max_steps=1)  # its eval set carries labels
    trainer.eval_dataset = {"plain": unlabelled, "masked": trainer.eval_dataset}
    trainer.data_collator = DataCollatorForLanguageModeling(copy.deepcopy(tokenizer()), mlm=False)
    with pytest.raises(PadfreeError, match=r"overwrites the eval \(masked\) dataset's labels"):
        accelerate(trainer, {"task": "causal_lm"})
    assert type(trainer.data_collator).__name__ == "DataCollatorForLanguageModeling"


def test_trl_packed_rows_are_split_back_into_examples():
    """Rows packed by TRL (``seq_lengths``) survive column removal and never attend across their examples."""
    examples = rows()
    packs = []
    for i in range(0, len(examples), 2):
        pair = examples[i : i + 2]
        packs.append({"input_ids": sum((ex["input_ids"] for ex in pair), []),
                      "labels": sum((ex["labels"] for ex in pair), []),
                      "seq_lengths": [len(ex["input_ids"]) for ex in pair], "source": "packed"})
    assert split_packed_row(packs[0]) == [{"source": "packed", **{k: ex[k] for k in ("input_ids", "labels")}}
                                          for ex in examples[:2]]
    trainer, _ = make_trainer("hf", packed=True, train=datasets.Dataset.from_list(packs), max_steps=3,
                              per_device_train_batch_size=2)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["cu_seq_lens_q"].numel() == 5  # 2 rows of 2 examples each
    trainer.train()


def test_evaluate_and_predict_are_padding_free_and_metrics_see_padded_shapes():
    seen = []
    padded, _ = make_trainer("hf", packed=False)
    packed, acceleration = make_trainer("hf", packed=True)
    hook = acceleration.assembly.model.register_forward_pre_hook(lambda m, a, k: seen.append(k), with_kwargs=True)
    try:
        got = packed.predict(packed.eval_dataset)
    finally:
        hook.remove()
    want = padded.predict(padded.eval_dataset)
    assert seen and all("cu_seq_lens_q" in k and "attention_mask" not in k for k in seen)
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], abs=1e-5)
    assert got.predictions.shape == want.predictions.shape and got.label_ids.shape == want.label_ids.shape
    # each example's first label is -100 in a packed batch (a causal LM never predicts it); the rest is the user's
    assert (got.label_ids[:, 0] == -100).all() and (got.label_ids[:, 1:] == want.label_ids[:, 1:]).all()
    real = want.label_ids != -100
    torch.testing.assert_close(torch.tensor(got.predictions[real]), torch.tensor(want.predictions[real]),
                               atol=1e-5, rtol=1e-5)

    def accuracy(prediction):
        logits, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
        mask = labels != -100
        return {"accuracy": float((logits.argmax(-1) == labels)[mask].mean())}

    for trainer in (padded, packed):
        trainer.compute_metrics = accuracy
    # the same evaluation set: its label margins (padded) bound how far rounding could move the accuracy
    margins = label_margins(torch.tensor(want.predictions[:, :-1]), torch.tensor(want.label_ids[:, 1:]))
    share = allowed_flips(margins) / margins.numel()
    assert excess_over_flips([packed.evaluate()["eval_accuracy"]], [padded.evaluate()["eval_accuracy"]], [share],
                             "eval_accuracy") <= 1e-6


def test_undo_restores_the_trainer_and_the_model():
    trainer, _ = make_trainer("hf", packed=False)
    before = {name: getattr(trainer, name) for name in ("data_collator", "compute_loss", "prediction_step")}
    trainer._set_signature_columns_if_needed()
    columns = list(trainer._signature_columns)
    model_before = model_state(trainer.model)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    assert isinstance(trainer.data_collator, TrainerCollator) and "compute_loss" in vars(trainer)
    with pytest.raises(PadfreeError, match="already padding-free"):
        accelerate(trainer, {"task": "causal_lm"})
    acceleration.undo()
    acceleration.undo()  # twice is harmless
    assert trainer.data_collator is before["data_collator"]
    assert "compute_loss" not in vars(trainer) and "prediction_step" not in vars(trainer)
    assert trainer.compute_loss == before["compute_loss"] and trainer._signature_columns == columns
    assert patch_of(trainer.model) is None and trainer.model.config._attn_implementation == "sdpa"
    assert_state_restored(model_before, trainer.model)
    trainer.train()  # padded again
    assert_same_curve(losses(trainer), padded_run("hf")[0])


def test_an_error_while_patching_the_trainer_leaves_it_as_it_was(monkeypatch):
    """An error part-way through the trainer patch (here while installing NEFTune, the last step) undoes what was
    already changed: collator, compute_loss, signature columns, accelerate's dispatch_batches, the model's patch
    (the collator and compute_loss stayed patched)."""
    trainer, _ = make_trainer("hf", packed=False, neftune_noise_alpha=1.0)
    collator, dataloader_config = trainer.data_collator, trainer.accelerator.dataloader_config
    assert dataloader_config.dispatch_batches is None

    def fail(*args, **kwargs):
        raise RuntimeError("no input embeddings")

    monkeypatch.setattr(PackedNeftune, "install", fail)
    with pytest.raises(RuntimeError, match="no input embeddings"):
        accelerate(trainer, {"task": "causal_lm"})
    assert trainer.data_collator is collator and dataloader_config.dispatch_batches is None
    assert not {"compute_loss", "prediction_step", "_track_num_input_tokens"} & set(vars(trainer))
    assert trainer.neftune_noise_alpha == 1.0 and trainer._signature_columns is None
    assert patch_of(trainer.model) is None


def test_generate_after_training_works_as_usual():
    trainer, acceleration = make_trainer("hf", packed=True, max_steps=5)
    trainer.train()
    model = trainer.model.eval()
    prompt = torch.tensor([[7, 8, 9, 10], [1, 1, 11, 12]])  # the second row left-padded
    kwargs = dict(attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), max_new_tokens=6, pad_token_id=1)
    patched = model.generate(prompt, do_sample=False, **kwargs)
    acceleration.undo()
    assert patched.shape == (2, 10)
    assert_same_greedy(patched, *greedy(model, prompt, **kwargs))


def test_average_tokens_across_devices_scales_like_the_trainer(monkeypatch):
    """With 2 processes, the loss normalised by every rank's token count is multiplied back by 2, as HF does."""
    examples = rows(6)
    reference, _ = make_trainer("hf", packed=False)
    trainer, acceleration = make_trainer("hf", packed=True)
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    items = torch.tensor(sum(sum(label != -100 for label in ex["labels"][1:]) for ex in examples) * 2)
    batch = trainer._prepare_inputs(acceleration.assembly.collator(examples))
    for average in (True, False):
        for t in (reference, trainer):
            t.args.average_tokens_across_devices = average
        padded = padded_collator()([{k: ex[k] for k in ("input_ids", "labels")} for ex in examples])
        want = Trainer.compute_loss(reference, reference.model, padded, num_items_in_batch=items)
        got = trainer.compute_loss(trainer.model, batch, num_items_in_batch=items)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_sft_with_its_own_padding_free_flag_is_taken_over():
    """TRL's padding_free=True (which needs max_length=None) builds its own collator; ours replaces it."""
    trainer, _ = make_trainer("sft", packed=True, padding_free=True, max_length=None, max_steps=3)
    assert isinstance(trainer.data_collator, TrainerCollator)
    trainer.train()


def test_a_collator_with_logic_of_its_own_is_refused():
    """A custom collator may build labels (e.g. masking prompts); replacing it silently would change training."""
    trainer, _ = make_trainer("hf", packed=False)
    trainer.data_collator = lambda rows: padded_collator()(rows)
    with pytest.raises(PadfreeError, match="data_collator is .*<lambda>.*dataset.map"):
        accelerate(trainer, {"task": "causal_lm"})
    assert patch_of(trainer.model) is None
    trainer.data_collator = None  # the documented way out for a collator that only pads
    accelerate(trainer, {"task": "causal_lm"}).undo()


def test_unknown_trainer_subclass_is_refused_and_the_model_restored():
    class CustomLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    trainer = CustomLoss(model=model, args=TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none"),
                         train_dataset=datasets.Dataset.from_list(rows(8)))
    with pytest.raises(PluginError, match="no plugin knows how to make CustomLoss padding-free"):
        accelerate(trainer, {"task": "causal_lm", "plugins": {"block": ["any_trainer"]}})  # the fallback blocked
    assert patch_of(model) is None


def test_bad_dataset_is_refused_before_training():
    bad = rows(8)
    bad[5] = {**bad[5], "labels": bad[5]["labels"][:-1]}
    with pytest.raises(BatchError, match="example 5 of the train dataset: 'labels' has"):
        make_trainer("hf", packed=True, train=datasets.Dataset.from_list(bad))
    too_long = rows(8, longest=300)
    with pytest.raises(BatchError, match="the model takes at most 256"):
        make_trainer("hf", packed=True, train=datasets.Dataset.from_list(too_long))


def test_token_budget_batching_replaces_the_train_dataloader():
    """``batching.strategy: tokens`` in the config: micro-batches filled up to the budget
    (padfree_plugins.batching.sampler)."""
    trainer, _ = make_trainer("hf", packed=False, max_steps=3)
    acceleration = accelerate(trainer, {"task": "causal_lm",
                                        "batching": {"strategy": "tokens", "max_tokens_per_batch": 128}})
    batches = list(trainer.get_train_dataloader())
    assert sum(b["cu_seq_lens_q"].numel() - 1 for b in batches) == 64  # every example once per epoch
    assert all(b["input_ids"].shape[-1] <= 128 for b in batches) and len(batches) < 64 / 4
    trainer.train()
    acceleration.undo()
    assert "get_train_dataloader" not in vars(trainer)


def test_token_budget_with_split_batches_is_refused():
    """accelerate's ``split_batches=True`` would cut every planned micro-batch across the ranks."""
    trainer, _ = make_trainer("hf", packed=False, accelerator_config={"split_batches": True})
    with pytest.raises(ConfigError, match="split_batches"):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens", "max_tokens_per_batch": 128}})
    assert "compute_loss" not in vars(trainer)  # nothing left patched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_bf16_training_on_gpu_follows_the_padded_curve(kind):
    """On CUDA with bf16 autocast the fast backend (varlen / flash_attn) runs; the curve matches to bf16 rounding."""
    curves = {}
    for packed in (False, True):
        trainer, acceleration = make_trainer(kind, packed=packed, bf16=True, max_steps=10)
        trainer.train()
        curves[packed] = losses(trainer)[:10]
        if acceleration:
            assert acceleration.assembly.plan.backend.name in ("varlen", "flash_attn")
    torch.testing.assert_close(torch.tensor(curves[True]), torch.tensor(curves[False]), atol=3e-2, rtol=1e-2)


# -- labelled logits only (HF Trainer, causal_lm) -----------------------------------------------------------------


def test_keep_labelled_logits_names_the_positions_whose_next_label_counts():
    from padfree_plugins.packing.batch import PackedBatch
    from padfree_plugins.packing.labelled_logits import drop_labelled_logits, keep_labelled_logits

    labels = torch.tensor([[-100, -100, 5, 6, -100, -100, 7]])  # example 1: 4 tokens (prompt 2), 2: 3 (prompt 1)
    batch = keep_labelled_logits({"input_ids": torch.zeros(1, 7, dtype=torch.long), "labels": labels})
    assert batch["logits_to_keep"].tolist() == [1, 2, 5]  # positions 1, 2 predict 5, 6; position 5 predicts 7
    assert batch["shift_labels"].tolist() == [[5, 6, 7]]
    assert set(drop_labelled_logits(batch)) == {"input_ids", "labels"}
    packed = keep_labelled_logits(PackedBatch(input_ids=torch.zeros(1, 7, dtype=torch.long), labels=labels))
    assert type(drop_labelled_logits(packed)) is PackedBatch
    assert keep_labelled_logits({"input_ids": torch.zeros(1, 3)}).keys() == {"input_ids"}  # no labels: unchanged
    empty = keep_labelled_logits({"labels": torch.full((1, 4), -100)})
    assert empty["logits_to_keep"].numel() == 0 and empty["shift_labels"].shape == (1, 0)


def test_hf_trainer_projects_only_labelled_positions_with_the_same_loss_and_gradients():
    trainer, acceleration = make_trainer("hf", packed=True)
    assert trainer.data_collator.labelled_logits
    batch = trainer._prepare_inputs(trainer.data_collator(rows(8)))
    held = batch[HELD_KEY]
    model = trainer.model
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[-2]))
    results = {}
    try:
        for name, inputs in (("labelled", batch), ("all", {k: v for k, v in batch.items() if k != HELD_KEY})):
            model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(model, inputs, num_items_in_batch=held["shift_labels"].ne(-100).sum())
            loss.backward()
            results[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    finally:
        hook.remove()
    labelled = int(held["logits_to_keep"].numel())
    assert head_rows == [labelled, batch["input_ids"].shape[-1]] and labelled < batch["input_ids"].shape[-1] * 0.9
    torch.testing.assert_close(results["labelled"][0], results["all"][0], atol=1e-6, rtol=1e-6)
    for got, want in zip(results["labelled"][1], results["all"][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["option off", "label smoothing", "sft"])
def test_labelled_logits_stay_off_where_every_logit_is_needed(case):
    if case == "sft":
        trainer, _ = make_trainer("sft", packed=True)
    else:
        trainer, _ = make_trainer("hf", packed=False, label_smoothing_factor=0.1 if case == "label smoothing" else 0)
        options = {"labelled_logits_only": False} if case == "option off" else {}
        accelerate(trainer, {"task": "causal_lm", "task_options": options})
    assert not trainer.data_collator.labelled_logits
    assert not {"logits_to_keep", HELD_KEY} & set(trainer.data_collator(rows(3)))


def test_labelled_logits_option_is_checked():
    trainer, _ = make_trainer("hf", packed=False)
    with pytest.raises(PadfreeError, match="labelled_logits_only of task 'causal_lm' must be true or false"):
        accelerate(trainer, {"task": "causal_lm", "task_options": {"labelled_logits_only": "yes"}})


def test_loss_only_evaluation_keeps_labelled_logits_and_the_padded_loss():
    trainer, _ = make_trainer("hf", packed=True, prediction_loss_only=True)
    reference, _ = make_trainer("hf", packed=False, prediction_loss_only=True)
    rows_seen = []
    hook = trainer.model.lm_head.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[-2]))
    try:
        got = trainer.evaluate()["eval_loss"]
    finally:
        hook.remove()
    sizes = [5, 5, 3]  # per_device_eval_batch_size 5 over 13 examples, in order
    starts = [0, 5, 10]
    want_rows = [int(trainer.data_collator(trainer.eval_dataset.select(range(a, a + n)).to_list())[HELD_KEY]
                     ["logits_to_keep"].numel()) for a, n in zip(starts, sizes)]
    assert rows_seen == want_rows  # the LM head projected only the labelled positions
    assert got == pytest.approx(reference.evaluate()["eval_loss"], abs=1e-5)


def test_torch_compile_through_the_trainer_gives_the_same_curve():
    eager, _ = make_trainer("hf", packed=True, max_steps=4)
    eager.train()
    compiled, _ = make_trainer("hf", packed=True, max_steps=4, torch_compile=True, torch_compile_backend="aot_eager")
    compiled.train()
    assert type(compiled.model_wrapped).__name__ == "OptimizedModule"
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), atol=1e-5, rtol=0)
    assert compiled.evaluate()["eval_loss"] == pytest.approx(eager.evaluate()["eval_loss"], abs=1e-5)


@pytest.mark.parametrize("kind", ["hf", "sft"])
@pytest.mark.parametrize("batching", [None, {"strategy": "tokens", "max_tokens_per_batch": 160}],
                         ids=["examples", "token-budget"])
def test_resume_from_checkpoint_continues_the_same_curve(tmp_path, batching, kind):
    """Stopping at a checkpoint in the middle of the second epoch and resuming trains the steps an uninterrupted run
    trains (same batches — the epoch's own shuffle, not epoch 0's — same losses), with example-count and with
    token-budget batching."""
    config = {"task": "causal_lm", **({"batching": batching} if batching else {})}
    train = datasets.Dataset.from_list(rows(20))  # 4-5 steps an epoch
    full, _ = make_trainer(kind, packed=False, max_steps=9, output_dir=str(tmp_path / "full"), train=train,
                           save_strategy="steps", save_steps=7)
    accelerate(full, config)
    full.train()
    assert 1 < full.state.log_history[6]["epoch"] < 2  # step 7 is inside the second epoch
    assert (tmp_path / "full" / "checkpoint-7" / FINGERPRINT_FILE).is_file()  # resumed below with its plan checked
    resumed, _ = make_trainer(kind, packed=False, max_steps=9, output_dir=str(tmp_path / "resumed"), train=train)
    accelerate(resumed, config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-7"))
    assert len(losses(resumed)) == len(losses(full)) == 9
    torch.testing.assert_close(torch.tensor(losses(resumed)[7:]), torch.tensor(losses(full)[7:]), atol=1e-6, rtol=0)


def assert_text_sft_curve_equals_padded(rows_: list[dict], processing_class, **sft_overrides) -> None:
    """TRL SFTTrainer on a text dataset, 6 steps, padded then packed: TRL's own label mask (its prompt or
    non-assistant tokens at -100) survives packing, and the loss curves agree."""
    curves = {}
    for packed in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2, vocab_size=300),
                                                 attn_implementation="sdpa")
        args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=6, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                             disable_tqdm=True, bf16=False, dataloader_pin_memory=False, **sft_overrides)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows_),
                                 processing_class=processing_class)
        if packed:
            accelerate(trainer, {"task": "causal_lm"})
            example = trainer.train_dataset[0]
            masked = sum(label == -100 for label in example["labels"])
            batch = trainer.data_collator([example])
            assert 0 < masked < len(example["labels"]) and (batch["labels"][0, :masked] == -100).all()
        trainer.train()
        curves[packed] = losses(trainer)
    torch.testing.assert_close(torch.tensor(curves[True]), torch.tensor(curves[False]), atol=1e-5, rtol=0)


def test_sft_trainer_on_prompt_completion_text_keeps_the_completion_only_loss():
    """TRL tokenizes a prompt / completion text dataset and folds its completion mask into labels."""
    rows_ = [{"prompt": f"question {i} about tiny things", "completion": f" answer {i} " * (1 + i % 4)}
             for i in range(40)]
    assert_text_sft_curve_equals_padded(rows_, tokenizer())


def test_sft_trainer_on_conversations_keeps_the_assistant_only_loss():
    """``assistant_only_loss``: TRL masks every non-assistant token from a chat template's generation markers."""
    chat = copy.deepcopy(tokenizer())
    chat.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A:{% generation %}"
                          "{{ m['content'] }}{% endgeneration %}{% else %}U:{{ m['content'] }}{% endif %}{% endfor %}")
    conversations = [{"messages": [{"role": "user", "content": f"question {i} about things"},
                                   {"role": "assistant", "content": f" answer {i} " * (1 + i % 4)}]}
                     for i in range(40)]
    assert_text_sft_curve_equals_padded(conversations, chat, assistant_only_loss=True)


def test_sft_metrics_on_a_mixture_of_experts_see_the_logits_alone():
    """TRL turns the router aux loss on for MoE models and hands ``compute_metrics`` only the logits; packed too."""
    seen = {}
    for packed in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2),
                                                 attn_implementation="sdpa")
        args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=4, report_to="none",
                             bf16=False, disable_tqdm=True, dataloader_pin_memory=False)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows(8)),
                                 eval_dataset=datasets.Dataset.from_list(rows(8, seed=1)), processing_class=tokenizer(),
                                 compute_metrics=lambda p, packed=packed: seen.update({packed: p}) or {})
        assert trainer.aux_loss_enabled
        if packed:
            accelerate(trainer, {"task": "causal_lm"})
        trainer.evaluate()
    want, got = seen[False], seen[True]
    assert isinstance(got.predictions, np.ndarray) and got.predictions.shape == want.predictions.shape
    real = want.label_ids[:, 1:] != -100  # a packed example's first label is -100 (see above)
    np.testing.assert_allclose(got.predictions[:, 1:][real], want.predictions[:, 1:][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batching, message", [
    ({"max_tokens_per_batch": 64}, "less than TRL's max_length=128"),
    ({"max_tokens_per_batch": 256, "on_overlong_example": "split"}, "split cannot cut TRL's packed rows"),
])
def test_trl_packing_with_a_token_budget_is_checked_before_training(batching, message):
    trainer, _ = make_trainer("sft", packed=False, packing=True, max_length=128)
    with pytest.raises(PadfreeError, match=message):
        accelerate(trainer, {"task": "causal_lm", "batching": {"strategy": "tokens", **batching}})
    assert "get_train_dataloader" not in vars(trainer)


# -- TrainingArguments paths that read the batch ------------------------------------------------------------------


def test_num_input_tokens_seen_counts_the_padded_runs_real_tokens():
    """``include_num_input_tokens_seen="non_padding"`` counts every token of a packed batch (it has no padding); the
    trainer would count the tokens unequal to the pad id, and miss real ones — here every example ends with it, as
    when pad is eos. ``"all"`` counts the tokens the model ran: the real ones, no padding."""
    train = rows(12)
    pad = tokenizer().pad_token_id
    for example in train:
        example["input_ids"][-1] = example["labels"][-1] = pad
    counts = {}
    for packed in (False, True):
        for mode in ("non_padding", "all"):
            trainer, _ = make_trainer("hf", packed, max_steps=3, include_num_input_tokens_seen=mode,
                                      train=datasets.Dataset.from_list(train))
            trainer.processing_class = tokenizer()
            trainer.train()
            counts[packed, mode] = trainer.state.num_input_tokens_seen
    real = sum(len(example["input_ids"]) for example in train)
    assert counts[True, "non_padding"] == counts[False, "non_padding"] == counts[True, "all"] == real
    assert counts[False, "all"] > real  # padded: padding included


def test_an_iterable_dataset_trains_and_evaluates_the_padded_curve():
    """accelerate dispatches an iterable dataset's batches by default, slicing every tensor by rows (a packed batch
    is one row: its boundaries were cut to one number). Dispatching is turned off — every process loads its own
    examples, the same batches — and set back by undo; asked for explicitly, it is refused. (The eval set is 3 full
    batches: on a last partial batch of an iterable eval set, accelerate no longer trims the trainer's repeated
    batch loss to the batch's examples, so eval_loss weighs that batch as a full one.)"""
    def streams():
        strip = [{k: v for k, v in example.items() if k != "source"} for example in rows()]
        return datasets.Dataset.from_list(strip).to_iterable_dataset()

    results = {}
    for packed in (False, True):
        trainer, acceleration = make_trainer("hf", packed, max_steps=6, train=streams())
        trainer.eval_dataset = datasets.Dataset.from_list(rows(15, seed=1)).to_iterable_dataset()
        trainer.train()
        results[packed] = losses(trainer), trainer.evaluate()["eval_loss"]
    assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=0)
    assert_close(torch.tensor(results[True][0]), torch.tensor(results[False][0]))
    assert_close(torch.tensor(results[True][1]), torch.tensor(results[False][1]))
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    acceleration.undo()
    assert trainer.accelerator.dataloader_config.dispatch_batches is None
    dispatching, _ = make_trainer("hf", packed=False, accelerator_config={"dispatch_batches": True})
    with pytest.raises(PadfreeError, match="dispatch_batches=True slices every batch by rows"):
        accelerate(dispatching, {"task": "causal_lm"})
    assert patch_of(dispatching.model) is None


def test_model_init_is_refused():
    """``model_init``: train() and every hyperparameter-search trial build a new model, which would not be padding-free
    (it trained packed batches unpatched: losses 8e-3 off the padded curve in 6 steps)."""
    def model_init():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")

    trainer = Trainer(model_init=model_init, args=TrainingArguments(output_dir=tempfile.mkdtemp(), report_to="none"),
                      train_dataset=datasets.Dataset.from_list(rows(8)), data_collator=padded_collator())
    with pytest.raises(PadfreeError, match=r"model_init.*Trainer\(model=model_init\(\)"):
        accelerate(trainer, {"task": "causal_lm"})
    assert patch_of(trainer.model) is None


def test_context_and_sequence_parallelism_are_refused(monkeypatch):
    """cp_size / sp_size > 1 shard every row along the sequence: a packed row's examples would lose their boundaries."""
    import types

    trainer, _ = make_trainer("hf", packed=False)
    for cp, sp in ((True, False), (False, True)):
        split = types.SimpleNamespace(cp_enabled=cp, sp_enabled=sp)
        monkeypatch.setattr(type(trainer.accelerator), "parallelism_config", property(lambda self, split=split: split))
        with pytest.raises(PadfreeError, match=r"(cp|sp)_size > 1"):
            accelerate(trainer, {"task": "causal_lm"})
        assert patch_of(trainer.model) is None
