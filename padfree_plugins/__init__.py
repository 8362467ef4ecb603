"""padfree-plugins: padding-free training for the Hugging Face stack.

    from padfree_plugins import assemble
    assembly = assemble(model, "padfree.yaml")      # patches the model, builds the collator
    batch = assembly.collator(examples)             # one packed row with explicit boundaries
    out = assembly.forward(model, batch)            # attention stays inside each example
    assembly.undo()                                 # the model is as before

    acceleration = accelerate(trainer, "padfree.yaml")  # HF Trainer / TRL SFTTrainer, padding-free
"""

from importlib.metadata import PackageNotFoundError, version

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
