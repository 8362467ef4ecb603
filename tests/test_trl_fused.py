"""TRL's fused LM head on the packed row (:mod:`padfree_plugins.integrations.trl_fused`): a fused call on a padded
batch — DPO's right-padded prompt + completion, GRPO's left-padded prompt + right-padded completion — returns TRL's
padded per-token outputs (log-probs, entropy, mean logits, top-1, label mask, loss, MoE aux loss) within 1e-5 and
their gradients within 1e-4, while running only the real tokens; a leaking layer is caught; every other call is TRL's
own; refusals leave the trainer as it was."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from padfree_plugins import assemble
from padfree_plugins.integrations.trl_fused import PackedFusedHead, fused_forward_of, padded_per_token
from padfree_plugins.testing.faults import leak_across_boundaries
from tests.conftest import tiny_model
from tests.hybrids_common import hybrid_model

trl_utils = pytest.importorskip("trl.trainer.utils")

#: Every per-token field TRL's fused head can compute.
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: (prompt, completion) lengths of a batch; a right-padded batch puts each row's tokens first, a GRPO batch pads the
#: prompts on the left to the longest prompt and the completions on the right.
SHAPES = [(3, 5), (1, 1), (7, 2), (2, 9), (4, 4)]


def fused(model):
    """``model`` with TRL's fused LM head (every per-token field), as the trainers add it."""
    trl_utils.add_fused_lm_head(model, outputs=FIELDS)
    return model


