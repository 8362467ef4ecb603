"""Families as traits that compose (:mod:`padfree_plugins.modeling.families`): a family declared with the sequence
mixers and the vision towers applies both steps — each exactly as the one-trait family (``Hybrid``,
``VisionLanguage``) applies it — and undoes both; traits run in the declared order (every check before anything is
patched, then one attention patch, then every install); a failing install undoes what came before it; a trait
declared twice, a family given as a trait, or traits that disagree on the attention patch are refused at
declaration."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from padfree_plugins import patch_of
from padfree_plugins.builtin.architectures.qwen3_5_vl import QWEN3_5_VL
from padfree_plugins.builtin.backends import register_attention_backends
from padfree_plugins.config.schema import PadfreeConfig
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import PluginError, UnsupportedArchitectureError
from padfree_plugins.modeling.families import DeclaredFamily, Family, Trait
from padfree_plugins.modeling.hybrids import Hybrid, SequenceMixers
from padfree_plugins.modeling.mixers import MixerPatch, PackedMixer
from padfree_plugins.modeling.vision import TowerGuard, VisionLanguage, VisionTowers, drop_text_row
from tests.conftest import tiny_model

EXACT = next(backend for backend in register_attention_backends() if backend.name == "exact")
LLAMA = Architecture("llama", model_types=("llama",), kind="decoder")


def patched_state(model) -> dict:
    """What a patch changed on ``model``: the routed mixers (with their backend, kernels and chunk), the modules
    whose forward drops the packed row's boundaries, and the attention of the text and vision configs."""
    return {
        "mixers": sorted((name, module.forward.backend, module.forward.kernels, module.forward.chunk)
                         for name, module in model.named_modules()
                         if isinstance(module.__dict__.get("forward"), PackedMixer)),
        "guarded": sorted(name for name, module in model.named_modules()
                          if any(hook is drop_text_row for hook in module._forward_pre_hooks.values())),
        "text_attention": model.config.text_config._attn_implementation,
        "vision_attention": model.config.vision_config._attn_implementation,
    }


@pytest.fixture(scope="module")
def qwen3_5_vl_model():
    pytest.importorskip("PIL")
    from padfree_plugins.testing.vision import image_text_processor, tiny_vision_language_model

    return tiny_vision_language_model("qwen3_5", image_text_processor("qwen3_5"))


def test_a_family_of_mixers_and_towers_patches_each_as_its_one_trait_family_and_undoes_both(qwen3_5_vl_model):
    """Qwen3.5's multimodal family lists two traits: its patch routes the same mixers, with the same backend,
    kernels and chunk, as ``Hybrid`` of those mixers, guards the same towers and packs the same attention as
    ``VisionLanguage``; ``undo()`` restores the model as it was."""
    towers, mixers = QWEN3_5_VL.traits
    assert (type(towers), type(mixers)) == (VisionTowers, SequenceMixers)
    config = PadfreeConfig()
    before = patched_state(qwen3_5_vl_model)

    def state_after(family):
        model = copy.deepcopy(qwen3_5_vl_model)
        patch = family.patch(model, EXACT, None, config)
        state = {**patched_state(model), "steps": [type(handle) for handle in patch.handles[-2:]]}
        patch.undo()
        assert patched_state(model) == before and patch_of(model) is None
        return state

    both = state_after(QWEN3_5_VL)
    hybrid = state_after(Hybrid(QWEN3_5_VL.architecture, mixers.mixers, mixers.kernels, chunk=mixers.chunk))
    vision = state_after(VisionLanguage(QWEN3_5_VL.architecture, towers.towers, towers.text_config))
    assert both["mixers"] == hybrid["mixers"] and len(both["mixers"]) == 1
    assert both["mixers"][0][1:] == ("auto", ("fla", "causal_conv1d"), 64)
    assert both["guarded"] == vision["guarded"] == ["model.visual"]
    assert (both["text_attention"], both["vision_attention"]) == (vision["text_attention"], "sdpa")
    assert both["text_attention"] != "sdpa"
    assert both["steps"] == [TowerGuard, MixerPatch]  # in the declared order, after the attention patch's own
    assert before == {"mixers": [], "guarded": [], "text_attention": "sdpa", "vision_attention": "sdpa"}


