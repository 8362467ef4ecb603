"""Sequence mixers under DeepSpeed ZeRO-3 make as many calls on every rank (padfree_plugins.modeling.mixers:
``agreed_calls``, ``equal_calls``), in one process: ZeRO-3's partitioning is stood in for by ``ds_id`` on the mixers'
parameters, the other ranks by an all-reduce that answers more calls than this rank's row needs. The real thing, two
ranks under ZeRO-3, is tests/test_sharded.py's ``test_hybrid_under_zero3_with_rows_of_different_groups_equals_one_
process``. Without ZeRO-3 nothing changes: no collective, no extra call.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from padfree_plugins import assemble
from padfree_plugins.testing.faults import dummy_calls_untied
from padfree_plugins.testing.models import random_examples
from tests.hybrids_common import hybrid_model, slow

#: Another rank's number of mixer calls, more than this rank's row needs (the all-reduce's answer).
MOST = 5
#: This rank's row: spans 3 and 1 chunks of Bamba's 16 tokens (2 calls), 1 chunk of the gated delta rule's 64 (1 call).
LENGTHS = (40, 12)
#: The module whose calls are counted: the first mixer's input projection, per family, and its number of calls.
PROJECTION = {"qwen3_5_text": ("linear_attn.in_proj_qkv", 1), "bamba": ("mamba.in_proj", 2)}


def counted_run(model_type: str, monkeypatch, partitioned: bool, fault: bool = False) -> dict:
    """One forward and backward of the tiny ``model_type`` (slow decays, gradient checkpointing) on a row of
    :data:`LENGTHS`, its mixers' parameters marked as ZeRO-3's (``partitioned``); the loss, the gradients, the
    all-reduces issued (their values sent), and per call of the first mixer's projection whether its input needs a
    gradient, and how many of its calls the backward ran through."""
    model = slow(hybrid_model(model_type)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assembly = assemble(model, {"task": "causal_lm", "mixers": "exact"})
    reduces = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        reduces.append(tensor.item())
        tensor.fill_(max(tensor.item(), MOST))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    layer = next(layer for layer in model.model.layers if any("mamba" in n or "linear_attn" in n
                                                               for n, _ in layer.named_children()))
    if partitioned:
        for name, module in model.named_modules():
            if type(module).__name__.endswith(("GatedDeltaNet", "Mixer")):
                for index, parameter in enumerate(module.parameters()):
                    parameter.ds_id, parameter.ds_process_group = index, None
    projection = layer.get_submodule(PROJECTION[model_type][0])
    inputs, backward = [], [0]

    def count(module, args, output):
        inputs.append(args[0].requires_grad)
        output.register_hook(lambda grad: backward.__setitem__(0, backward[0] + 1))

    projection.register_forward_hook(count)
    batch = assembly.collator(random_examples(LENGTHS, vocab_size=model.config.vocab_size, seed=3))
    with dummy_calls_untied() if fault else nullcontext():
        loss = assembly.forward(model, batch).loss
        loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "reduces": reduces, "inputs": inputs, "backward": backward[0]}


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
def test_a_partitioned_mixer_makes_as_many_calls_as_the_rank_that_needs_most(model_type, monkeypatch):
    """Unmarked (no ZeRO-3): no all-reduce, and exactly the calls the row needs, in the forward, the checkpoint
    recompute and the backward. Marked as ZeRO-3's, with another rank needing :data:`MOST` calls: the ranks agree by
    one all-reduce per forward (sent this row's calls; none for the second mixer layer, none in the checkpoint
    recompute), and the mixer's projection runs :data:`MOST` times in the forward, again in the recompute, and
    :data:`MOST` times in the backward, each call's input needing a gradient (ZeRO-3 lets a module's weights go after
    its backward through its inputs' gradients); loss and gradients equal the unmarked run. With the deliberate fault
    ``dummy_calls_untied`` the backward runs through this rank's own calls only: the count catches it."""
    plain = counted_run(model_type, monkeypatch, partitioned=False)
    marked = counted_run(model_type, monkeypatch, partitioned=True)
    own = PROJECTION[model_type][1]
    assert plain["reduces"] == [] and len(plain["inputs"]) == 2 * own and plain["backward"] == own
    assert marked["reduces"] == [own]
    assert len(marked["inputs"]) == 2 * MOST and all(marked["inputs"]) and marked["backward"] == MOST
    assert abs(marked["loss"] - plain["loss"]) < 1e-6
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(marked["grads"][name], grad, atol=1e-6, rtol=1e-6)
    faulty = counted_run(model_type, monkeypatch, partitioned=True, fault=True)
    assert len(faulty["inputs"]) == 2 * MOST and faulty["backward"] == own < MOST  # caught: the backward skips calls



def test_a_partitioned_mixer_in_a_row_with_shared_prefixes_makes_a_call_per_segment(monkeypatch):
    """A row with shared prefixes (tests/test_hybrid_prefixes.py's: 3 prompts, 8 completions, 11 segments), its gated
    delta rules marked as ZeRO-3's: the ranks agree on one call per segment (a bound on the calls of any rank's row,
    known before the first), the projection runs 11 times forward and backward, and the shared call still equals the
    padded one (log-probabilities 1e-5, gradients 1e-4). The deliberate fault ``dummy_calls_untied`` leaves the
    backward short of the forward."""
    from tests.test_hybrid_prefixes import assert_same, compare_call, model_for, padded_call

    reduces = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        reduces.append(tensor.item())
        tensor.fill_(max(tensor.item(), MOST))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    model = model_for("qwen3_5_text")
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})  # padded calls: the model's own code
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            for index, parameter in enumerate(module.parameters()):
                parameter.ds_id, parameter.ds_process_group = index, None
    counts = [0, 0]

    def count(module, args, output):
        counts[0] += 1
        output.register_hook(lambda grad: counts.__setitem__(1, counts[1] + 1))

    first = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    first.in_proj_qkv.register_forward_hook(count)
    call = padded_call(model.config.vocab_size)
    outputs, packed = compare_call(model, *call)
    segments = len(packed["cu_seq_lens_q"]) - 1
    assert segments == 11 and reduces == [segments]
    assert counts == [1 + segments] * 2  # the padded call's one, then one per segment forward and backward
    assert_same(outputs)
    counts[:] = [0, 0]
    with dummy_calls_untied():
        compare_call(model, *call)
    assert counts[0] == 1 + segments and counts[1] < counts[0]  # caught: the backward skips the calls on zeros
    assembly.undo()
