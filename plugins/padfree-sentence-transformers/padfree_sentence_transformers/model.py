"""Make a sentence-transformers model padding-free with any attention backend, and undo it.

sentence-transformers 6 can already run text packed: its ``Transformer`` module "flattens" a batch when
``can_flatten_inputs`` is set (its ``data_collator`` turns the tokenized texts into one row with
``cu_seq_lens_q``), and its ``Pooling`` module then reduces that row per text over ``cu_seq_lens_q`` (gather /
``index_add``, no re-padding). It only switches this on for FlashAttention models, and never for a
``CrossEncoder``, whose classification head pools one token per *row*.

:func:`patch_module` switches it on for any backend, reusing all of that:

1. the transformers model inside is patched by padfree-plugins (``padfree_<backend>`` attention, which keeps
   every text to itself through the boundaries) — done by :func:`padfree_plugins.assemble`;
2. the module's flattening switch is set, with padfree-plugins' packing collator (positions from the
   architecture, e.g. from 2 for XLM-R; int32 ``cu_seq_lens``; python-int max lengths, so no device sync);
3. for a ``CrossEncoder`` the module's forward runs the base model packed and the model's own head on every
   text's pooled token (:func:`padfree_plugins.modeling.heads.sequence_logits`).

Everything after the ``Transformer`` module must understand packed features: ``Pooling`` (all its modes,
``include_prompt=False`` too), a ``SparseEncoder``'s ``SpladePooling`` (per text over ``cu_seq_lens_q`` too), and
the modules that act on the pooled vector or per token (``Dense``, ``Normalize``, ``LayerNorm``, ``Dropout``,
``SparseAutoEncoder``). Anything else is refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from padfree_plugins import PackingCollator, assemble, load_config
from padfree_plugins.errors import ConfigError, PadfreeError, UnsupportedArchitectureError
from padfree_plugins.modeling.heads import sequence_logits
from padfree_plugins.modeling.patching import guarded_call, own_attribute, restore_attributes
from padfree_plugins.packing.batch import BOUNDARY_KEYS

#: sentence-transformers modules that work on a packed row (after the Transformer module).
PACKED_SAFE_MODULES = frozenset({"Pooling", "Normalize", "Dense", "LayerNorm", "Dropout", "SpladePooling",
                                 "SparseAutoEncoder"})
#: The Transformer module tasks this integration runs, and the padfree task the inner model is assembled for.
MODULE_TASKS = {"feature-extraction": "hidden_states", "fill-mask": "hidden_states",  # SparseEncoder: MLM logits
                "sequence-classification": "seq_cls"}
#: The attribute of an enabled model that holds its :class:`PadfreeModel`.
ENABLED_ATTRIBUTE = "_padfree_enabled"
_SAVED = ("can_flatten_inputs", "data_collator", "_flatten_position_offset", "model_forward_params", "forward")


def transformer_module(model: Any) -> Any:
    """The first (``Transformer``) module of a ``SentenceTransformer`` / ``CrossEncoder``, checked."""
    from sentence_transformers.base.modules.transformer import Transformer

    if not len(model) or not isinstance(model[0], Transformer):
        first = type(model[0]).__name__ if len(model) else "nothing"
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} starts with {first}, not a sentence-transformers Transformer module: only models "
            "whose first module is a Transformer (not a Router, StaticEmbedding …) can run padding-free"
        )
    module = model[0]
    if module.transformer_task not in MODULE_TASKS:
        raise UnsupportedArchitectureError(
            f"the Transformer module's task is {module.transformer_task!r}; padding-free runs "
            f"{', '.join(MODULE_TASKS)} (SentenceTransformer embeddings, SparseEncoder MLM logits, CrossEncoder "
            "scores)"
        )
    if getattr(module, "_unpad_inputs", None) is False:
        raise ConfigError("this model's Transformer module has unpad_inputs=False (the model cannot take flattened "
                          "inputs); leave it unset to run padding-free")
    for later in list(model)[1:]:
        name = type(later).__name__
        if name not in PACKED_SAFE_MODULES or not type(later).__module__.startswith("sentence_transformers"):
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has a {name} module, which reads padded token embeddings; padding-free "
                f"supports {', '.join(sorted(PACKED_SAFE_MODULES))} after the Transformer module"
            )
    return module


def module_config(config: Any, module: Any) -> Any:
    """The padfree config for the model inside ``module``: the user's, with the task the module implies."""
    config = load_config(config)
    if config.pooling is not None:
        raise ConfigError(
            f"pooling: {config.pooling} in the config: a sentence-transformers model pools with its own Pooling "
            "module, which runs padding-free as configured; remove pooling from the config"
        )
    task = MODULE_TASKS[module.transformer_task]
    if config.sequence_parallel.size > 1:
        trained = "reranker" if task == "seq_cls" else "embedding"
        raise ConfigError(
            f"sequence_parallel.size: {config.sequence_parallel.size}: the sentence-transformers trainers run their "
            "model's own modules on the packed features, which are not split across ranks. Train the transformer "
            f"under sequence parallelism with HF Trainer (task: {trained}, accelerate(trainer, cfg)) or with "
            "assembly.forward in your own loop, or use sequence_parallel.size: 1 here"
        )
    return dataclasses.replace(config, task=task)


