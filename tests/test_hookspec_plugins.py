"""Throwaway plugins for the hooks no other test plugin implements: ``patch_model``, ``task_forward``,
``trainer_config`` and ``wrap_trainer``. Each is handed to a :class:`PluginHost` as an object with ``@hookimpl``
methods, wins over the builtin answer, and is checked with :func:`padfree_plugins.testing.assert_packed_matches_alone`
(a plugin that gets it wrong fails that check)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from padfree_plugins import ModelPatch, PluginHost, accelerate, hookimpl, load_config, patch_of
from padfree_plugins.testing import assert_packed_matches_alone, example_batch, split_packed, tiny_model


def llama():
    return tiny_model("llama", num_key_value_heads=2)


def drop_boundaries(module, args, kwargs):
    """A pre-hook that loses the packed row's boundaries and positions on the way in (as a broken plugin might)."""
    return args, {k: v for k, v in kwargs.items() if k not in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                                  "max_length_q", "max_length_k")}


class RecordingPatch:
    """``patch_model`` for Llama: the builtin patch, recorded (``forget_attention``: then switched back to sdpa and
    the row's boundaries and positions dropped before the model sees them, so the packed row attends across its
    examples — with the boundaries kept, transformers' own sdpa would find them in the restarting positions, now
    that packed rows run without a cache)."""

    def __init__(self, forget_attention: bool = False) -> None:
        self.patched: list[str] = []
        self.forget_attention = forget_attention

    @hookimpl
    def patch_model(self, model, architecture, backend, fallback, config):
        if architecture.name != "llama":
            return None
        patch = ModelPatch.apply(model, architecture, backend, fallback)
        if self.forget_attention:
            model.set_attn_implementation(patch.previous_implementation)
            patch.handles.append(model.register_forward_pre_hook(drop_boundaries, with_kwargs=True))
        self.patched.append(type(model).__name__)
        return patch


def test_a_patch_model_plugin_wins_and_is_checked():
    plugin = RecordingPatch()
    model = llama()
    report = assert_packed_matches_alone(model, {"task": "hidden_states"}, host=PluginHost({"recording": plugin}))
    assert plugin.patched == ["LlamaModel"] and report.ok
    assert patch_of(model) is None and model.config._attn_implementation == "sdpa"


def test_a_patch_model_plugin_that_leaves_attention_unpatched_fails_the_check():
    plugin = RecordingPatch(forget_attention=True)
    with pytest.raises(AssertionError, match=r"example 1 \(length 7\): packed last_hidden_state differ"):
        assert_packed_matches_alone(llama(), {"task": "hidden_states"}, host=PluginHost({"forgetful": plugin}),
                                    grad_atol=None)
    assert plugin.patched == ["LlamaModel"]


@dataclass(frozen=True)
class CountingForward:
    """A ``task_forward`` answer: the default forward (the packing keys to the model), counted."""

    calls: ClassVar[list[int]] = []
    scale: float = 1.0

    def __call__(self, model: Any, batch: Any, **loss_kwargs: Any) -> Any:
        self.calls.append(int(batch["input_ids"].shape[-1]))
        result = model(**batch.model_inputs(), **loss_kwargs)
        result.last_hidden_state = result.last_hidden_state * self.scale
        return result


class ForwardPlugin:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    @hookimpl
    def task_forward(self, task, architecture, config):
        return CountingForward(self.scale) if task.name == "hidden_states" else None


def test_a_task_forward_plugin_is_what_the_assembly_runs():
    CountingForward.calls.clear()
    model = llama()
    examples = example_batch(model, [3, 1, 8])
    host = PluginHost({"counting": ForwardPlugin()})
    assert_packed_matches_alone(model, {"task": "hidden_states"}, examples, host=host)
    assert CountingForward.calls == [12]  # the packed row, once; the references ran the model directly
    with pytest.raises(AssertionError, match="example 0 .* packed last_hidden_state differ"):
        assert_packed_matches_alone(model, {"task": "hidden_states"}, examples, grad_atol=None,
                                    host=PluginHost({"scaling": ForwardPlugin(scale=1.001)}))


class ToyTrainer:
    """A trainer no builtin wrapper knows: it collates with ``collate`` and computes with ``forward``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.collate = None
        self.forward = None


@dataclass
class ToyTrainerPatch:
    trainer: ToyTrainer

    def undo(self) -> None:
        self.trainer.collate = self.trainer.forward = None


class ToyTrainerPlugin:
    """``trainer_config``: a ToyTrainer trains hidden states; ``wrap_trainer``: it gets the assembly's collator and
    forward."""

    @hookimpl
    def trainer_config(self, trainer, config):
        if not isinstance(trainer, ToyTrainer):
            return None
        return load_config({"task": "hidden_states", "attention": config.attention})

    @hookimpl
    def wrap_trainer(self, trainer, assembly, config):
        if not isinstance(trainer, ToyTrainer):
            return None
        assert config.task == "hidden_states"  # what trainer_config returned
        trainer.collate, trainer.forward = assembly.collator, assembly.forward
        return ToyTrainerPatch(trainer)


def test_trainer_config_and_wrap_trainer_plugins_make_an_unknown_trainer_padding_free():
    model = llama()
    examples = example_batch(model, [1, 7, 7, 4])
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([ex["input_ids"]])).last_hidden_state[0] for ex in examples]
    trainer = ToyTrainer(model)
    acceleration = accelerate(trainer, {"task": "causal_lm", "attention": "exact"},
                              host=PluginHost({"toy-trainer": ToyTrainerPlugin()}))
    try:
        assert acceleration.assembly.plan.task.name == "hidden_states"  # trainer_config's, not the given config's
        assert acceleration.assembly.plan.backend.name == "exact"
        batch = trainer.collate(examples)
        with torch.no_grad():
            packed = trainer.forward(trainer.model, batch).last_hidden_state
        for got, want in zip(split_packed(packed, batch), alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        acceleration.undo()
    assert trainer.collate is None and patch_of(model) is None


def test_without_a_wrap_trainer_plugin_an_unknown_trainer_is_refused():
    from padfree_plugins import PluginError

    model = llama()
    with pytest.raises(PluginError, match="no plugin knows how to make ToyTrainer padding-free"):
        accelerate(ToyTrainer(model), {"task": "hidden_states"})
    assert patch_of(model) is None  # the assembly was undone
