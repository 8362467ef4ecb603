"""A plugin for a new trainer, written from docs/writing-a-plugin.md alone: the code block of its section "A plugin
for a new trainer" is run as a plugin module, untouched, and the custom ``Trainer`` subclass it wraps trains
padding-free with its padded loss curve. Nothing in the framework knows that trainer."""

from __future__ import annotations

import re
import tempfile
import types
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from padfree_plugins import PluginError, PluginHost, accelerate
from tests.conftest import tiny_config
from tests.test_trainer import STEPS, assert_same_curve, losses, padded_collator, rows

DOCS = Path(__file__).resolve().parents[1] / "docs" / "writing-a-plugin.md"


def plugin_from_docs() -> types.ModuleType:
    """The python code block of the docs' trainer-plugin section, executed as a module."""
    text = DOCS.read_text()
    section = text.split("## A plugin for a new trainer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section should hold exactly one python example"
    module = types.ModuleType("weighted_loss_plugin")
    exec(compile(blocks[0], str(DOCS), "exec"), module.__dict__)
    return module


def weighted_trainer(plugin: types.ModuleType, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2), attn_implementation="sdpa")
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                    per_device_eval_batch_size=5, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                    report_to="none", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    settings.update(overrides)
    return plugin.WeightedLossTrainer(model=model, args=TrainingArguments(**settings),
                                      train_dataset=datasets.Dataset.from_list(rows()),
                                      eval_dataset=datasets.Dataset.from_list(rows(13, seed=1)),
                                      data_collator=padded_collator(), loss_weight=2.5)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_trainer_plugin_from_the_docs_trains_the_padded_curve(accumulation):
    plugin = plugin_from_docs()
    padded = weighted_trainer(plugin, gradient_accumulation_steps=accumulation)
    padded.train()
    packed = weighted_trainer(plugin, gradient_accumulation_steps=accumulation)
    acceleration = accelerate(packed, {"task": "causal_lm"}, host=PluginHost({"weighted": plugin}))
    assert type(acceleration.trainer_patch).__name__ == "WeightedLossPatch"
    assert acceleration.describe()["wrapper"] == "WeightedLossPatch (plugin weighted)"
    packed.train()
    assert_same_curve(losses(packed), losses(padded))
    assert packed.evaluate()["eval_loss"] == pytest.approx(padded.evaluate()["eval_loss"], abs=1e-5)
    unweighted = losses(padded)[0] / 2.5
    assert 2.0 < unweighted < 8.0, "the weight must reach the loss: a tiny Llama starts near log(vocab)"


def test_without_the_plugin_the_trainer_is_refused_and_left_alone():
    plugin = plugin_from_docs()
    trainer = weighted_trainer(plugin)
    collator, model = trainer.data_collator, trainer.model
    with pytest.raises(PluginError, match="no plugin knows how to make WeightedLossTrainer padding-free"):
        accelerate(trainer, {"task": "causal_lm", "plugins": {"block": ["any_trainer"]}})  # the fallback blocked
    assert trainer.data_collator is collator and "compute_loss" not in vars(trainer)
    assert model.config._attn_implementation == "sdpa"
