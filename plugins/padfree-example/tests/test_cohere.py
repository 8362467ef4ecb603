"""The equivalence test: a packed forward of a tiny Cohere model equals every example run alone.

This is the test that makes an architecture plugin trustworthy; copy it for your own plugin and change the
constants below. It needs no download (the model is built from a config with random weights) and runs on CPU
in a few seconds: ``pip install -e . && pytest``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import padfree_plugins

PLUGIN = "cohere"  # the entry-point name in pyproject.toml
MODEL_TYPE = "cohere"  # transformers' config.model_type
LENGTHS = [1, 7, 7, 30, 3]  # a one-token example, equal lengths, one long example
ATOL = 1e-5  # fp32, eval mode: packed and alone differ by rounding only


def tiny_model(model_class=transformers.AutoModel):
    """A randomly initialised 2-layer model (GQA: 4 query heads, 2 key/value heads), fp32, eval mode."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        MODEL_TYPE, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    return model_class.from_config(config, attn_implementation="sdpa").eval()


def output(result):
    """What the model class computes per token: hidden states for AutoModel, logits for a causal LM."""
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def make_examples(lengths, seed=0):
    """Tokenized examples as a dataset yields them: one dict per example, no padding."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, 128, (n,), generator=generator).tolist()} for n in lengths]


def test_plugin_is_discovered():
    host = padfree_plugins.PluginHost()
    record = host.records.get(PLUGIN)
    assert record is not None, f"no plugin {PLUGIN!r} found: install this package first (pip install -e .)"
    assert record.status == "ok", record.error
    assert host.architectures()[MODEL_TYPE][1] == PLUGIN


#: The model classes users train, with the task each is assembled for.
MODEL_CLASSES = [(transformers.AutoModel, "hidden_states"), (transformers.AutoModelForCausalLM, "causal_lm")]


@pytest.mark.parametrize("model_class, task", MODEL_CLASSES)
@torch.no_grad()
def test_packed_forward_equals_each_example_alone(model_class, task):
    """The model classes users train: hidden states (embeddings, custom heads) and causal-LM logits (SFT)."""
    model = tiny_model(model_class)
    examples = make_examples(LENGTHS)
    # The reference: every example alone through the unpatched model.
    expected = [output(model(input_ids=torch.tensor([ex["input_ids"]])))[0] for ex in examples]

    assembly = padfree_plugins.assemble(model, {"task": task})
    try:
        assert assembly.plan.architecture_plugin == PLUGIN, assembly.plan.describe()
        batch = assembly.collator(examples)  # one row [1, T] with cu_seq_lens_q / position_ids per example
        packed = output(model(**batch.model_inputs()))  # [1, T, H] or [1, T, vocab]
    finally:
        assembly.undo()

    cu = batch["cu_seq_lens_q"].tolist()
    assert packed.shape[:2] == (1, cu[-1])
    for i, want in enumerate(expected):
        got = packed[0, cu[i] : cu[i + 1]]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"example {i} of {LENGTHS}: {m}")

    # The test can fail: the same row without boundaries, through the unpatched model, mixes the examples.
    mixed = output(model(input_ids=batch["input_ids"]))
    assert not torch.allclose(mixed[0, cu[1] : cu[2]], expected[1], atol=1e-3)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
