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

Every rank runs the same modules: under FSDP / ZeRO-3 a rank that skips the tower's forward leaves the others waiting
in its all-gather (and DDP finds its parameters unused). So a packed micro-batch without media, in a run of several
processes, runs the tower on a tiny idle image (:class:`IdleTower`) whose output adds exactly zero to the text
embeddings. One process never runs it: nothing waits there, and the forward is the one it always was.

Qwen's mRoPE positions are transformers' own ``get_rope_index``, called for each example alone
(:class:`QwenRopeIndex`), so a packed example sees exactly the positions it sees running alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import BatchError, UnsupportedArchitectureError
from padfree_plugins.modeling.attention import BALANCE_PLAN_KWARG
from padfree_plugins.modeling.families import DeclaredFamily, Trait
from padfree_plugins.modeling.patching import MISSING, ModelPatch, own_attribute, restore_attributes
from padfree_plugins.packing.batch import BOUNDARY_KEYS

#: Keys of the packed row that never reach a vision tower.
TEXT_ROW_KEYS = (*BOUNDARY_KEYS, "seq_idx", "block_sequence_ids", BALANCE_PLAN_KWARG)


@dataclass
class TowerGuard:
    """Forward pre-hooks that drop the packed text row's boundaries from a vision tower's calls, and the
    :class:`IdleTower` of the model (``idle``); in ``patch.handles``: ``remove()`` takes them off."""

    hooks: list = field(default_factory=list)
    idle: IdleTower | None = None
    saved_forward: Any = MISSING  # the base model's own forward attribute before the idle tower's

    @classmethod
    def install(cls, towers: list[torch.nn.Module]) -> TowerGuard:
        guard = cls()
        for tower in towers:
            guard.hooks.append(tower.register_forward_pre_hook(drop_text_row, with_kwargs=True))
        return guard

    def install_idle_tower(self, model: Any, idle_image: Callable[[Any], dict[str, torch.Tensor] | None]) -> None:
        """Make the base model's forward an :class:`IdleTower` (a model without ``get_image_features`` keeps its)."""
        base = getattr(model, "base_model", model)
        if hasattr(base, "get_image_features"):
            self.saved_forward = own_attribute(base, "forward")
            self.idle = IdleTower(base, base.forward, idle_image)
            base.forward = self.idle

    def remove_idle_tower(self) -> None:
        if self.idle is not None and self.idle.module.__dict__.get("forward") is self.idle:
            restore_attributes(self.idle.module, {"forward": self.saved_forward})
        self.idle = None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.remove_idle_tower()


