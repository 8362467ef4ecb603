"""Module paths that moved: still importable for one release, each with a ``DeprecationWarning`` naming its new home.

One table, :data:`MOVED_MODULES`, and one import hook read it: importing an old path (``import
padfree_plugins.sampler``, ``from padfree_plugins.sampler import token_budget_dataloader``) warns once, at the
importing line, and gives a module whose names are the new module's (the same objects). A name that left the old
module for another one is in :data:`MOVED_NAMES`. The hook only answers for old paths that no file provides, so
it never shadows a real module. Remove an entry (and this module when both tables are empty) in the release after.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

#: old module path -> the module it is now (the layout by layer, CHANGELOG 0.2.0).
MOVED_MODULES: dict[str, str] = {
    "padfree_plugins.hookspecs": "padfree_plugins.contract.hookspecs",
    "padfree_plugins.specs": "padfree_plugins.contract.declarations",
    "padfree_plugins.host": "padfree_plugins.contract.host",
    "padfree_plugins.task_options": "padfree_plugins.config.task_options",
    "padfree_plugins.builtin.task_options": "padfree_plugins.config.task_options",
    "padfree_plugins.model_configs": "padfree_plugins.config.model_configs",
    "padfree_plugins.batch": "padfree_plugins.packing.batch",
    "padfree_plugins.collator": "padfree_plugins.packing.collator",
    "padfree_plugins.padding": "padfree_plugins.packing.padded",
    "padfree_plugins.revert": "padfree_plugins.packing.repad",
    "padfree_plugins.datacheck": "padfree_plugins.packing.datacheck",
    "padfree_plugins.attention": "padfree_plugins.modeling.attention",
    "padfree_plugins.attention.backends": "padfree_plugins.modeling.attention.backends",
    "padfree_plugins.patching": "padfree_plugins.modeling.patching",
    "padfree_plugins.probe": "padfree_plugins.modeling.probe",
    "padfree_plugins.pooling": "padfree_plugins.modeling.pooling",
    "padfree_plugins.forward": "padfree_plugins.modeling.forward",
    "padfree_plugins.neftune": "padfree_plugins.modeling.neftune",
    "padfree_plugins.builtin.heads": "padfree_plugins.modeling.heads",
    "padfree_plugins.sampler": "padfree_plugins.batching.sampler",
    "padfree_plugins.distributed": "padfree_plugins.batching.distributed",
    "padfree_plugins.trainer": "padfree_plugins.integrations.accelerate",
    "padfree_plugins.trainer_checks": "padfree_plugins.integrations.checks",
    "padfree_plugins.arguments": "padfree_plugins.integrations.arguments",
    "padfree_plugins.trl_sft": "padfree_plugins.integrations.trl_sft",
    "padfree_plugins.reward": "padfree_plugins.integrations.trl_reward",
    "padfree_plugins.causal_lm": "padfree_plugins.builtin.tasks.causal_lm",
    "padfree_plugins.builtin.seq_cls": "padfree_plugins.builtin.tasks.seq_cls",
    "padfree_plugins.builtin.reranker": "padfree_plugins.builtin.tasks.reranker",
    "padfree_plugins.builtin.embedding": "padfree_plugins.builtin.tasks.embedding",
    "padfree_plugins.builtin.task_collators": "padfree_plugins.builtin.tasks.collators",
    "padfree_plugins.train": "padfree_plugins.recipes.train",
    "padfree_plugins.demo": "padfree_plugins.recipes.demo",
}

#: old module path -> {name: the module it is now in}, for names that did not move with their module.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "padfree_plugins.trainer": dict.fromkeys(("TrainerPatch", "TrainerCollator", "WholeBatches", "own_attribute",
                                              "restore_attributes"), "padfree_plugins.integrations.base"),
    "padfree_plugins.trl_sft": {"split_packed_row": "padfree_plugins.packing.collator"},
    "padfree_plugins.causal_lm": dict.fromkeys(("keep_labelled_logits", "drop_labelled_logits",
                                                "LABELLED_LOGITS_KEYS"), "padfree_plugins.packing.labelled_logits"),
    "padfree_plugins.train": {"train_tokenizer": "padfree_plugins.data.tokenizer",
                              **dict.fromkeys(("load_rows", "tokenize", "DEFAULT_DATASET", "ROW_FORMATS"),
                                              "padfree_plugins.data.loading")},
    "padfree_plugins.demo": {"lognormal_lengths": "padfree_plugins.benchmarks.lengths"},
}


def moved_message(old: str) -> str:
    """The deprecation message of an old path: where it (and each name that went elsewhere) is now."""
    homes: dict[str, list[str]] = {}
    for name, home in MOVED_NAMES.get(old, {}).items():
        homes.setdefault(home, []).append(name)
    elsewhere = "".join(f"; {', '.join(names)} from {home}" for home, names in homes.items())
    return (f"{old} moved to {MOVED_MODULES[old]}: import it from there{elsewhere} "
            f"(the old path goes in the next release)")


class MovedModuleLoader(importlib.abc.Loader):
    """Makes an old path a module that warns once and forwards every name to its new home."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # an ordinary empty module

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        # stacklevel 2: the frame after this one that is not the import machinery's, i.e. the importing line
        warnings.warn(moved_message(old), DeprecationWarning, stacklevel=2)
        home = importlib.import_module(MOVED_MODULES[old])
        names = MOVED_NAMES.get(old, {})

        def __getattr__(name: str) -> Any:
            if name in names:
                return getattr(importlib.import_module(names[name]), name)
            try:
                return getattr(home, name)
            except AttributeError:
                raise AttributeError(f"module {old!r} (now {home.__name__!r}) has no attribute {name!r}") from None

        module.__getattr__ = __getattr__
        module.__dir__ = lambda: sorted(set(dir(home)) | set(names))
        module.__all__ = [*getattr(home, "__all__", (n for n in vars(home) if not n.startswith("_"))), *names]


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED_MODULES`; last on ``sys.meta_path``, after every real module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        is_package = any(other.startswith(fullname + ".") for other in MOVED_MODULES)
        return importlib.util.spec_from_loader(fullname, MovedModuleLoader(), is_package=is_package)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; called when ``padfree_plugins`` is imported)."""
    if not any(type(finder).__name__ == MovedModuleFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
