"""Declarations that plugins return from the ``register_*`` hooks: architectures, tasks, attention backends.

They are plain frozen dataclasses so that the host can list, compare and report them without running any
plugin code, and so that what assembly resolves from them can be pickled into DataLoader workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["decoder", "encoder"]

#: Attention features a model may use; backends declare which of them they implement (all of these by default).
FEATURES = ("causal", "bidirectional", "gqa", "sliding_window", "softcap", "dropout")
#: Features a backend implements only when it says so: ``sinks`` (a learned per-head logit in every softmax,
#: gpt-oss), given to its ``varlen`` function as ``sinks=``; ``bidirectional_blocks`` (tokens of one block, a
#: Gemma 3 image, attend to each other both ways inside a causal example: ``block_sequence_ids``);
#: ``shared_prefixes`` (a segment's queries over its parent prompt's keys and its own, aligned to the end of the keys:
#: :mod:`padfree_plugins.packing.prefixes`), given to its ``varlen`` as keys gathered per segment with their own
#: ``cu_seq_lens_k``.
OPT_IN_FEATURES = ("sinks", "bidirectional_blocks", "shared_prefixes")


def position_start_zero(model_config: Any) -> int:
    """Positions of every example start at 0 (most models)."""
    return 0


def no_extra_features(model_config: Any) -> frozenset[str]:
    """No attention features beyond those read from the config generically."""
    return frozenset()


def always_available() -> str | None:
    """No requirement beyond the backend's devices and dtypes: it can run wherever they allow."""
    return None


@dataclass(frozen=True)
class Architecture:
    """A model family that can run padding-free.

    ``position_start`` maps a model config to the first position id of every example (0 for most models,
    ``pad_token_id + 1`` for the RoBERTa family). ``features`` maps a config to the attention features the model
    uses, so that assembly can pick a backend that implements all of them.

    ``token_keys`` and ``example_keys`` are model inputs the family takes beyond the task's keys, which the collator
    carries (whatever the task) when the examples have them — in every example or in none — and the forward passes
    to the model: ``token_keys`` one value per token, concatenated like ``input_ids`` (a value may have trailing
    dimensions: LayoutLM's ``bbox``, ``[L, 4]`` per example, is packed ``[1, T, 4]``); ``example_keys`` one value
    per example, stacked ``[n, ...]`` (X-MOD's ``lang_ids``). An example carrying a key the model's forward takes but
    that no declaration carries is a :class:`~padfree_plugins.errors.BatchError` rather than dropped.
    """

    name: str
    model_types: tuple[str, ...]
    kind: Kind
    position_start: Callable[[Any], int] = field(default=position_start_zero, compare=False)
    features: Callable[[Any], frozenset[str]] = field(default=no_extra_features, compare=False)
    default_pooling: str = "last"
    priority: int = 0
    description: str = ""
    token_keys: tuple[str, ...] = ()
    example_keys: tuple[str, ...] = ()
    #: Called at assembly with the task's collator and the model config, returns the collator batches go through
    #: (a vision-language family's :class:`~padfree_plugins.packing.multimodal.MultimodalPacking`); its
    #: ``model_keys`` are model inputs the forward passes when a batch has them (``pixel_values`` …).
    wrap_collator: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    #: Why this family's repeated prompts are never shared (``prefix_sharing``), ``""`` where they can be; ``check``
    #: shows it (a family gets it from its traits: ``Trait.no_shared_prompts`` in :mod:`padfree_plugins.modeling`).
    no_shared_prompts: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ValueError(f"Architecture {self.name!r} declares no model_types")
        if self.kind not in ("decoder", "encoder"):
            raise ValueError(f"Architecture {self.name!r}: kind must be 'decoder' or 'encoder', not {self.kind!r}")


@dataclass(frozen=True)
class Task:
    """A training task: which batch keys travel per token and per example, and which pooling it needs.

    ``token_keys`` are concatenated like ``input_ids`` (e.g. ``labels`` for causal LM, ``token_type_ids``);
    ``example_keys`` are stacked one value per example (e.g. a class label or a group id).
    ``required_keys`` must be present in every example. ``masked_first_keys`` are token keys whose first value
    in every example is set to -100, so that no example is trained to continue the one before it.
    ``model_keys`` are the batch keys, besides ``input_ids``, positions and boundaries, that the default forward
    passes to the model (e.g. ``labels`` for causal LM, ``token_type_ids`` for encoders).
    ``options``: the task's ``task_options`` with their defaults; when declared, planning refuses an unknown
    option or a value of another kind than its default's (``None``: the task reads ``task_options`` itself).
    ``needs_pooling``: the task pools one vector per example (the architecture's default mode unless the config
    sets ``pooling``); ``pools``: it pools only when the config sets ``pooling``. A config that sets ``pooling``
    for a task with neither is an error: nothing would read it.
    """

    name: str
    token_keys: tuple[str, ...] = ()
    example_keys: tuple[str, ...] = ()
    required_keys: tuple[str, ...] = ("input_ids",)
    masked_first_keys: tuple[str, ...] = ()
    model_keys: tuple[str, ...] = ("token_type_ids",)
    needs_pooling: bool = False
    pools: bool = False
    options: Mapping[str, Any] | None = field(default=None, compare=False)
    priority: int = 0
    description: str = ""


@dataclass(frozen=True)
class AttentionBackend:
    """A kernel that runs attention over a packed row ``[T, H, D]`` split by ``cu_seq_lens``.

    ``varlen`` has the signature of :func:`padfree_plugins.modeling.attention.backends.exact_varlen`.
    ``available`` returns ``None`` when the backend can run here, else the reason it cannot.
    ``devices`` lists the torch device types it runs on; ``dtypes`` the tensor dtypes (empty: any).
    ``speed_rank`` orders backends for ``attention: auto`` (higher is preferred).
    """

    name: str
    varlen: Callable[..., Any] = field(compare=False)
    available: Callable[[], str | None] = field(default=always_available, compare=False, repr=False)
    features: frozenset[str] = frozenset(FEATURES)
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ()
    speed_rank: int = 0
    priority: int = 0
    description: str = ""

    def accepts(self, device_type: str, dtype: Any) -> bool:
        """Whether tensors of this device type and dtype suit the kernel (cheap: called in every attention)."""
        name = str(dtype).removeprefix("torch.")
        return device_type in self.devices and (not self.dtypes or name in self.dtypes)

    def cannot_run(self, device_type: str, dtype: Any = None, features: frozenset[str] = frozenset()) -> str | None:
        """Why this backend cannot run on ``device_type`` with ``dtype`` and ``features``; ``None`` if it can."""
        reason = self.available()
        if reason:
            return reason
        if device_type not in self.devices:
            return f"runs on {', '.join(self.devices)} only, not {device_type}"
        if dtype is not None and self.dtypes and str(dtype).removeprefix("torch.") not in self.dtypes:
            return f"needs dtype {' or '.join(self.dtypes)}, not {str(dtype).removeprefix('torch.')}"
        missing = sorted(set(features) - self.features)
        if missing:
            return f"does not implement {', '.join(missing)}"
        return None
