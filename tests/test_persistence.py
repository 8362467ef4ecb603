"""What users do with a model during and after padding-free training: save it (``save_pretrained``, Trainer
checkpoints, peft adapters), load it in plain transformers / peft, copy or pickle it, change its dtype. Nothing of
padfree-plugins may reach a saved file, and ``undo()`` leaves the config exactly as it was."""

from __future__ import annotations

import copy
import io
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from padfree_plugins import assemble, patch_of
from tests.conftest import make_examples, split_packed, tiny_model

peft = pytest.importorskip("peft")

CASES = {"llama-causal_lm": ("llama", "causal_lm", AutoModelForCausalLM),
         "bert-seq_cls": ("bert", "seq_cls", AutoModelForSequenceClassification)}


def padded_inputs() -> dict:
    ids = torch.randint(5, 128, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def saved_files(model, directory: Path) -> dict[str, bytes]:
    model.save_pretrained(directory)
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def config_state(model) -> dict:
    return copy.deepcopy(model.config.__dict__)


@pytest.mark.parametrize("model_type,task,auto", CASES.values(), ids=CASES.keys())
def test_saved_while_patched_is_what_the_unpatched_model_saves(tmp_path, model_type, task, auto):
    """``save_pretrained`` while patched writes the files the unpatched model writes (config.json names the original
    attention, nothing of ours); plain transformers loads them with identical outputs; undo restores the config."""
    model = tiny_model(model_type, task)
    want_files = saved_files(model, tmp_path / "plain")
    before = config_state(model)
    assembly = assemble(model, {"task": task})
    assert model.config._attn_implementation.startswith("padfree_")
    assert saved_files(model, tmp_path / "patched") == want_files
    reloaded = auto.from_pretrained(tmp_path / "patched").eval()
    assert reloaded.config._attn_implementation == "sdpa"
    with torch.no_grad():
        got, want = reloaded(**padded_inputs()).logits, model(**padded_inputs()).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assembly.undo()
    assert config_state(model) == before
    assert saved_files(model, tmp_path / "undone") == want_files


def packed_logits(assembly, model, examples):
    batch = assembly.collator(examples)
    with torch.no_grad():
        return assembly.forward(model, batch)["logits"]


@pytest.mark.parametrize("model_type,task,auto", CASES.values(), ids=CASES.keys())
def test_copies_of_a_patched_model_are_patched_on_their_own(model_type, task, auto):
    """``copy.deepcopy``, ``pickle`` and ``torch.save`` of a patched model: each copy runs packed batches as the
    original does and has its own patch, whose undo restores the copy and nothing else."""
    model = tiny_model(model_type, task)
    before = config_state(model)
    assembly = assemble(model, {"task": task})
    examples = make_examples([5, 9, 3, 12])
    want = packed_logits(assembly, model, examples)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]
    for other in copies:
        assert patch_of(other) is not None and patch_of(other) is not assembly.patch
        torch.testing.assert_close(packed_logits(assembly, other, examples), want, atol=1e-6, rtol=0)
    patch_of(copies[0]).undo()
    assert config_state(copies[0]) == before and "forward" not in copies[0].__dict__
    assert patch_of(copies[0]) is None and not copies[0].base_model._forward_pre_hooks
    assert model.config._attn_implementation == assembly.patch.implementation  # the original is still patched
    assembly.undo()
    for other in copies[1:]:
        assert patch_of(other).active
        torch.testing.assert_close(packed_logits(assembly, other, examples), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_model_to_another_dtype_stays_exact(dtype):
    """``model.to(dtype)`` on a patched model: packed outputs equal per-example outputs in that dtype."""
    model = tiny_model("llama", "causal_lm")
    assembly = assemble(model, {"task": "causal_lm"})
    model.to(dtype)
    examples = make_examples([5, 9, 3, 12])
    batch = assembly.collator(examples)
    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits
        alone = [model(input_ids=torch.tensor([ex["input_ids"]])).logits[0] for ex in examples]
    assert packed.dtype == dtype
    for got, want in zip(split_packed(packed, batch), alone):
        torch.testing.assert_close(got, want)  # torch's tolerances for the dtype
    assembly.undo()


def test_lora_adapter_reloads_in_plain_peft_and_merges(tmp_path):
    """A LoRA adapter trained padding-free: ``save_pretrained`` while patched, reloaded on the base weights in plain
    peft, gives the trained model's outputs; ``merge_and_unload`` while patched and after undo gives them too."""
    base = tiny_model("llama", "causal_lm")
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assembly = assemble(model, {"task": "causal_lm"})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    examples = [{**ex, "labels": ex["input_ids"]} for ex in make_examples([5, 9, 3, 12])]
    for _ in range(3):
        assembly.forward(model, assembly.collator(examples)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        want = model(**padded_inputs()).logits
        assert (want - base(**padded_inputs()).logits).abs().max() > 1e-3  # the adapter learned something
        model.save_pretrained(tmp_path / "adapter")
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(**padded_inputs()).logits, want, atol=1e-5, rtol=0)
        merged_while_patched = copy.deepcopy(model).merge_and_unload()
        torch.testing.assert_close(merged_while_patched(**padded_inputs()).logits, want, atol=1e-5, rtol=0)
        patch_of(merged_while_patched).undo()
        assembly.undo()
        merged = model.merge_and_unload()
        assert merged.config._attn_implementation == "sdpa" and patch_of(merged) is None
        torch.testing.assert_close(merged(**padded_inputs()).logits, want, atol=1e-5, rtol=0)
        merged.save_pretrained(tmp_path / "merged")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(loaded(**padded_inputs()).logits, want, atol=1e-5, rtol=0)


def test_trainer_checkpoint_and_saved_model_load_in_plain_transformers():
    """HF Trainer, accelerated, for sequence classification (the model's forward is routed while training): its
    checkpoint and ``save_model`` load in plain transformers with the in-memory model's padded outputs."""
    import datasets
    from transformers import Trainer, TrainingArguments

    from padfree_plugins import accelerate

    model = tiny_model("bert", "seq_cls", num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    rows = [{**ex, "label": i % 3} for i, ex in enumerate(make_examples([4 + (7 * i) % 19 for i in range(16)]))]
    output = Path(tempfile.mkdtemp(prefix="padfree-persistence-"))
    args = TrainingArguments(output_dir=str(output), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             save_strategy="steps", save_steps=4, report_to="none", disable_tqdm=True,
                             dataloader_pin_memory=False)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
    acceleration = accelerate(trainer, {"task": "seq_cls"})
    trainer.train()
    trainer.save_model(str(output / "final"))
    acceleration.undo()
    model.eval()
    with torch.no_grad():
        want = model(**padded_inputs()).logits
        for directory in (output / "checkpoint-4", output / "final"):
            loaded = AutoModelForSequenceClassification.from_pretrained(directory).eval()
            assert loaded.config._attn_implementation == "sdpa"
            torch.testing.assert_close(loaded(**padded_inputs()).logits, want, atol=1e-5, rtol=0)
