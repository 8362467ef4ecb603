"""A window a model keeps on its attention module but never passes to attention (Qwen2-MoE: its mask alone
carried it) is read from the module: packed equals padded with the window shorter than the examples. Before, the
declared qwen2_moe plugin attended past the window silently on a config with use_sliding_window."""

from __future__ import annotations

import torch

from padfree_plugins import assemble
from tests.conftest import make_examples
from tests.test_decoders import causal_lm, loss_and_grads, padded_batch

WINDOWED = dict(num_key_value_heads=2, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                num_experts_per_tok=2, use_sliding_window=True, sliding_window=4, max_window_layers=2)


def test_qwen2_moe_window_kept_on_the_module_is_honoured():
    model = causal_lm("qwen2_moe", **WINDOWED).train()
    assert model.model.layers[0].self_attn.sliding_window == 4
    examples = make_examples([1, 13, 6, 20, 2, 6], seed=1)
    want_loss, want_grads = loss_and_grads(model, padded_batch(examples))
    unwindowed = causal_lm("qwen2_moe", **{**WINDOWED, "use_sliding_window": False}).train()
    assert (loss_and_grads(unwindowed, padded_batch(examples))[0] - want_loss).abs() > 1e-5  # the window matters
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        got_loss, got_grads = loss_and_grads(model, assembly.forward.inputs(assembly.collator(examples)))
    finally:
        assembly.undo()
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")
