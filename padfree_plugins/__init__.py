"""padfree-plugins: padding-free training for the Hugging Face stack.

    from padfree_plugins import assemble
    assembly = assemble(model, "padfree.yaml")      # patches the model, builds the collator
    batch = assembly.collator(examples)             # one packed row with explicit boundaries
    out = model(**batch.model_inputs())             # attention stays inside each example
    assembly.undo()                                 # the model is as before

    acceleration = accelerate(trainer, "padfree.yaml")  # HF Trainer / TRL SFTTrainer, padding-free
"""

from importlib.metadata import PackageNotFoundError, version

from .arguments import AccelerationArguments
from .assembly import Assembly, assemble, plan
from .batch import PackedBatch
from .collator import PackingCollator
from .config import PadfreeConfig, load_config
from .errors import (
    BackendUnavailableError,
    BatchError,
    BoundaryError,
    ConfigError,
    PadfreeError,
    PluginError,
    UnsupportedArchitectureError,
)
from .hookspecs import hookimpl
from .host import PluginHost
from .patching import ModelPatch, patch_of, unwrap_model
from .specs import Architecture, AttentionBackend, Task
from .trainer import Acceleration, accelerate

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