@dataclass
class PackedHeadForward:
    """A CrossEncoder Transformer module's forward: per-text head logits on packed features, else the original."""

    module: Any

    def __call__(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if "cu_seq_lens_q" not in features:
            return type(self.module).forward(self.module, features, **kwargs)
        features[self.module.module_output_name] = sequence_logits(self.module.model, features)
        return features


@dataclass
class GuardedForward:
    """An embedding Transformer module's forward with padfree's guard around packed features: sentence-transformers
    calls the model's ``forward`` method itself, which skips the hooks where the guard sits (checked inputs, and
    attention that refuses a layer losing the boundaries)."""

    module: Any

    def __call__(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if "cu_seq_lens_q" not in features:
            return type(self.module).forward(self.module, features, **kwargs)
        with guarded_call(self.module.auto_model, {**features, **kwargs}):
            return type(self.module).forward(self.module, features, **kwargs)


@dataclass
class ModulePatch:
    """The changes :func:`patch_module` made to a Transformer module; :meth:`undo` restores it exactly."""

    module: Any
    saved: dict[str, Any] = field(default_factory=dict)
    active: bool = True

    def undo(self) -> None:
        if not self.active:
            return
        restore_attributes(self.module, self.saved)
        self.active = False


def patch_module(module: Any, collator: Any) -> ModulePatch:
    """Switch the module's flattening on with ``collator``; per-text heads for sequence classification."""
    patch = ModulePatch(module, {name: own_attribute(module, name) for name in _SAVED})
    module.can_flatten_inputs = True
    module.data_collator = collator
    module._flatten_position_offset = 0  # our collator already starts positions where the architecture does
    if module.model_forward_params is not None:
        module.model_forward_params = set(module.model_forward_params) | {"position_ids", *BOUNDARY_KEYS}
    if module.transformer_task == "sequence-classification":
        module.forward = PackedHeadForward(module)  # calls the model itself, through its hooks
    else:
        module.forward = GuardedForward(module)
    return patch


def packing_collator(assembly: Any, config: Any) -> PackingCollator:
    """The collator the module flattens with: positions and limits from the assembly's plan and config."""
    return PackingCollator(position_start=assembly.plan.position_start, max_length=config.max_length,
                           on_overlong=config.on_overlong)


@dataclass
class PerTokenOutputsPadded:
    """A ``SentenceTransformer.encode`` that runs padded when it returns per-token outputs (``output_value=
    "token_embeddings"`` or ``None``): sentence-transformers cuts those per text with an attention mask, which a
    packed row does not have. Sentence embeddings stay packed."""

    model: Any
    module: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        encode = type(self.model).encode
        bound = inspect.signature(encode).bind(self.model, *args, **kwargs)
        if bound.arguments.get("output_value", "sentence_embedding") == "sentence_embedding":
            return encode(self.model, *args, **kwargs)
        flattening = self.module.can_flatten_inputs
        self.module.can_flatten_inputs = False  # the patched model runs a padded batch as it did before
        try:
            return encode(self.model, *args, **kwargs)
        finally:
            self.module.can_flatten_inputs = flattening


@dataclass
class PadfreeModel:
    """A sentence-transformers model made padding-free by :func:`enable`; ``undo()`` (or :func:`disable`)
    restores it (model and module). Also a context manager. It travels with the model: a copy of an enabled model
    is enabled, and ``disable(copy)`` restores the copy."""

    model: Any
    assembly: Any
    patch: ModulePatch
    saved: dict[str, Any] = field(default_factory=dict)
    active: bool = True

    def undo(self) -> None:
        if not self.active:
            return
        self.patch.undo()
        restore_attributes(self.model, self.saved)
        self.assembly.undo()
        self.active = False

    def __enter__(self) -> "PadfreeModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def enable(model: Any, config: Any = None, *, host: Any = None) -> PadfreeModel:
    """Make a ``SentenceTransformer`` or ``CrossEncoder`` padding-free: ``encode()`` / ``predict()`` and
    training (any trainer or loss that calls the model) then run on packed rows with any attention backend.

    ``config``: a padfree config (dict, YAML path, :class:`~padfree_plugins.PadfreeConfig`); ``attention`` picks
    the backend (``exact`` on CPU); the task is implied by the model.
    """
    if getattr(model, ENABLED_ATTRIBUTE, None) is not None:
        raise PadfreeError(f"this {type(model).__name__} is already padding-free (perhaps a copy of an enabled model): "
                           "call padfree_sentence_transformers.disable(model) first")
    module = transformer_module(model)
    config = module_config(config, module)
    assembly = assemble(module.auto_model, config, host=host)
    try:
        patch = patch_module(module, packing_collator(assembly, config))
    except BaseException:
        assembly.undo()
        raise
    enabled = PadfreeModel(model, assembly, patch, {name: own_attribute(model, name)
                                                    for name in ("encode", ENABLED_ATTRIBUTE)})
    if module.transformer_task == "feature-extraction":
        model.encode = PerTokenOutputsPadded(model, module)
    setattr(model, ENABLED_ATTRIBUTE, enabled)
    return enabled


def disable(model: Any) -> None:
    """Undo :func:`enable` on ``model`` (or on a copy of an enabled model, which is enabled too)."""
    enabled = getattr(model, ENABLED_ATTRIBUTE, None)
    if enabled is None:
        raise PadfreeError(f"this {type(model).__name__} is not padding-free: nothing to disable")
    enabled.undo()


def encode(model: Any, inputs: Any, config: Any = None, **kwargs: Any) -> Any:
    """``model.encode(inputs, **kwargs)`` padding-free (the model is restored afterwards)."""
    with enable(model, config):
        return model.encode(inputs, **kwargs)


def predict(model: Any, inputs: Any, config: Any = None, **kwargs: Any) -> Any:
    """``cross_encoder.predict(inputs, **kwargs)`` padding-free (the model is restored afterwards)."""
    with enable(model, config):
        return model.predict(inputs, **kwargs)
