"""Hybrid families: attention layers (through transformers' ``AttentionInterface``, as for any decoder) beside
sequence-mixer layers — a gated delta rule, KDA, a Mamba1 / Mamba2 scan — that carry state along the sequence.

A :class:`Hybrid` declares a family once: its :class:`~padfree_plugins.contract.declarations.Architecture`, the
class names of its mixer modules, and the CUDA packages through which transformers runs those mixers with the
example boundaries (none where no package takes them) — the :class:`SequenceMixers` trait, which a
:class:`~padfree_plugins.modeling.families.Family` combines with others. Its hooks patch the attention as usual and
route every mixer through :class:`~padfree_plugins.modeling.mixers.PackedMixer` (``mixers:`` in the config picks the
backend; see :mod:`padfree_plugins.modeling.mixers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.errors import UnsupportedArchitectureError
from padfree_plugins.modeling.families import DeclaredFamily, Trait
from padfree_plugins.modeling.mixers import MixerPatch, check_mixer_backend
from padfree_plugins.modeling.patching import ModelPatch

#: The chunk transformers' torch gated delta rule (and KDA's) pads every call to.
GATED_DELTA_CHUNK = 64
#: transformers' routes that take the boundaries: the gated delta rule (``cu_seqlens``) and the conv (``seq_idx``).
GATED_DELTA_KERNELS = ("fla", "causal_conv1d")
#: Mamba2's chunked scan and fused conv + scan (``seq_idx``).
MAMBA2_KERNELS = ("mamba_ssm", "causal_conv1d")
#: Why Mamba1 mixers (Mamba, FalconMamba, Jamba) cannot share prompts.
MAMBA1_NO_PROMPT_STATE = ("transformers' Mamba1 selective scan (mamba_selective_scan) takes no initial SSM state, so "
                          "a completion's scan cannot continue from its prompt's")


@dataclass(frozen=True)
class SequenceMixers(Trait):
    """The trait of a family with sequence mixers: ``mixers`` are the class names of its sequence-mixer modules;
    ``kernels`` the import names of the packages its boundary-aware CUDA route needs (``()``: none, every packed
    call runs ``exact``); ``chunk``: the chunk the mixers' torch code pads every call to — an int, or the name of the
    mixer attribute that holds it (1: a sequential scan); examples spanning as many chunks then run as one batch.
    ``has_attention``: ``False`` for attention-free families (Mamba), whose attention implementation is left
    alone. Mixers that get no boundaries from their layers (Jamba's, Mamba's) read the packed row of the
    forward, also when gradient checkpointing recomputes them. ``no_prompt_state``: why the mixers' torch code cannot
    start a completion from its prompt's state (``""``: it can, through its cache, so prompts are shared; see
    :func:`~padfree_plugins.modeling.mixers.run_shared`)."""

    mixers: tuple[str, ...]
    kernels: tuple[str, ...] = ()
    has_attention: bool = True
    chunk: int | str = 1
    no_prompt_state: str = ""

    def chunk_of(self, module: Any) -> int:
        """The chunk ``module``'s torch code pads every call to: ``chunk``, or the module's attribute it names."""
        value = getattr(module, self.chunk, 1) if isinstance(self.chunk, str) else self.chunk
        return value if isinstance(value, int) and value > 0 else 1

    def mixer_modules(self, model: Any) -> list[Any]:
        return [module for module in model.modules() if type(module).__name__ in self.mixers]

    def attention_options(self) -> dict[str, Any]:
        return {} if self.has_attention else {"has_attention": False}

    def no_shared_prompts(self) -> str:
        if not self.no_prompt_state:
            return ""
        return f"its sequence mixers cannot start a completion from its prompt's state ({self.no_prompt_state})"

    def check(self, model: Any, architecture: Architecture, config: Any) -> None:
        check_mixer_backend(config.mixers, architecture.name, self.kernels)
        if not self.mixer_modules(model):
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has none of the sequence-mixer modules the {architecture.name} plugin "
                f"knows ({', '.join(self.mixers)}): this transformers version changed them; padfree-plugins "
                "refuses rather than run an unknown mixer across examples")

    def install(self, model: Any, patch: ModelPatch, config: Any) -> MixerPatch:
        return MixerPatch.install(model, self.mixer_modules(model), config.mixers, self.kernels, self.chunk_of,
                                  self.no_prompt_state)


@dataclass(frozen=True)
class Hybrid(DeclaredFamily):
    """A hybrid family: its ``architecture`` and one :class:`SequenceMixers` trait, whose fields it takes
    (``mixers``, ``kernels``, ``has_attention``, ``chunk``, ``no_prompt_state``). A family with more traits (a hybrid
    vision-language model) lists them in a :class:`~padfree_plugins.modeling.families.Family`."""

    architecture: Architecture
    mixers: tuple[str, ...]
    kernels: tuple[str, ...] = ()
    has_attention: bool = True
    chunk: int | str = 1
    no_prompt_state: str = ""

    @property
    def traits(self) -> tuple[Trait, ...]:
        return (SequenceMixers(self.mixers, self.kernels, self.has_attention, self.chunk, self.no_prompt_state),)

    def chunk_of(self, module: Any) -> int:
        return self.traits[0].chunk_of(module)

    def mixer_modules(self, model: Any) -> list[Any]:
        return self.traits[0].mixer_modules(model)
