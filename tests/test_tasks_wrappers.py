"""Task forwards run *through* the wrappers around a model: peft (LoRA) and DistributedDataParallel. DDP must see
the forward, or it never prepares the gradient all-reduce and ranks silently drift apart."""

from __future__ import annotations

import inspect
from types import MethodType

import pytest
import torch
import torch.distributed as dist

from padfree_plugins import assemble
from tests.conftest import make_examples
from tests.tasks_common import assert_grads_close, grads, model_for, padded, per_example_case

peft = pytest.importorskip("peft")


def labelled(lengths):
    examples = make_examples(lengths)
    for i, ex in enumerate(examples):
        ex["label"] = i % 2
    return examples


def padded_reference(model, examples):
    out = model(**padded(examples), labels=torch.tensor([ex["label"] for ex in examples]))
    out.loss.backward()
    return out.logits.detach(), grads(model)


def test_lora_sequence_classification_equals_padded():
    model = model_for("bert", head="seq_cls", num_labels=2)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["query", "value"]))
    examples = labelled([1, 9, 4, 15])
    want_logits, want_grads = padded_reference(model, examples)
    assembly = assemble(model, "configs/seq_cls.yaml")
    try:
        out = assembly.forward(model, assembly.collator(examples))
        out.loss.backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(out.logits.detach(), want_logits, atol=1e-5, rtol=1e-5)
    got = grads(model)
    assert any("lora_" in name for name in got) and any("classifier" in name for name in got)
    assert_grads_close(got, want_grads)


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("task", ["seq_cls", "embedding"])
def test_ddp_sees_the_forward(process_group, task):
    head = "seq_cls" if task == "seq_cls" else "base"
    model = model_for("bert", head=head, num_labels=2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=task == "embedding")
    calls = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(type(module).__name__))
    config, examples = per_example_case(task, [3, 7, 1])
    assembly = assemble(ddp, config)
    try:
        batch = assembly.collator(examples)
        for _ in range(2):  # a second step: DDP raises if the first reduction never happened
            assembly.forward(ddp, batch).loss.backward()
        with_ddp = grads(model)
        for _ in range(2):
            assembly.forward(model, batch).loss.backward()
        alone = grads(model)
    finally:
        assembly.undo()
    assert calls == ["DistributedDataParallel"] * 2
    assert "forward" not in model.__dict__  # the compute route is gone with the patch
    assert_grads_close(with_ddp, alone)


def wrap_like_accelerate_mixed_precision(model):
    """What ``Accelerator.prepare_model`` does to a model's forward under native mixed precision."""
    from accelerate.utils import convert_outputs_to_fp32

    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    if not hasattr(model.forward, "__func__"):  # a callable object (padfree's compute route): wrapped as it is
        model.forward = convert_outputs_to_fp32(autocast(model.forward))
        return
    model.forward = MethodType(autocast(model.forward.__func__), model)
    model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


def test_mixed_precision_and_ddp_wrap_the_per_example_computation(process_group):
    """accelerate autocasts through an instance ``forward``, then DDP wraps the model (HF Trainer on several GPUs
    with bf16): the per-example head runs inside both, under autocast, and undo leaves their wrapper working."""
    model = model_for("bert", head="seq_cls", num_labels=2)
    signature = inspect.signature(model.forward)
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    assert inspect.signature(model.forward) == signature  # Trainer and TRL read the forward's parameters
    wrap_like_accelerate_mixed_precision(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    head_dtypes = []
    model.classifier.register_forward_hook(lambda module, args, out: head_dtypes.append(out.dtype))
    examples = labelled([3, 7, 1])
    try:
        out = assembly.forward(ddp, assembly.collator(examples))
        out.loss.backward()
    finally:
        assembly.undo()
    assert head_dtypes == [torch.bfloat16] and out.logits.dtype == torch.float32
    assert out.logits.shape == (3, 2) and all(p.grad is not None for p in model.classifier.parameters())
    padded_out = ddp(**padded(examples))  # after undo: accelerate's wrapper still runs the model's own forward
    assert padded_out.logits.shape == (3, 2) and head_dtypes[-1] == torch.bfloat16


def test_a_forward_wrapped_before_assembly_still_runs_ordinary_calls():
    model = model_for("bert", head="seq_cls", num_labels=2)
    wrap_like_accelerate_mixed_precision(model)
    wrapper = model.forward
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    examples = labelled([4, 2])
    try:
        assert model(**padded(examples)).logits.dtype == torch.float32
    finally:
        assembly.undo()
    assert model.forward is wrapper


@pytest.mark.parametrize("task", ["seq_cls", "reranker"])
def test_mixed_precision_without_ddp_autocasts_the_per_example_computation(task):
    """One process, ``accelerator.prepare`` with bf16 (no DDP wrapper: the prepared model is the model itself, its
    forward autocast): the per-example head runs under autocast, as the padded forward does (it ran in fp32)."""
    model = model_for("bert", head="seq_cls", num_labels=2 if task == "seq_cls" else 1)
    options = {"pairs": False} if task == "reranker" else {}
    assembly = assemble(model, {"task": task, "attention": "exact", "task_options": options})
    wrap_like_accelerate_mixed_precision(model)
    head_dtypes = []
    model.classifier.register_forward_hook(lambda module, args, out: head_dtypes.append(out.dtype))
    examples = labelled([3, 7, 1])
    try:
        out = assembly.forward(model, assembly.collator(examples))
    finally:
        assembly.undo()
    model(**padded(examples))
    assert head_dtypes == [torch.bfloat16, torch.bfloat16]
    assert out.logits.dtype == torch.float32  # accelerate's convert_outputs_to_fp32, as for a padded call


def test_assembling_a_model_whose_forward_is_already_wrapped_warns(caplog):
    """``accelerator.prepare`` before ``assemble``: the per-example computation cannot run inside the autocast
    wrapper installed before it, so assembly says so (it silently ran in fp32)."""
    model = model_for("bert", head="seq_cls", num_labels=2)
    wrap_like_accelerate_mixed_precision(model)
    with caplog.at_level("WARNING", logger="padfree_plugins"):
        assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    assembly.undo()
    assert "assemble the model before accelerator.prepare" in caplog.text
