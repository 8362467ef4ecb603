"""Vision-language families: the language model runs the packed row of every example's text and image tokens;
the vision tower keeps its own per-image attention.

A :class:`VisionLanguage` declares a family once: its :class:`~padfree_plugins.contract.declarations.Architecture`
— whose ``wrap_collator``, a :class:`~padfree_plugins.packing.multimodal.MultimodalPacking`, names the media its
processor makes and how positions are computed per example — the sub-config whose attention runs packed
(``text_config``) and the vision towers (attribute paths from the base model): the :class:`VisionTowers` trait,
which a :class:`~padfree_plugins.modeling.families.Family` combines with others. Its ``patch_model`` hook gives the
language model packed attention (the towers keep their implementation) and keeps the packed row's boundaries from
the towers: transformers hands a vision-language forward's ``**kwargs`` to its vision tower, whose blocks would
otherwise take the text row's ``cu_seq_lens_q`` for their own.

Qwen's mRoPE positions are transformers' own ``get_rope_index``, called for each example alone
(:class:`QwenRopeIndex`), so a packed example sees exactly the positions it sees running alone.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import UnsupportedArchitectureError
from padfree_plugins.modeling.families import DeclaredFamily, Trait
from padfree_plugins.modeling.patching import ModelPatch
from padfree_plugins.packing.batch import BOUNDARY_KEYS

#: Keys of the packed row that never reach a vision tower.
TEXT_ROW_KEYS = (*BOUNDARY_KEYS, "seq_idx", "block_sequence_ids")


@dataclass
class TowerGuard:
    """Forward pre-hooks that drop the packed text row's boundaries from a vision tower's calls; in
    ``patch.handles``: ``remove()`` takes them off."""

    hooks: list = field(default_factory=list)

    @classmethod
    def install(cls, towers: list[torch.nn.Module]) -> TowerGuard:
        guard = cls()
        for tower in towers:
            guard.hooks.append(tower.register_forward_pre_hook(drop_text_row, with_kwargs=True))
        return guard

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def drop_text_row(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if not any(key in kwargs for key in TEXT_ROW_KEYS):
        return None
    return args, {key: value for key, value in kwargs.items() if key not in TEXT_ROW_KEYS}


@dataclass(frozen=True)
class QwenRopeIndex:
    """Qwen-VL mRoPE positions ``[3, L]`` of one example, computed as transformers computes them for that example
    alone: the model class's own ``get_rope_index`` on a stand-in that holds the config (it reads nothing else)."""

    model_class: type
    config: Any

    def __call__(self, input_ids: torch.Tensor, token_types: torch.Tensor, grids: dict[str, Any]) -> torch.Tensor:
        owner = SimpleNamespace(config=self.config)
        owner.get_vision_position_ids = lambda *args, **kwargs: self.model_class.get_vision_position_ids(
            owner, *args, **kwargs)
        positions, _ = self.model_class.get_rope_index(owner, input_ids[None], mm_token_type_ids=token_types[None],
                                                        **grids)
        return positions[:, 0]


def nested_attribute(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


@dataclass(frozen=True)
class QwenPositions:
    """``positions`` of a Qwen-VL family's :class:`~padfree_plugins.packing.multimodal.MultimodalPacking`: the
    :class:`QwenRopeIndex` of the model class at ``model_class`` (a dotted path, imported when assembling)."""

    model_class: str

    def __call__(self, model_config: Any) -> QwenRopeIndex:
        module, _, name = self.model_class.rpartition(".")
        return QwenRopeIndex(getattr(importlib.import_module(module), name), model_config)


@dataclass(frozen=True)
class VisionTowers(Trait):
    """The trait of a vision-language family: the vision ``towers`` (attribute paths from the base model) keep
    their own attention and never see the packed text row's boundaries; only the sub-config ``text_config`` gets
    packed attention."""

    towers: tuple[str, ...] = ("visual",)
    text_config: str = "text_config"

    def tower_modules(self, model: Any) -> list[Any]:
        base = getattr(model, "base_model", model)
        return [nested_attribute(base, path) for path in self.towers]

    def attention_options(self) -> dict[str, Any]:
        return {"attention_config": self.text_config}

    def check(self, model: Any, architecture: Architecture, config: Any) -> None:
        towers = self.tower_modules(model)
        if not towers or any(tower is None for tower in towers):
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has no vision tower at {', '.join(self.towers)} where the "
                f"{architecture.name} plugin looks for it: this transformers version changed the model; "
                "padfree-plugins refuses rather than let the tower see the packed text row")

    def install(self, model: Any, patch: ModelPatch, config: Any) -> TowerGuard:
        return TowerGuard.install(self.tower_modules(model))


@dataclass(frozen=True)
class VisionLanguage(DeclaredFamily):
    """A vision-language family (see the module docstring): ``architecture`` (whose ``wrap_collator`` packs the
    media) and one :class:`VisionTowers` trait, whose fields it takes (``towers``, ``text_config``). A family with
    more traits (a hybrid language model) lists them in a :class:`~padfree_plugins.modeling.families.Family`."""

    architecture: Architecture
    towers: tuple[str, ...] = ("visual",)
    text_config: str = "text_config"

    @property
    def traits(self) -> tuple[Trait, ...]:
        return (VisionTowers(self.towers, self.text_config),)
