"""What the plugins of models with their own attention code (MPNet, DeBERTa-v2) share.

Such a model computes attention with its own matmuls, not through transformers' ``AttentionInterface``, so its
plugin replaces methods of its modules for packed rows (a padded batch still runs the model's own code). Their
layers pass no keyword arguments down, and sentence-transformers calls the model's ``forward`` itself (past its
hooks), so the boundaries reach the encoder through the one input every call hands the embeddings: the position
ids, which restart at every example; the guard on the base model (and sentence-transformers' guarded call) checks
that they restart exactly at ``cu_seq_lens_q``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from padfree_plugins.errors import BackendUnavailableError, PadfreeError
from padfree_plugins.modeling.patching import (
    PATCH_ATTRIBUTE,
    ModelPatch,
    check_boundaries,
    own_attribute,
    restore_attributes,
)

#: ``attention:`` values these models take: their per-example attention is the only one they can run.
OWN_ATTENTION = ("auto", "exact")


@dataclass
class MethodPatch:
    """Replaced methods of a model's modules and the embeddings' position ids of the current forward; it sits in
    ``patch.handles``: ``remove()`` undoes it."""

    model: Any
    dropout: bool = True
    positions: torch.Tensor | None = None  # from the embeddings' pre-hook until the encoder reads them
    saved: list = field(default_factory=list)

    def targets(self) -> list[tuple[Any, str, Callable]]:
        """``(object, attribute, replacement)`` for every method to replace."""
        raise NotImplementedError

    def install(self) -> MethodPatch:
        for obj, name, value in self.targets():
            self.saved.append((obj, name, own_attribute(obj, name)))
            setattr(obj, name, value)
        return self

    def remove(self) -> None:
        for obj, name, value in reversed(self.saved):
            restore_attributes(obj, {name: value})
        self.saved.clear()
        self.positions = None

    def remember(self, module, args, kwargs) -> None:
        """Pre-hook of the embeddings, which every call path reaches: the row's position ids."""
        self.positions = kwargs.get("position_ids")

    def take_positions(self) -> torch.Tensor | None:
        """The current forward's position ids (read once: a later forward brings its own)."""
        positions, self.positions = self.positions, None
        return positions


def guard(module, args, kwargs) -> None:
    """The base model's pre-hook: a packed row has boundaries where its position ids restart, and no mask."""
    check_boundaries(module, args, kwargs)


def patch_own_attention(model: Any, architecture: Any, backend: Any, fallback: Any, config: Any,
                        methods: Callable[[Any, bool], MethodPatch], why: str) -> ModelPatch:
    """Patch ``model`` with ``methods(model, keep_attention_dropout)``; ``why`` says why no attention backend but
    ``auto`` / ``exact`` can run the model."""
    if getattr(model, PATCH_ATTRIBUTE, None) is not None:
        raise PadfreeError(f"{type(model).__name__} is already patched; undo the first patch before patching again")
    if config.attention not in OWN_ATTENTION:
        raise BackendUnavailableError(f"attention: {config.attention} cannot run {why}; use attention: auto or exact")
    keep = config.attention_dropout == "keep"
    implementation = model.config._attn_implementation  # the attention is the model's own: nothing to switch
    patch = ModelPatch(model, architecture, backend, fallback, implementation, None, attention_dropout=keep)
    replaced = methods(model, keep)
    base = model.base_model
    patch.handles += [base.register_forward_pre_hook(guard, with_kwargs=True),
                      base.embeddings.register_forward_pre_hook(replaced.remember, with_kwargs=True),
                      replaced.install()]
    setattr(model, PATCH_ATTRIBUTE, patch)
    return patch