def padded_batch(shapes, layout: str, vocab: int, seed: int = 0) -> dict:
    """``input_ids``, ``attention_mask`` and completion-only ``labels`` of a padded batch: ``right`` (DPO, KTO) or
    ``grpo`` (prompts left-padded to the longest prompt, completions right-padded to the longest completion)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    longest_prompt = max(p for p, _ in shapes)
    width = max(p + c for p, c in shapes) if layout == "right" else longest_prompt + max(c for _, c in shapes)
    for prompt, completion in shapes:
        tokens = torch.randint(5, vocab, (prompt + completion,), generator=generator)
        start = 0 if layout == "right" else longest_prompt - prompt
        ids = torch.zeros(width, dtype=torch.long)
        mask = torch.zeros(width, dtype=torch.long)
        labels = torch.full((width,), -100)
        ids[start:start + prompt + completion] = tokens
        mask[start:start + prompt + completion] = 1
        labels[start + prompt:start + prompt + completion] = tokens[prompt:]
        rows.append((ids, mask, labels))
    return {key: torch.stack([row[i] for row in rows]) for i, key in enumerate(("input_ids", "attention_mask",
                                                                                "labels"))}


def fused_call(model, batch: dict, **kwargs):
    return model(**batch, fused_lm_head=True, use_cache=False, **kwargs)


def packed_copy(model):
    """A copy of ``model`` made padding-free (assembled) with its fused head taken over."""
    packed = copy.deepcopy(model)
    assembly = assemble(packed, {"task": "causal_lm"})
    return packed, assembly, PackedFusedHead.install(packed)


def assert_same_outputs(got, want) -> None:
    for name in (*FIELDS, "label_mask"):
        assert getattr(got, name).shape == getattr(want, name).shape, name
        torch.testing.assert_close(getattr(got, name).float(), getattr(want, name).float(), atol=1e-5, rtol=1e-5,
                                   msg=name)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def step(model, batch: dict, **kwargs):
    """One fused call and the backward of a loss that reads log-probs and entropy, as DPO / GRPO losses do."""
    model.zero_grad()
    output = fused_call(model, batch, **kwargs)
    loss = output.loss + 0.1 * (output.entropy * output.label_mask).sum()
    if output.aux_loss is not None:
        loss = loss + output.aux_loss
    loss.backward()
    return output, gradients(model)


MODELS = {
    "llama": lambda: tiny_model("llama", "causal_lm", num_key_value_heads=2),
    "qwen3": lambda: tiny_model("qwen3", "causal_lm", num_key_value_heads=2),
    "qwen3_moe": lambda: tiny_model("qwen3_moe", "causal_lm", num_key_value_heads=2, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
                                    router_aux_loss_coef=0.1),
    "qwen3_5_text": lambda: hybrid_model("qwen3_5_text"),
}


@pytest.mark.parametrize("layout", ["right", "grpo"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_fused_call_returns_trls_padded_outputs_and_gradients(name, layout, packed_calls):
    torch.manual_seed(0)
    reference = fused(MODELS[name]()).train()
    packed, assembly, head = packed_copy(reference)
    batch = padded_batch(SHAPES, layout, reference.config.vocab_size)
    want, want_grads = step(reference, batch)
    got, got_grads = step(packed, batch)
    assert packed_calls == [True], "the fused call was not packed"
    assert_same_outputs(got, want)
    if want.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss, want.aux_loss, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-4, rtol=1e-4, msg=key)
    head.remove()
    assembly.undo()


@pytest.mark.parametrize("layout", ["right", "grpo"])
def test_a_token_leaking_across_a_boundary_is_caught(layout):
    """The comparison above fails for a layer that gives each example's first token 1e-3 of the previous example's
    last token: proof that it would catch a packing bug."""
    torch.manual_seed(0)
    reference = fused(MODELS["llama"]())
    packed, assembly, _ = packed_copy(reference)
    batch = padded_batch(SHAPES, layout, reference.config.vocab_size)
    with torch.no_grad():
        want = fused_call(reference, batch)
        with leak_across_boundaries(packed, strength=1e-3):
            leaked = fused_call(packed, batch)
        assert_same_outputs(fused_call(packed, batch), want)
    with pytest.raises(AssertionError):
        assert_same_outputs(leaked, want)
    assembly.undo()


def test_the_lm_head_runs_on_real_tokens_only():
    """The backbone and the head see one row of the real tokens: no padded hidden states, no padded logits."""
    torch.manual_seed(0)
    packed, assembly, _ = packed_copy(fused(MODELS["llama"]()))
    batch = padded_batch(SHAPES, "grpo", packed.config.vocab_size)
    seen = []
    hook = packed.model.register_forward_hook(lambda module, args, output: seen.append(output.last_hidden_state.shape))
    with torch.no_grad():
        fused_call(packed, batch)
    hook.remove()
    assert seen == [(1, sum(p + c for p, c in SHAPES), packed.config.hidden_size)]
    assembly.undo()


def test_calls_that_are_not_packed_run_trls_own_forward(packed_calls):
    """A batch without padding (nothing to gain), a call without the fused head (logits for metrics), a cached
    ``generate()``: TRL's own forward, bit for bit."""
    torch.manual_seed(0)
    reference = fused(MODELS["llama"]())
    packed, assembly, _ = packed_copy(reference)
    full = padded_batch([(3, 4), (2, 5)], "right", reference.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(fused_call(packed, full).log_probs, fused_call(reference, full).log_probs)
        plain = {key: value for key, value in full.items() if key != "labels"}
        assert torch.equal(packed(**plain).logits, reference(**plain).logits)
        prompt = full["input_ids"][:, :3]
        assert torch.equal(packed.generate(prompt, max_new_tokens=4, do_sample=False),
                           reference.generate(prompt, max_new_tokens=4, do_sample=False))
    assert packed_calls[:1] == [False]
    assembly.undo()


def test_a_label_predicted_from_a_pad_runs_padded(packed_calls):
    """A left-padded row whose first real token has a label is predicted, padded, from the pad before it: the call
    runs TRL's padded forward, equal to the reference."""
    torch.manual_seed(0)
    reference = fused(MODELS["llama"]())
    packed, assembly, _ = packed_copy(reference)
    batch = padded_batch(SHAPES, "grpo", reference.config.vocab_size)
    first = batch["attention_mask"][0].argmax()
    batch["labels"][0, first] = batch["input_ids"][0, first]
    with torch.no_grad():
        assert_same_outputs(fused_call(packed, batch), fused_call(reference, batch))
    assert packed_calls == [False]
    assembly.undo()


def test_padded_per_token_puts_values_at_their_columns():
    from padfree_plugins.modeling.unpad import Unpadded

    unpadded = Unpadded(rows=2, width=4, index=torch.tensor([0, 1, 5, 6, 7]))
    value = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    assert padded_per_token(value, unpadded).tolist() == [[1.0, 2.0, 0.0], [0.0, 3.0, 4.0]]
    assert padded_per_token(torch.tensor(2.0), unpadded).item() == 2.0


def test_install_needs_trls_fused_head_and_remove_restores_it():
    model = tiny_model("llama", "causal_lm", num_key_value_heads=2)
    from padfree_plugins import PadfreeError

    with pytest.raises(PadfreeError, match="no TRL fused LM head"):
        PackedFusedHead.install(model)
    fused(model)
    original = fused_forward_of(model)
    head = PackedFusedHead.install(model)
    assert fused_forward_of(model) is None and head.original == original
    # the model's own signature, which generate() checks a VLM's pixel_values / image_grid_thw against
    assert inspect.signature(model.forward) == inspect.signature(original) and "input_ids" in \
        inspect.signature(model.forward).parameters
    head.remove()
    assert fused_forward_of(model) == original


def test_the_guides_fused_trainer_plugin_runs():
    """docs/writing-a-plugin.md's example for a TRL trainer with a fused head is a working plugin module: it claims
    a trainer of that name from a ``trl`` module, and nothing else."""
    import re
    import types
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md").read_text()
    section = guide.split("## A plugin for a TRL trainer with a fused LM head", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    module = types.ModuleType("async_grpo_plugin")
    exec(compile(block, "writing-a-plugin.md", "exec"), module.__dict__)
    claimed = type("AsyncGRPOTrainer", (), {"__module__": "trl.experimental.async_grpo",
                                             "compute_loss": lambda self: None, "_compute_loss": lambda self: None})
    other = type("AsyncGRPOTrainer", (), {"__module__": "my_trainers"})
    assert module.AsyncGRPOPatch.claims(claimed()) and not module.AsyncGRPOPatch.claims(other())
    assert module.wrap_trainer(other(), assembly=None, config=None) is None
