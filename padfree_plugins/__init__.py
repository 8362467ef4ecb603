"""padfree-plugins: padding-free training for the Hugging Face stack.

    from padfree_plugins import assemble
    assembly = assemble(model, "padfree.yaml")      # patches the model, builds the collator
    batch = assembly.collator(examples)             # one packed row with explicit boundaries
    out = assembly.forward(model, batch)            # attention stays inside each example
    assembly.undo()                                 # the model is as before

    acceleration = accelerate(trainer, "padfree.yaml")  # HF Trainer / TRL SFTTrainer, padding-free

The names below are imported on first use (PEP 562), so that ``import padfree_plugins`` (and the command line's
``--version``, ``--help``) does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from padfree_plugins import _moved

#: Public name -> the module that defines it (imported on first access).
_EXPORTS = {
    "Assembly": "padfree_plugins.assembly",
    "assemble": "padfree_plugins.assembly",
    "plan": "padfree_plugins.assembly",
    "PadfreeConfig": "padfree_plugins.config.schema",
    "load_config": "padfree_plugins.config.schema",
    "Architecture": "padfree_plugins.contract.declarations",
    "AttentionBackend": "padfree_plugins.contract.declarations",
    "Task": "padfree_plugins.contract.declarations",
    "hookimpl": "padfree_plugins.contract.hookspecs",
    "PluginHost": "padfree_plugins.contract.host",
    "BackendUnavailableError": "padfree_plugins.errors",
    "BatchError": "padfree_plugins.errors",
    "BoundaryError": "padfree_plugins.errors",
    "ConfigError": "padfree_plugins.errors",
    "PadfreeError": "padfree_plugins.errors",
    "PluginError": "padfree_plugins.errors",
    "UnsupportedArchitectureError": "padfree_plugins.errors",
    "Acceleration": "padfree_plugins.integrations.accelerate",
    "accelerate": "padfree_plugins.integrations.accelerate",
    "AccelerationArguments": "padfree_plugins.integrations.arguments",
    "ModelPatch": "padfree_plugins.modeling.patching",
    "patch_of": "padfree_plugins.modeling.patching",
    "unwrap_model": "padfree_plugins.modeling.patching",
    "PackedBatch": "padfree_plugins.packing.batch",
    "PackingCollator": "padfree_plugins.packing.collator",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from padfree_plugins.assembly import Assembly, assemble, plan
    from padfree_plugins.config.schema import PadfreeConfig, load_config
    from padfree_plugins.contract.declarations import Architecture, AttentionBackend, Task
    from padfree_plugins.contract.hookspecs import hookimpl
    from padfree_plugins.contract.host import PluginHost
    from padfree_plugins.errors import (
        BackendUnavailableError,
        BatchError,
        BoundaryError,
        ConfigError,
        PadfreeError,
        PluginError,
        UnsupportedArchitectureError,
    )
    from padfree_plugins.integrations.accelerate import Acceleration, accelerate
    from padfree_plugins.integrations.arguments import AccelerationArguments
    from padfree_plugins.modeling.patching import ModelPatch, patch_of, unwrap_model
    from padfree_plugins.packing.batch import PackedBatch
    from padfree_plugins.packing.collator import PackingCollator

_moved.install()  # the module paths that moved (padfree_plugins.sampler …) import for a release, with a warning

try:
    __version__ = version("padfree-plugins")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "Acceleration", "AccelerationArguments", "Architecture", "Assembly", "AttentionBackend",
    "BackendUnavailableError", "BatchError", "BoundaryError", "ConfigError", "ModelPatch", "PackedBatch",
    "PackingCollator", "PadfreeConfig", "PadfreeError", "PluginError", "PluginHost", "Task",
    "UnsupportedArchitectureError", "accelerate", "assemble", "hookimpl", "load_config", "patch_of", "plan",
    "unwrap_model", "__version__",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first access (then cached in this module's namespace)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
