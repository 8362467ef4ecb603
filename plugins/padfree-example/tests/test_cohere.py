"""The equivalence test: a packed forward of a tiny Cohere model equals every example run alone.

This is the test that makes an architecture plugin trustworthy; copy it for your own plugin and change the
constants below. It needs no download (the model is built from a config with random weights) and runs on CPU
in a few seconds: ``pip install -e . && pytest``. The check itself is
:func:`padfree_plugins.testing.assert_packed_matches_alone`: outputs per example and every parameter's gradient.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import padfree_plugins
from padfree_plugins.testing import (
    assert_packed_matches_alone,
    leak_across_boundaries,
    output_of,
    random_examples,
    run_alone,
    tiny_model,
)

PLUGIN = "cohere"  # the entry-point name in pyproject.toml
MODEL_TYPE = "cohere"  # transformers' config.model_type
TINY = dict(num_key_value_heads=2)  # 2 layers, d=64, 4 query heads and 2 key/value heads: GQA is exercised
LENGTHS = [1, 7, 7, 30, 3]  # a one-token example, equal lengths, one long example
ATOL = 1e-5  # fp32, eval mode: packed and alone differ by rounding only


def test_plugin_is_discovered():
    host = padfree_plugins.PluginHost()
    record = host.records.get(PLUGIN)
    assert record is not None, f"no plugin {PLUGIN!r} found: install this package first (pip install -e .)"
    assert record.status == "ok", record.error
    assert host.architectures()[MODEL_TYPE][1] == PLUGIN


#: The model classes users train, with the task each is assembled for.
MODEL_CLASSES = [(transformers.AutoModel, "hidden_states"), (transformers.AutoModelForCausalLM, "causal_lm")]


@pytest.mark.parametrize("model_class, task", MODEL_CLASSES)
def test_packed_forward_equals_each_example_alone(model_class, task):
    """The model classes users train: hidden states (embeddings, custom heads) and causal-LM logits (SFT).

    Every example's packed outputs within ``ATOL`` (absolute: ``rtol=0``) of the example run alone through the
    unpatched model, and every parameter's gradient as the sum over the examples alone (default tolerances)."""
    model = tiny_model(MODEL_TYPE, task=model_class, attn_implementation="sdpa", **TINY)  # a task name or a class
    examples = random_examples(LENGTHS)
    report = assert_packed_matches_alone(model, {"task": task}, examples, atol=ATOL, rtol=0, plugin=PLUGIN)
    assert report.parameters_compared > 5, report

    # The test can fail: the same row without boundaries, through the unpatched model, mixes the examples ...
    with torch.no_grad():
        _, mixed = output_of(model(input_ids=torch.tensor([sum((ex["input_ids"] for ex in examples), [])])))
        _, alone = output_of(run_alone(model, examples[1]))
    assert not torch.allclose(mixed[0, 1:8], alone[0], atol=1e-3)
    # ... and so does a patched model that leaks 1e-3 of the previous example's last token into each first token.
    with leak_across_boundaries(model, strength=1e-3), pytest.raises(AssertionError, match="example 1"):
        assert_packed_matches_alone(model, {"task": task}, examples, atol=ATOL, rtol=0, grad_atol=None)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
