"""The padfree-plugins hook: ``padfree_plugins.accelerate(trainer, cfg)`` for sentence-transformers trainers.

``SentenceTransformerTrainer``, ``SparseEncoderTrainer`` and ``CrossEncoderTrainer`` (and subclasses) are
recognised; any other trainer gets ``None`` so that the next plugin answers. The trainer itself is left alone: its
data collator tokenizes through ``model.preprocess``, which — once the model's Transformer module is patched
(:mod:`.model`) — packs every column into one row; its losses call the model, whose Pooling module pools per text
and whose CrossEncoder head scores per text. Other models a loss calls on those features (``GISTEmbedLoss``'s
guide) are made padding-free too, and the few losses that read the features themselves are fixed or refused
(:mod:`.losses`).
With ``batching.strategy: tokens`` the training batches are filled up to a token budget (:mod:`.batching`);
accelerate's ``dispatch_batches`` is kept off, as for HF ``Trainer``
(:class:`padfree_plugins.integrations.base.WholeBatches`).
``undo()`` restores the modules and the trainer (``accelerate``'s own ``undo`` restores the model's attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from padfree_plugins import PadfreeError, hookimpl, unwrap_model
from padfree_plugins.batching.sampler import uses_token_budget
from padfree_plugins.integrations.base import WholeBatches

from .batching import BatchSamplerPatch, check_config
from .losses import loss_modules, patch_losses
from .model import enable, module_config, packing_collator, patch_module, transformer_module

TRAINERS = ("SentenceTransformerTrainer", "SparseEncoderTrainer", "CrossEncoderTrainer")


def trainer_kind(trainer: Any) -> str | None:
    """The sentence-transformers trainer class ``trainer`` is (or derives from), or ``None``."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in TRAINERS and cls.__module__.startswith("sentence_transformers"):
            return cls.__name__
    return None


@dataclass
class TrainerPatches:
    """Everything :func:`wrap_trainer` changed; :meth:`undo` reverts it, last change first."""

    patches: list

    def undo(self) -> None:
        for patch in reversed(self.patches):
            patch.undo()


@hookimpl
def trainer_config(trainer, config):
    """The user's config with the task the model's Transformer module implies (embedding, seq_cls …)."""
    if trainer_kind(trainer) is None:
        return None
    return module_config(config, transformer_module(trainer.model))


@hookimpl
def wrap_trainer(trainer, assembly, config):
    if trainer_kind(trainer) is None:
        return None
    model = trainer.model
    module = transformer_module(model)
    config = module_config(config, module)  # as trainer_config made it, for a caller that skipped that hook
    check_config(config)
    if unwrap_model(model) is not assembly.model:
        raise PadfreeError("the assembly was built for another model than trainer.model")
    patches = [patch_losses(trainer)]
    try:
        patches.append(patch_module(module, packing_collator(assembly, config)))
        for companion in companion_models(trainer):  # packed features reach it too: it must run padding-free
            patches.append(enable(companion, config))
        if uses_token_budget(config):
            patches.append(BatchSamplerPatch.apply(trainer, model, config))
        whole_batches = WholeBatches.apply(trainer)  # accelerate's dispatching would slice the packed columns
        if whole_batches is not None:
            patches.append(whole_batches)
    except BaseException:
        TrainerPatches(patches).undo()
        raise
    return TrainerPatches(patches)


def companion_models(trainer: Any) -> list:
    """The other sentence-transformers models the trainer's losses call, e.g. ``GISTEmbedLoss``'s guide: the loss
    hands it the trained model's (packed) features unless it re-tokenizes, so it is made padding-free as well."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    found: dict[int, Any] = {}
    for module in loss_modules(trainer):
        if isinstance(module, (SentenceTransformer, CrossEncoder)) and module is not trainer.model:
            found.setdefault(id(module), module)
    return list(found.values())
