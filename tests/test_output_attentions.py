"""``output_attentions=True``: a patched model returns the attention weights of an ordinary padded batch as its
eager implementation did before patching; on a packed row, where the ``[T, T]`` weights are never built, it is an
error rather than an empty tuple."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import BoundaryError, assemble
from padfree_plugins.packing.padded import pad_examples
from tests.conftest import make_examples, tiny_model


@pytest.mark.parametrize("model_type,head", [("llama", "causal_lm"), ("bert", "base")])
def test_padded_batch_attention_weights_are_as_before_patching(model_type, head):
    model = tiny_model(model_type, head, attn_implementation="eager")
    batch = pad_examples(make_examples([4, 7]), pad_token_id=1)
    with torch.no_grad():
        want = model(**batch, output_attentions=True).attentions
        assembly = assemble(model, {"task": "causal_lm" if head == "causal_lm" else "hidden_states"})
        try:
            got = model(**batch, output_attentions=True).attentions
        finally:
            assembly.undo()
    assert len(want) == len(got) == model.config.num_hidden_layers
    for layer, (w, g) in enumerate(zip(want, got)):
        real = batch["attention_mask"].bool()[:, None, :, None] & batch["attention_mask"].bool()[:, None, None, :]
        torch.testing.assert_close(g * real, w * real, atol=1e-6, rtol=1e-5, msg=lambda m: f"layer {layer}: {m}")


def test_packed_row_refuses_output_attentions():
    model = tiny_model("llama", "causal_lm", attn_implementation="eager")
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        batch = assembly.collator(make_examples([3, 5]))
        with torch.no_grad(), pytest.raises(BoundaryError, match="output_attentions=True on a packed row"):
            model(**batch.model_inputs(), output_attentions=True)
    finally:
        assembly.undo()


def test_a_models_own_mask_function_is_kept_on_ordinary_calls():
    """An ordinary (unpacked) call of a patched model gets sdpa's mask, the model's own mask functions included,
    even without an attention_mask (it returned None then, dropping e.g. a chain-aware and_mask_function)."""
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    from padfree_plugins.modeling.attention import padfree_mask

    chains = torch.tensor([0] * 3 + [1] * 4)
    same_chain = and_masks(causal_mask_function, lambda b, h, q, kv: chains[q] == chains[kv])
    want = sdpa_mask(batch_size=1, q_length=7, kv_length=7, mask_function=same_chain, attention_mask=None,
                     allow_is_causal_skip=False, use_vmap=True)
    got = padfree_mask(batch_size=1, q_length=7, kv_length=7, mask_function=same_chain, attention_mask=None,
                       allow_is_causal_skip=False, use_vmap=True)
    assert want is not None and torch.equal(got, want) and not bool(got[0, 0, 5, 1])
