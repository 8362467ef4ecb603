"""padfree_plugins.testing's tiny models and example batches."""

from __future__ import annotations

import pytest
import torch
import transformers

from padfree_plugins.testing import (
    DEFAULT_LENGTHS,
    VOCAB,
    example_batch,
    random_examples,
    tiny_config,
    tiny_model,
    vocab_size_of,
)


@pytest.mark.parametrize(("model_type", "task", "cls"), [
    ("llama", "hidden_states", "LlamaModel"),
    ("llama", "causal_lm", "LlamaForCausalLM"),
    ("qwen2", "seq_cls", "Qwen2ForSequenceClassification"),
    ("bert", "base", "BertModel"),
    ("roberta", "seq_cls", "RobertaForSequenceClassification"),
    ("mpnet", "hidden_states", "MPNetModel"),
])
def test_tiny_models_are_small_fp32_eval_and_seeded(model_type, task, cls):
    model = tiny_model(model_type, task)
    assert type(model).__name__ == cls and not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert vocab_size_of(model) == VOCAB and sum(p.numel() for p in model.parameters()) < 500_000
    again = tiny_model(model_type, task)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    other = tiny_model(model_type, task, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_tiny_model_from_a_config_a_class_and_an_attention_implementation():
    config = tiny_config("llama", num_key_value_heads=2)
    model = tiny_model(config, transformers.AutoModelForCausalLM, num_hidden_layers=1, attn_implementation="eager")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 1
    assert model.config._attn_implementation == "eager" and config.num_hidden_layers == 2  # the config is copied
    assert tiny_model("mpnet").config._attn_implementation == "eager"  # no sdpa: transformers' own choice
    with pytest.raises(ValueError, match="no tiny model class for task 'ner'"):
        tiny_model("bert", "ner")


def test_random_examples():
    examples = random_examples()
    assert [len(ex["input_ids"]) for ex in examples] == list(DEFAULT_LENGTHS)
    assert 1 in DEFAULT_LENGTHS and max(DEFAULT_LENGTHS) >= 30
    ids = [i for ex in examples for i in ex["input_ids"]]
    assert min(ids) >= 5 and max(ids) < VOCAB
    assert random_examples([4, 2], seed=3) == random_examples([4, 2], seed=3) != random_examples([4, 2], seed=4)


def test_example_batch_for_a_model():
    model = tiny_model("bert", "seq_cls", vocab_size=300, num_labels=3)
    examples = example_batch(model, [2, 1, 9, 4], labels=True)
    assert [ex["label"] for ex in examples] == [0, 1, 2, 0]
    assert max(i for ex in examples for i in ex["input_ids"]) < 300
    assert example_batch(None, [3]) == random_examples([3])


def listed_model_types() -> dict[str, str]:
    """Every model type an installed plugin declares (what ``padfree-plugins list`` shows) -> its plugin."""
    from padfree_plugins.contract.host import PluginHost

    return {model_type: plugin for model_type, (_, plugin) in PluginHost().architectures().items()}


@pytest.mark.parametrize(("model_type", "plugin"), sorted(listed_model_types().items()))
def test_every_listed_family_has_a_tiny_model(model_type, plugin):
    """Every family builds on CPU (the hybrids' CUDA kernels are optional: their torch paths build and run)."""
    try:
        model = tiny_model(model_type)
    except Exception as error:  # noqa: BLE001 - the failure names the family and what to add
        pytest.fail(f"tiny_model({model_type!r}) (plugin {plugin}) fails: {type(error).__name__}: {error}. Give the "
                    "family a tiny config in padfree_plugins.testing.models.TINY_FAMILIES", pytrace=False)
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 1_500_000, "not tiny: shrink it in TINY_FAMILIES"


def test_family_settings_give_way_to_overrides():
    assert tiny_config("qwen3_moe").num_experts == 4
    assert tiny_config("qwen3_moe", num_experts=8).num_experts == 8
    assert type(tiny_model("siglip_text_model")).__name__ == "SiglipTextModel"  # no AutoModel for it