@dataclass(frozen=True)
class Recording(Trait):
    """A trait that records its check and install in ``log`` (and removal of its handle); ``fail`` names the step
    that raises."""

    log: list
    fail: str = ""

    def check(self, model, architecture, config):
        self.log.append(("check", type(self).__name__, patch_of(model) is not None))
        if self.fail == "check":
            raise UnsupportedArchitectureError(f"{type(self).__name__} refuses")

    def install(self, model, patch, config):
        self.log.append(("install", type(self).__name__, patch_of(model) is patch))
        if self.fail == "install":
            raise UnsupportedArchitectureError(f"{type(self).__name__} fails")
        return Removal(self.log, type(self).__name__)


@dataclass(frozen=True)
class First(Recording):
    pass


@dataclass(frozen=True)
class Second(Recording):
    pass


@dataclass
class Removal:
    log: list
    name: str

    def remove(self):
        self.log.append(("remove", self.name))


def test_traits_run_in_the_declared_order_checks_first_and_undo_removes_each():
    log: list = []
    model = tiny_model("llama")
    patch = Family(LLAMA, traits=(Second(log), First(log))).patch(model, EXACT, None, PadfreeConfig())
    assert log == [("check", "Second", False), ("check", "First", False),  # before the attention patch
                   ("install", "Second", True), ("install", "First", True)]
    assert model.config._attn_implementation != "sdpa"
    patch.undo()
    assert log[4:] == [("remove", "First"), ("remove", "Second")]  # last installed first
    assert model.config._attn_implementation == "sdpa" and patch_of(model) is None


def test_a_refused_check_leaves_the_model_unpatched():
    log: list = []
    model = tiny_model("llama")
    with pytest.raises(UnsupportedArchitectureError, match="Second refuses"):
        Family(LLAMA, traits=(First(log), Second(log, fail="check"))).patch(model, EXACT, None, PadfreeConfig())
    assert [step[0] for step in log] == ["check", "check"]
    assert model.config._attn_implementation == "sdpa" and patch_of(model) is None


def test_a_failing_install_undoes_the_attention_patch_and_the_traits_before_it():
    log: list = []
    model = tiny_model("llama")
    with pytest.raises(UnsupportedArchitectureError, match="Second fails"):
        Family(LLAMA, traits=(First(log), Second(log, fail="install"))).patch(model, EXACT, None, PadfreeConfig())
    assert log[-1] == ("remove", "First")
    assert model.config._attn_implementation == "sdpa" and patch_of(model) is None
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_trait_declared_twice_is_refused():
    with pytest.raises(PluginError, match="'qwen3_5_vl' declares VisionTowers twice"):
        Family(QWEN3_5_VL.architecture, traits=(VisionTowers(), *QWEN3_5_VL.traits))
    with pytest.raises(PluginError, match="SequenceMixers twice"):
        Family(LLAMA, traits=(SequenceMixers(("A",)), SequenceMixers(("B",))))


def test_a_family_given_as_a_trait_is_refused():
    with pytest.raises(PluginError, match="Trait instances .* not Hybrid"):
        Family(LLAMA, traits=(Hybrid(LLAMA, ("Mixer",)),))


def test_traits_that_disagree_on_the_attention_patch_are_refused():
    @dataclass(frozen=True)
    class OtherText(Trait):
        def attention_options(self):
            return {"attention_config": "language_config"}

    with pytest.raises(PluginError, match="VisionTowers sets attention_config='text_config' and OtherText sets"):
        Family(LLAMA, traits=(VisionTowers(), OtherText()))


def test_the_one_trait_families_keep_their_spellings():
    """``Hybrid`` and ``VisionLanguage`` as plugins declare them (positional fields included) are the families of
    one trait, with the same fields; a ``DeclaredFamily`` subclass with a patch of its own still has it called."""
    hybrid = Hybrid(LLAMA, ("Mixer",), ("fla",), False, "chunk_size")
    assert hybrid.traits == (SequenceMixers(("Mixer",), ("fla",), has_attention=False, chunk="chunk_size"),)
    assert hybrid.attention_options() == {"has_attention": False}
    assert hybrid.chunk_of(torch.nn.Module()) == 1
    vision = VisionLanguage(LLAMA, ("vision_tower",))
    assert vision.traits == (VisionTowers(("vision_tower",)),)
    assert vision.attention_options() == {"attention_config": "text_config"}

    class Own(DeclaredFamily):
        architecture = LLAMA

        def patch(self, model, backend, fallback, config):
            return "own patch"

    _, patch_model = Own().hooks()
    assert patch_model(None, LLAMA, EXACT, None, PadfreeConfig()) == "own patch"