def drop_text_row(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if not any(key in kwargs for key in TEXT_ROW_KEYS):
        return None
    return args, {key: value for key, value in kwargs.items() if key not in TEXT_ROW_KEYS}


def grid_idle_image(model_config: Any) -> dict[str, torch.Tensor] | None:
    """The smallest image of a Qwen-VL tower (its ``vision_config`` has a ``spatial_merge_size`` and a
    ``temporal_patch_size``): one merged cell of zero pixels, grid ``[1, merge, merge]``; ``None`` for other towers."""
    vision = getattr(model_config, "vision_config", None)
    merge, temporal = getattr(vision, "spatial_merge_size", None), getattr(vision, "temporal_patch_size", None)
    patch = getattr(vision, "patch_size", None)
    if None in (merge, temporal, patch):
        return None
    dim = getattr(vision, "in_channels", 3) * temporal * patch ** 2
    return {"pixel_values": torch.zeros(merge * merge, dim), "image_grid_thw": torch.tensor([[1, merge, merge]])}


#: The inputs of a packed micro-batch that feed the vision tower: with none of them, the tower would not run.
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")


def several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded (FSDP2 ``DTensor`` s, DeepSpeed ZeRO-3 ``ds_id``)."""
    from torch.distributed.tensor import DTensor

    parameter = next(module.parameters(), None)
    return isinstance(parameter, DTensor) or hasattr(parameter, "ds_id")


#: The fields of ``get_image_features``' output that a forward with images consumes (Qwen3-VL's deepstack features
#: too); a model output without them counts whole.
FEATURE_FIELDS = ("pooler_output", "deepstack_features")


def zero_sum(output: Any) -> torch.Tensor | int:
    """``0 ×`` the sum of the image features in ``output`` (:data:`FEATURE_FIELDS` of a model output, or every
    floating tensor of a tensor, tuple or list): a term that joins them to the graph and adds exactly zero. Only
    what a forward with images uses: ZeRO-3 counts a module once in backward per output the loss depends on, and
    checks that every rank counted the same."""
    if isinstance(output, torch.Tensor):
        return output.sum() * 0 if output.is_floating_point() else 0
    if isinstance(output, Mapping):
        used = [output[key] for key in FEATURE_FIELDS if output.get(key) is not None]
        values = used or list(output.values())
    else:
        values = output if isinstance(output, (tuple, list)) else ()
    return sum((zero_sum(value) for value in values), 0)


@dataclass
class IdleTower:
    """The vision-language base model's forward (an instance attribute, installed and removed by
    :class:`TowerGuard`): a packed micro-batch without media (no :data:`MEDIA_INPUTS`), in a run of several
    processes, gets its text embeddings computed here plus ``0 ×`` the output of ``get_image_features`` on
    ``idle_image(config)``, passed on as ``inputs_embeds``: the tower (and its projector) run on every rank, every
    micro-batch, and the loss and every gradient are those of the text alone (the tower's are zero). It runs inside
    the forward, after every forward pre-hook (DeepSpeed's), and in the order of a forward with images: the text
    embeddings, then the tower — ZeRO-3 gathers parameters in that order and checks that every rank called the same
    modules. A tower with no idle image refuses such a batch when its parameters are sharded (it would hang), with
    what to do. A plain object, so that the model still pickles."""

    module: Any
    original: Any
    idle_image: Callable[[Any], dict[str, torch.Tensor] | None]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.needs_tower(args, kwargs):
            kwargs = self.with_idle_tower(kwargs)
        return self.original(*args, **kwargs)

    def needs_tower(self, args: tuple, kwargs: dict) -> bool:
        if "cu_seq_lens_q" not in kwargs or args or kwargs.get("input_ids") is None:
            return False  # not a packed call by keyword (generate(), a padded batch): as before patching
        if kwargs.get("inputs_embeds") is not None or any(kwargs.get(key) is not None for key in MEDIA_INPUTS):
            return False
        return several_processes()

    def with_idle_tower(self, kwargs: dict) -> dict:
        module = self.module
        image = self.idle_image(module.config)
        if image is None:
            if sharded(module):
                raise BatchError(
                    f"a packed micro-batch without images reached {type(module).__name__}, whose vision tower is "
                    "sharded: this rank would skip the tower's forward while the others all-gather its parameters "
                    "(a hang), and padfree-plugins has no idle image for this tower. Give every micro-batch an "
                    "image, or give the family's VisionTowers an idle_image")
            return kwargs
        inputs_embeds = module.get_input_embeddings()(kwargs["input_ids"])
        device = inputs_embeds.device
        features = module.get_image_features(**{key: value.to(device) for key, value in image.items()},
                                             return_dict=True)
        return {**kwargs, "input_ids": None, "inputs_embeds": inputs_embeds + zero_sum(features)}


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
    packed attention. ``idle_image(model_config)``: the inputs of ``get_image_features`` the tower runs on when a
    micro-batch has no media (:class:`IdleTower`), ``None`` where there is none; by default a Qwen-VL grid's
    (:func:`grid_idle_image`), other families declare their own (Gemma 3's, Idefics3's tiles, LLaVA-OneVision's)."""

    towers: tuple[str, ...] = ("visual",)
    text_config: str = "text_config"
    idle_image: Callable[[Any], dict[str, torch.Tensor] | None] = grid_idle_image

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
        guard = TowerGuard.install(self.tower_modules(model))
        guard.install_idle_tower(model, self.idle_image)
        return guard


@dataclass(frozen=True)
class VisionLanguage(DeclaredFamily):
    """A vision-language family (see the module docstring): ``architecture`` (whose ``wrap_collator`` packs the
    media) and one :class:`VisionTowers` trait, whose fields it takes (``towers``, ``text_config``,
    ``idle_image``). A family with more traits (a hybrid language model) lists them in a
    :class:`~padfree_plugins.modeling.families.Family`."""

    architecture: Architecture
    towers: tuple[str, ...] = ("visual",)
    text_config: str = "text_config"
    idle_image: Callable[[Any], dict[str, torch.Tensor] | None] = grid_idle_image

    @property
    def traits(self) -> tuple[Trait, ...]:
        return (VisionTowers(self.towers, self.text_config, self.idle_image),)
