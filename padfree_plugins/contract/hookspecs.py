"""The hooks a padfree-plugins plugin can implement.

Two kinds of hooks:

* **Declarations** (``register_*``) return lists of :mod:`padfree_plugins.contract.declarations` objects. Every
  plugin's results
  are collected; when two plugins declare the same name, the host picks one deterministically and records a note.
* **Assembly hooks** (``collate``, ``patch_model``, ``pool``, ``revert_output``, ``task_forward``,
  ``trainer_config``, ``wrap_trainer``) are ``firstresult``: the first plugin that returns something other than
  ``None`` wins. They run once, when a model is assembled (or a trainer wrapped), and return plain picklable
  objects; nothing calls a hook in the training loop.

Order: pluggy asks later-registered plugins first, and ``trylast`` ones after all others. The generic builtin
answers (plugin ``core``) are ``trylast``, so any plugin that answers wins over them. A plugin that handles only
some tasks or architectures (the builtin ``seq_cls``, ``reranker``, ``embedding`` included) implements plain hooks
that return ``None`` for what is not theirs — ``if task.name != "mine": return None``.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("padfree_plugins")
hookimpl = pluggy.HookimplMarker("padfree_plugins")


@hookspec
def register_architectures():
    """Return a list of :class:`~padfree_plugins.contract.declarations.Architecture` this plugin makes padding-free."""


@hookspec
def register_tasks():
    """Return a list of :class:`~padfree_plugins.contract.declarations.Task` this plugin provides."""


@hookspec
def register_attention_backends():
    """Return a list of :class:`~padfree_plugins.contract.declarations.AttentionBackend` this plugin provides."""


@hookspec(firstresult=True)
def collate(task, architecture, model_config, config):
    """Return a collator (a picklable callable ``list[dict] -> PackedBatch``) for this task and architecture.

    ``task`` and ``architecture`` are the resolved specs, ``model_config`` the transformers config of the model,
    ``config`` the :class:`~padfree_plugins.config.schema.PadfreeConfig`. Return ``None`` to let the next plugin answer.
    """


@hookspec(firstresult=True)
def patch_model(model, architecture, backend, fallback, config):
    """Make ``model`` (a transformers ``PreTrainedModel``, never a peft wrapper) padding-free in place.

    ``backend`` is the chosen :class:`~padfree_plugins.contract.declarations.AttentionBackend`; ``fallback`` (or
    ``None``) runs
    the inputs ``backend`` cannot take (e.g. fp32 on a bf16-only kernel) when the backend was picked by ``auto``.

    Return a :class:`~padfree_plugins.modeling.patching.ModelPatch` whose ``undo()`` restores the model exactly, or
    ``None`` to let the next plugin answer. Must raise rather than leave a model that can attend across examples.
    """


@hookspec(firstresult=True)
def pool(task, architecture, mode, config):
    """Return a pooler for ``mode`` (``"first"``, ``"last"``, ``"mean"``, …): a picklable callable
    ``(hidden_states [1, T, H], batch) -> [n, H]`` working on the packed row, or ``None`` if unsupported."""


@hookspec(firstresult=True)
def revert_output(task, architecture, config):
    """Return a reverter: a picklable callable ``(packed [1, T, ...], batch) -> (padded [n, Lmax, ...],
    attention_mask [n, Lmax])`` for code that insists on padded tensors, or ``None``."""


@hookspec(firstresult=True)
def task_forward(task, architecture, config):
    """Return a picklable callable ``(model, batch, **loss_kwargs) -> transformers ModelOutput`` that runs a
    patched model on a packed batch for this task (e.g. per-example pooling and a classification head, since
    transformers' ``*ForSequenceClassification`` heads pool one token per *row*). ``None`` lets the next plugin
    answer; the builtin default calls the model with the packing keys plus the task's ``model_keys`` and the
    architecture's ``token_keys`` / ``example_keys`` that the batch has."""


@hookspec(firstresult=True)
def trainer_config(trainer, config):
    """Return the config to assemble ``trainer.model`` with when the trainer implies part of it (e.g. the task a
    sentence-transformers model's modules imply), or ``None`` to keep ``config``. Asked by ``accelerate`` before
    assembly; the result is what ``wrap_trainer`` then receives."""


@hookspec(firstresult=True)
def wrap_trainer(trainer, assembly, config):
    """Make ``trainer`` (HF ``Trainer``, TRL ``SFTTrainer``, a sentence-transformers trainer, …) train
    ``assembly.model`` padding-free: feed it ``assembly.collator`` batches and compute the loss through
    ``assembly.forward``. Return an object with ``undo()`` that restores the trainer, or ``None`` if this plugin
    does not know this kind of trainer."""
