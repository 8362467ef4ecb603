"""Families declared once in code, as traits that compose: a family is its
:class:`~padfree_plugins.contract.declarations.Architecture` and the :class:`Trait` s it has — sequence mixers
(:class:`~padfree_plugins.modeling.hybrids.SequenceMixers`), vision towers
(:class:`~padfree_plugins.modeling.vision.VisionTowers`) — each trait's patch step written once, in its own module.

``Family(architecture, traits=(VisionTowers(), SequenceMixers(...)))`` declares a hybrid vision-language family;
:class:`~padfree_plugins.modeling.hybrids.Hybrid` and :class:`~padfree_plugins.modeling.vision.VisionLanguage` are
the families of one trait. Its patch (:meth:`DeclaredFamily.patch`) runs in a fixed order: every trait's ``check``
(in the declared order: a refusal leaves the model untouched), one attention patch
(:meth:`~padfree_plugins.modeling.patching.ModelPatch.apply`, with the options the traits give it), then every
trait's ``install`` in the declared order, each returning a handle that ``patch.undo()`` removes (last installed
first). A failing install undoes what was applied before it. Its plugin module's hooks come from
:meth:`DeclaredFamily.hooks`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.errors import PluginError
from padfree_plugins.modeling.patching import ModelPatch


class Trait:
    """One thing a family has, with its own patch step and undo. A trait is a frozen dataclass; a family has each
    kind of trait at most once, and a trait changes only what it owns (restored by its handle's ``remove()``)."""

    def attention_options(self) -> dict[str, Any]:
        """Keyword arguments of the family's one :meth:`~padfree_plugins.modeling.patching.ModelPatch.apply` that
        this trait decides (``attention_config``, ``has_attention``); two traits may not decide one differently."""
        return {}

    def check(self, model: Any, architecture: Architecture, config: Any) -> None:
        """Refuse, before anything is patched, a model or config this trait cannot make padding-free."""

    def no_shared_prompts(self) -> str:
        """Why a family with this trait can never share a repeated prompt (``prefix_sharing``), ``""`` where it can."""
        return ""

    def install(self, model: Any, patch: ModelPatch, config: Any) -> Any:
        """Apply this trait's step to ``model`` (``patch`` holds its attention patch); return a handle whose
        ``remove()`` undoes the step (``patch.undo()`` calls it)."""
        raise NotImplementedError


def checked_traits(name: str, traits: tuple[Trait, ...]) -> tuple[Trait, ...]:
    """``traits`` of the family ``name``, refused when one is not a :class:`Trait`, a kind of trait comes twice, or
    two traits set one attention option differently."""
    seen: dict[type, Trait] = {}
    options: dict[str, tuple[Any, Trait]] = {}
    for trait in traits:
        if not isinstance(trait, Trait):
            raise PluginError(f"family {name!r}: its traits must be Trait instances (VisionTowers, SequenceMixers, "
                              f"…), not {type(trait).__name__}; declare a family's traits, not families")
        if type(trait) in seen:
            raise PluginError(f"family {name!r} declares {type(trait).__name__} twice ({seen[type(trait)]!r} and "
                              f"{trait!r}): a family has each trait once; put everything it needs in one")
        seen[type(trait)] = trait
        for key, value in trait.attention_options().items():
            if key in options and options[key][0] != value:
                raise PluginError(f"family {name!r}: {type(options[key][1]).__name__} sets {key}={options[key][0]!r} "
                                  f"and {type(trait).__name__} sets {key}={value!r} for its one attention patch; "
                                  "declare traits that agree")
            options[key] = (value, trait)
    return tuple(traits)


class DeclaredFamily:
    """A family with an ``architecture`` and ``traits``; :meth:`patch` applies them (see the module docstring). A
    subclass may still override ``patch(model, backend, fallback, config)`` with a patch of its own."""

    architecture: Any
    traits: tuple[Trait, ...] = ()

    def attention_options(self) -> dict[str, Any]:
        """The traits' options of the family's attention patch, merged."""
        return {key: value for trait in self.traits for key, value in trait.attention_options().items()}

    def patch(self, model: Any, backend: Any, fallback: Any, config: Any) -> ModelPatch:
        traits = checked_traits(self.architecture.name, self.traits)
        for trait in traits:
            trait.check(model, self.architecture, config)
        patch = ModelPatch.apply(model, self.architecture, backend, fallback,
                                 attention_dropout=config.attention_dropout == "keep", **self.attention_options())
        try:
            for trait in traits:
                patch.handles.append(trait.install(model, patch, config))
        except BaseException:
            patch.undo()
            raise
        return patch

    def declared_architecture(self) -> Architecture:
        """The architecture as registered: with the first of its traits' reasons not to share prompts, if any."""
        reason = next((why for trait in self.traits if (why := trait.no_shared_prompts())), "")
        if not reason or self.architecture.no_shared_prompts:
            return self.architecture
        return replace(self.architecture, no_shared_prompts=reason)

    def hooks(self) -> tuple[Any, Any]:
        """The module-level hooks of the family's plugin: ``register_architectures, patch_model = FAMILY.hooks()``."""

        @hookimpl
        def register_architectures():
            return [self.declared_architecture()]

        @hookimpl
        def patch_model(model, architecture, backend, fallback, config):
            if architecture.name != self.architecture.name:
                return None
            return self.patch(model, backend, fallback, config)

        return register_architectures, patch_model


@dataclass(frozen=True)
class Family(DeclaredFamily):
    """A family of any ``traits``, applied in the order given: ``Family(architecture, traits=(VisionTowers(),
    SequenceMixers(("MyGatedDeltaNet",))))``. Refused when declared with a trait twice (see :func:`checked_traits`)."""

    architecture: Architecture
    traits: tuple[Trait, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "traits", checked_traits(self.architecture.name, tuple(self.traits)))
