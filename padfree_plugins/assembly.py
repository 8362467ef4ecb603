"""Assembly: resolve plugins once for a model and a config, patch the model, build the collator and poolers.

Everything the training loop needs comes out of here as plain objects; no hook is called after this.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from padfree_plugins.config.model_configs import layer_values
from padfree_plugins.config.schema import PadfreeConfig, load_config
from padfree_plugins.config.task_options import read_options
from padfree_plugins.contract.declarations import Architecture, AttentionBackend, Task
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.errors import (
    BackendUnavailableError,
    ConfigError,
    PadfreeError,
    PluginError,
    UnsupportedArchitectureError,
    did_you_mean,
)
from padfree_plugins.modeling.attention import BLOCKS_FEATURE
from padfree_plugins.modeling.attention.context_parallel import (
    ALIGNED_FEATURE,
    AttentionLayout,
    balance_choice,
    ulysses_share,
)
from padfree_plugins.modeling.mixers import note_unused_mixer_backend, sequence_mixers
from padfree_plugins.modeling.patching import ModelPatch, unwrap_model
from padfree_plugins.modeling.pooling import unknown_mode_hint
from padfree_plugins.modeling.probe import PROBE, PROBE_PLUGIN, probed_architecture, verify
from padfree_plugins.modeling.sequence_parallel import SequenceParallelForward, SequenceParallelPatch, sequence_group
from padfree_plugins.modeling.tiled_mixers import MixerTiling, refuse_tiled_mixers_under_zero3
from padfree_plugins.modeling.loss_kernel import LossKernel, planned
from padfree_plugins.modeling.tiling import MLPTiling, TiledLossForward, check_tiled_loss, resolve_tiles, tiled_modules
from padfree_plugins.modeling.unpad import UnpadPatch
from padfree_plugins.packing.collator import refusing_undeclared, within_embeddings

EXACT_BACKEND = "exact"
logger = logging.getLogger("padfree_plugins")


def attention_features(model_config: Any, architecture: Architecture) -> frozenset[str]:
    """The attention features a model uses, from its config (every layer's, for a heterogeneous config) and its
    architecture declaration."""
    features = set(architecture.features(model_config))
    features.add("causal" if architecture.kind == "decoder" and getattr(model_config, "is_causal", True)
                 else "bidirectional")
    heads = [h for h in layer_values(model_config, "num_attention_heads") if h]
    kv_heads = [h for h in layer_values(model_config, "num_key_value_heads") if h] or heads
    if heads and kv_heads and min(kv_heads) < max(heads):
        features.add("gqa")
    if any(layer_values(model_config, "sliding_window")):
        features.add("sliding_window")
    if any(layer_values(model_config, "attn_logit_softcapping")):
        features.add("softcap")
    for name in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"):
        if any((value or 0.0) > 0 for value in layer_values(model_config, name)):
            features.add("dropout")
    return frozenset(features)


@dataclass
class Plan:
    """What assembly resolved for a model config, before touching any model."""

    architecture: Architecture
    architecture_plugin: str
    task: Task
    task_plugin: str
    backend: AttentionBackend
    fallback: AttentionBackend | None
    features: frozenset[str]
    device_type: str
    position_start: int
    notes: list[str] = field(default_factory=list)
    #: Assembly hook -> the plugin that answered it (filled when the parts are built, and by ``assemble``).
    answers: dict[str, str | None] = field(default_factory=dict)
    #: ``memory.tile_tokens`` resolved for the model: (MLP tile, loss tile) in tokens, or None (off).
    tiles: tuple[int, int] | None = None
    #: What ``memory.tile_mixers`` does for the model's sequence mixers ("" without tiling).
    tile_mixers: str = ""
    #: ``sequence_parallel`` resolved for the model, in words (attention scheme, causal work balance).
    sequence: str = "off (sequence_parallel.size: 1)"
    #: What computes the tiled LM head and loss (``memory.loss_kernel``), in words ("-": the loss is not tiled).
    loss_kernel: str = "-"

    def describe(self) -> dict[str, Any]:
        return {
            "architecture": f"{self.architecture.name} ({self.architecture.kind}, plugin {self.architecture_plugin})",
            "task": f"{self.task.name} (plugin {self.task_plugin})",
            "attention backend": self.backend.name + (f", falls back to {self.fallback.name} for inputs it cannot "
                                                      "run" if self.fallback else ""),
            "attention features": ", ".join(sorted(self.features)) or "-",
            "device": self.device_type,
            "position_start": self.position_start,
            "hooks answered by": ", ".join(f"{hook}: {plugin or '-'}" for hook, plugin in self.answers.items()) or "-",
            "memory": describe_tiles(self.tiles, self.tile_mixers),
            "loss kernel": self.loss_kernel,
            "sequence parallel": self.sequence,
            "notes": self.notes,
        }


def describe_tiles(tiles: tuple[int, int] | None, mixers: str = "") -> str:
    """What ``memory.tile_tokens`` chose, for ``check`` and logs; ``mixers``: what it chose for the sequence mixers
    ("": nothing to say)."""
    if tiles is None:
        return "no tiling (memory.tile_tokens: null)"
    return (f"MLP in tiles of {tiles[0]} tokens, LM head + loss in tiles of {tiles[1]} tokens"
            f"{', ' + mixers if mixers else ''} (rows no longer than a tile run untiled)")


def mixer_tiling(config: PadfreeConfig, tiles: tuple[int, int] | None) -> str:
    """What ``memory.tile_mixers`` does for a family's sequence mixers, for ``check`` ("" without tiling)."""
    if tiles is None:
        return ""
    if not config.memory.tile_mixers:
        return "sequence mixers untiled (memory.tile_mixers: false)"
    if config.sequence_parallel.size > 1:
        return "sequence mixers untiled under sequence parallelism (each rank scans its slice)"
    return (f"sequence mixers in tiles of {tiles[0]} tokens, each continuing the previous tile's state (a hybrid's "
            "gated delta rule, Mamba2, KDA; others stay whole, with a warning; refused under DeepSpeed ZeRO-3: set "
            "memory.tile_mixers: false there)")


def _model_type(model_config: Any) -> str:
    model_type = getattr(model_config, "model_type", None)
    if not model_type:
        raise UnsupportedArchitectureError(
            f"the model config ({type(model_config).__name__}) has no model_type, so no architecture can be chosen: "
            f"give the config class a model_type (architecture: {PROBE} can then check it on the model itself). "
            f"{ADD_AN_ARCHITECTURE}"
        )
    return model_type


#: How to support a model type for good (every unsupported-architecture message ends with it).
ADD_AN_ARCHITECTURE = ("To support a model type for good, install or write an architecture plugin "
                       "(docs/writing-a-plugin.md): it declares the model type, and its equivalence test proves it "
                       "exact.")


def resolve_architecture(host: PluginHost, model_config: Any, config: PadfreeConfig,
                         model: Any = None) -> tuple[Architecture, str]:
    """The architecture for a model config (an undeclared one under ``architecture: probe`` read from ``model``,
    when given) and the plugin that declares it."""
    model_type = _model_type(model_config)
    claims = host.architectures()
    if config.architecture == PROBE:  # declared model types as usual; an undeclared one is probed at assembly
        if model_type in claims:
            return claims[model_type]
        return probed_architecture(model_config, model), PROBE_PLUGIN
    if config.architecture != "auto":
        by_name = {spec.name: (spec, plugin) for spec, plugin in claims.values()}
        if config.architecture not in by_name:
            raise ConfigError(
                f"architecture {config.architecture!r} is not provided by any plugin."
                f"{did_you_mean(config.architecture, by_name)}{host.filter_note(config.architecture)} "
                f"Available: {', '.join(sorted(by_name))}; or "
                f"'{PROBE}' (accepts a model type no plugin declares after an equivalence check on the model itself)"
                f", or 'auto' (from the model type). {ADD_AN_ARCHITECTURE}"
            )
        spec, plugin = by_name[config.architecture]
        if model_type in spec.model_types:
            return spec, plugin
        if model_type in claims:  # e.g. bert forced on a roberta model: positions would start in the wrong place
            raise ConfigError(
                f"architecture {config.architecture!r} declares model types {', '.join(spec.model_types)}, not "
                f"{model_type!r}, which {claims[model_type][0].name!r} declares; remove architecture from the "
                "config (auto picks it) or name that one"
            )
        return spec, PROBE_PLUGIN  # an undeclared model type run as a declared architecture: proven at assembly
    if model_type not in claims:
        # No "did you mean": the model type is the model's own, not a typo, and a name spelt alike ('opt' and
        # 'mpnet', 'hubert' and 'bert') says nothing about whether the architecture is alike.
        supported = ", ".join(sorted(claims)) or "none (is padfree-plugins installed? run pip install -e .)"
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported by any installed plugin.{host.filter_note(model_type)} "
            "Supported model types: "
            f"{supported}. To try it anyway, set architecture: {PROBE} in the acceleration config: assembly then "
            "accepts it only after a packed-vs-per-example equivalence check on the model itself. "
            f"{ADD_AN_ARCHITECTURE}"
        )
    return claims[model_type]


def resolve_backend(host: PluginHost, requested: str, device_type: str,
                    features: frozenset[str]) -> tuple[AttentionBackend, AttentionBackend | None]:
    """The backend to use and, for ``auto``, a fallback for inputs it cannot run: the fastest backend here that
    takes every dtype (``repad`` on a GPU, ``exact`` on a CPU)."""
    backends = {name: spec for name, (spec, _) in host.backends().items()}
    ranked = sorted(backends.values(), key=lambda b: (-b.speed_rank, b.name))
    if requested != "auto":
        if requested not in backends:
            raise ConfigError(
                f"attention backend {requested!r} is not provided by any plugin.{did_you_mean(requested, backends)} "
                f"Available: auto, {', '.join(sorted(backends))}.{host.filter_note('backends')}"
            )
        backend = backends[requested]
        reason = backend.cannot_run(device_type, None, features)
        if reason:
            usable = [b.name for b in ranked if b.cannot_run(device_type, None, features) is None]
            instead = (f"On {device_type} use attention: auto (it picks {usable[0]} here) or "
                       f"{', '.join(usable)}." if usable else
                       f"No attention backend can run this model on {device_type}.")
            raise BackendUnavailableError(
                f"attention backend {requested!r} was requested but cannot be used on {device_type}: "
                f"{_why_not(backend, device_type, reason)}. {instead}"
            )
        return backend, None
    usable = [backend for backend in ranked if backend.cannot_run(device_type, None, features) is None]
    if usable:
        backend = usable[0]
        if not backend.dtypes:  # takes every dtype: nothing to fall back for
            return backend, None
        return backend, next((b for b in usable if not b.dtypes), backends.get(EXACT_BACKEND))
    reasons = "; ".join(f"{b.name}: {b.cannot_run(device_type, None, features)}" for b in ranked)
    raise BackendUnavailableError(f"no attention backend can run this model on {device_type}: "
                                  f"{reasons or 'no backend is loaded'}.{host.filter_note('backends')}")


#: How error messages name the device types of :attr:`AttentionBackend.devices`.
DEVICE_NAMES = {"cuda": "CUDA", "cpu": "CPU", "mps": "Apple MPS", "xpu": "Intel XPU"}


def _why_not(backend: AttentionBackend, device_type: str, reason: str) -> str:
    """Why ``backend`` cannot run, device first: a backend for other devices is that whatever else is missing (its
    package, say), and its declaration says what it is and needs."""
    if device_type in backend.devices:
        return reason
    devices = " / ".join(DEVICE_NAMES.get(d, d) for d in backend.devices)
    details = [*([f"{' / '.join(backend.dtypes)} inputs"] if backend.dtypes else []),
               *([backend.description] if backend.description else [])]
    what = f" ({'; '.join(details)})" if details else ""
    return f"it is {devices}-only{what}, not for {DEVICE_NAMES.get(device_type, device_type)}"


def plan(model_config: Any, config: PadfreeConfig | dict | str | None = None, *, host: PluginHost | None = None,
         device_type: str | None = None) -> Plan:
    """Resolve architecture, task and backend for a model config, and check that the task's plugins accept the
    config (its options, its pooling mode) by building the collator, pooler and forward — no model needed: used
    by ``check``."""
    config = load_config(config)
    host = host or PluginHost(block=config.plugins.block)
    resolved = _resolve(model_config, config, host, device_type)
    Parts.build(host, model_config, config, resolved)  # records who answered in resolved.answers
    host.trace_not_called("patch_model", "a plan patches no model; assemble() asks it")
    return resolved


def _resolve(model_config: Any, config: PadfreeConfig, host: PluginHost, device_type: str | None,
             model: Any = None) -> Plan:
    """Architecture, task and backend for a model config (and the model itself, when there is one), with notes for
    the log."""
    host.require(config.plugins.require)
    if not host.loaded():
        raise PluginError(f"no plugin is loaded: is padfree-plugins installed (pip install -e .)?{host.filter_note()}")
    architecture, architecture_plugin = resolve_architecture(host, model_config, config, model)
    tasks = host.tasks()
    if config.task not in tasks:
        raise ConfigError(
            f"task {config.task!r} is not provided by any plugin.{did_you_mean(config.task, tasks)} "
            f"Available: {', '.join(sorted(tasks)) or 'none'}.{host.filter_note(config.task)}"
        )
    task, task_plugin = tasks[config.task]
    if task.options is not None:
        read_options(task.name, config.task_options, task.options)
    if config.pooling is not None and not (task.needs_pooling or task.pools):
        raise ConfigError(f"pooling: {config.pooling} is not used by task {task.name!r} (its model or head decides "
                          "which tokens it reads); remove pooling from the config")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    features = attention_features(model_config, architecture)
    if config.attention_dropout == "disable":
        features -= {"dropout"}
    backend, fallback = resolve_backend(host, config.attention, device_type, features)
    used = (("model type", _model_type(model_config)), ("task", task.name), ("attention backend", backend.name))
    notes = [host.conflicts[key] for key in used if key in host.conflicts]  # only the names this model uses
    for name in config.plugins.block:
        if name not in host.records:  # a typo blocks nothing
            notes.append(f"plugins.block names {name!r}, which is not installed.{did_you_mean(name, host.records)}")
    if architecture_plugin == PROBE_PLUGIN:
        notes.append(f"model type {model_config.model_type!r} is declared by no plugin: assembly accepts it as "
                     f"{architecture.name!r} only if the equivalence probe passes on the model itself")
    if architecture.no_shared_prompts and getattr(config, "prefix_sharing", "off") != "off":
        notes.append(f"prefix_sharing: {config.prefix_sharing} shares no prompts for {architecture.name}: "
                     f"{architecture.no_shared_prompts} (on is refused at accelerate(); auto packs every example "
                     "whole)")
    if config.attention == "auto" and "dropout" in features:
        faster = [b.name for b, _ in host.backends().values()
                  if b.speed_rank > backend.speed_rank and not b.cannot_run(device_type, None, features - {"dropout"})]
        if faster:
            notes.append(f"the model uses attention dropout, which {', '.join(faster)} cannot do: using "
                         f"{backend.name}; set attention_dropout: disable to use {faster[0]}")
    tiles = None if config.memory.tile_tokens is None else resolve_tiles(config.memory.tile_tokens, model_config)
    LossKernel.of(config.memory.loss_kernel)  # liger asked for and not installed: refused here, saying how to install
    loss_tiled = tiles is not None and config.memory.tile_loss and task.name == "causal_lm"
    return Plan(architecture, architecture_plugin, task, task_plugin, backend, fallback, features, device_type,
                int(architecture.position_start(model_config)), notes, tiles=tiles,
                tile_mixers=mixer_tiling(config, tiles),
                sequence=describe_sequence_parallel(config, model_config),
                loss_kernel=planned(config.memory.loss_kernel, device_type) if loss_tiled else "- (no tiled loss)")


def describe_sequence_parallel(config: PadfreeConfig, model_config: Any) -> str:
    """How ``sequence_parallel`` runs the model's attention, in words: the scheme and the causal work balance."""
    size = config.sequence_parallel.size
    if size == 1:
        return "off (sequence_parallel.size: 1)"
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text_config, "num_attention_heads", None)
    share, _ = ulysses_share(config.sequence_parallel.attention, heads, size)
    scheme = ("Ulysses" if share == size else "all-gather" if share == 1 else
              f"Ulysses within blocks of {share} ranks, all-gather across {size // share}")
    _, balance = balance_choice(config.sequence_parallel.balance, share, size)
    return (f"size {size}, attention: {scheme} (sequence_parallel.attention: {config.sequence_parallel.attention}, "
            f"{heads} heads); balance: {balance}")


@dataclass(frozen=True)
class Parts:
    """The objects that feed a patched model, from the plugins' hooks: collator, pooler, reverter, forward."""

    collator: Any
    pooler: Any
    reverter: Any
    forward: Any

    @classmethod
    def build(cls, host: PluginHost, model_config: Any, config: PadfreeConfig, resolved: Plan) -> "Parts":
        call = dict(task=resolved.task, architecture=resolved.architecture, config=config)
        collator = host.call_first("collate", returns_callable=True, model_config=model_config, **call)
        if collator is None:
            raise PluginError(f"no plugin provides a collator for task {resolved.task.name!r}."
                              f"{host.filter_note('core')}")
        if resolved.architecture.wrap_collator is not None:  # media packed beside the text (vision-language)
            collator = resolved.architecture.wrap_collator(collator, model_config)
        mode = config.pooling or (resolved.architecture.default_pooling if resolved.task.needs_pooling else None)
        pooler = host.call_first("pool", returns_callable=True, mode=mode, **call) if mode else None
        if mode and pooler is None:
            raise ConfigError(f"no plugin provides pooling mode {mode!r} for {resolved.architecture.name}."
                              f"{unknown_mode_hint(mode)}{host.filter_note('core')}")
        forward = host.call_first("task_forward", returns_callable=True, **call)
        if getattr(forward, "uses_assembly_pooler", False):  # the pool hook's pooler, a plugin's mode included
            forward = dataclasses.replace(forward, pooler=pooler)
        reverter = host.call_first("revert_output", returns_callable=True, **call)
        hooks = ("collate", *(("pool",) if mode else ()), "task_forward", "revert_output")
        resolved.answers.update({hook: host.answered.get(hook) for hook in hooks})
        return cls(collator, pooler, reverter, forward)


@dataclass
class Assembly:
    """A patched model and the objects that feed it: collator, pooler, reverter. ``undo()`` reverts the model."""

    model: Any
    config: PadfreeConfig
    plan: Plan
    patch: ModelPatch
    collator: Any
    pooler: Any
    reverter: Any
    forward: Any
    #: The plugin host it was assembled with (a trainer plugin assembles the reference model with it too). Not
    #: copied or pickled with the assembly (it holds the plugin modules): a copy assembles with the default host.
    host: PluginHost | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "host"}

    def undo(self) -> None:
        self.patch.undo()

    def describe(self) -> dict[str, Any]:
        devices = sorted({str(p.device) for p in self.model.parameters()})
        return {**self.plan.describe(), "model device": ", ".join(devices) or "-",
                **{f"patch {k}": v for k, v in self.patch.describe().items()},
                "collator": type(self.collator).__name__, "forward": type(self.forward).__name__,
                "pooler": type(self.pooler).__name__ if self.pooler else "-"}


def forward_parameters(model: Any) -> tuple[str, ...]:
    """The named parameters of ``type(model).forward`` (the inputs an example could carry for it)."""
    try:
        parameters = inspect.signature(type(model).forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def refuse_meta_weights(model: Any) -> None:
    """Weights on the ``meta`` device (built under ``init_empty_weights`` / ``torch.device("meta")``, never loaded)
    have no values: any forward fails deep inside the model. Refused before anything is patched, saying how to
    materialise them. Weights an accelerate offload hook loads at each call (``device_map`` with offloading) are
    not refused."""
    for module_name, module in model.named_modules():
        if getattr(module, "_hf_hook", None) is not None:
            continue  # accelerate's offload hook puts the weights on the execution device for each forward
        for name, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            if tensor.is_meta:
                where = f"{module_name}.{name}" if module_name else name
                raise PadfreeError(
                    f"{type(model).__name__}'s weights are on the meta device (not materialised; {where} is the "
                    "first): load them before assemble() / accelerate(), e.g. from_pretrained without "
                    "device_map='meta' or init_empty_weights, or model.to_empty(device=...) and then "
                    "load_state_dict(...)")


def refuse_prompt_learning(model: Any) -> None:
    """peft prompt learning (prompt tuning, p-tuning, prefix tuning …) adds virtual tokens or cached prefixes per
    *row*; a packed row holds many examples, which would share one prompt. Refused before anything is patched."""
    for wrapper in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        peft_config = getattr(wrapper, "active_peft_config", None)
        if getattr(peft_config, "is_prompt_learning", False):
            raise UnsupportedArchitectureError(
                f"{type(peft_config).__name__}: peft prompt learning adds its virtual tokens (or prefix) once per "
                "row, and a padding-free row packs many examples, which would share them. Train this adapter padded, "
                "or use an adapter on the weights (LoRA, DoRA, IA3 …), which trains padding-free"
            )


def refuse_data_parallel(model: Any) -> None:
    """``torch.nn.DataParallel`` splits every batch by rows across GPUs; a packed batch is one row. Refused (at any
    depth of ``module`` / ``_orig_mod`` wrappers) before anything is patched."""
    wrapper, seen = model, set()
    while isinstance(wrapper, torch.nn.Module) and id(wrapper) not in seen:
        seen.add(id(wrapper))
        if isinstance(wrapper, torch.nn.DataParallel):
            raise PadfreeError(
                f"{type(wrapper).__name__}: torch.nn.DataParallel splits a batch by rows across GPUs, and a "
                "padding-free batch is one row. Assemble the model itself (model.module) and launch one process "
                "per GPU with `accelerate launch` or `torchrun` (DistributedDataParallel), or use one GPU"
            )
        wrapper = next((inner for inner in (getattr(wrapper, "_orig_mod", None), getattr(wrapper, "module", None))
                        if isinstance(inner, torch.nn.Module)), None)


def refuse_sequence_parallel(model: Any, config: PadfreeConfig, resolved: Plan, collator: Any,
                             forward: Any = None) -> int:
    """What sequence parallelism (``sequence_parallel.size > 1``) does not train, refused before anything is
    patched: tasks other than causal LM and those whose forward pools whole examples (``pools_examples``: seq_cls,
    embedding, reranker — encoders too), image-text rows the group cannot join (:func:`refuse_split_media`) or
    whose bidirectional image blocks all-gather cannot attend, heads Ulysses cannot split, an attention backend
    all-gather cannot use. Returns how many of the group's ranks split attention by heads (Ulysses; the size:
    Ulysses alone; 1: all-gather alone; see :func:`ulysses_share`)."""
    size = config.sequence_parallel.size
    where = f"sequence_parallel.size: {size}"
    task = resolved.task.name
    pools = bool(getattr(forward, "pools_examples", False))
    if task != "causal_lm" and not pools:
        raise ConfigError(f"{where} trains causal language models (task: causal_lm) and the tasks that pool whole "
                          f"examples (seq_cls, embedding, reranker); task {task!r} reads its outputs in a way a row "
                          "split across ranks does not hold yet: set sequence_parallel.size: 1")
    if resolved.architecture.kind != "decoder" and not pools:
        raise ConfigError(f"{where}: {resolved.architecture.name} is an encoder; under sequence parallelism encoders "
                          f"train the tasks that pool whole examples (seq_cls, embedding, reranker), not {task!r}")
    if getattr(collator, "media_keys", None):
        refuse_split_media(collator, resolved, where, pools)
    text_config = model.config.get_text_config()
    heads = getattr(text_config, "num_attention_heads", None)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else None
    share, note = ulysses_share(config.sequence_parallel.attention, heads, size)
    if share == size and isinstance(heads, int) and heads % size:
        problems = [f"{type(model).__name__} has {heads} attention heads, which {size} ranks cannot split (Ulysses "
                    "gives each rank heads/size of them)"]
        if world is not None and world % size:
            problems.append(f"{size} does not divide the {world} processes")
        valid = [n for n in range(2, heads + 1) if heads % n == 0 and (world is None or world % n == 0)]
        advice = (f"use one of {valid}" if valid else
                  f"no size above 1 divides both the {heads} heads and the {world} processes: set "
                  f"sequence_parallel.size: 1, or launch a multiple of a divisor of {heads} as the number of processes")
        raise ConfigError(f"{where}: {'; and '.join(problems)}; {advice}, or set sequence_parallel.attention: "
                          "allgather (or auto), which splits the row, not the heads")
    if share < size and getattr(collator, "media_keys", None) and BLOCKS_FEATURE in resolved.features:
        raise ConfigError(f"{where}: sequence_parallel.attention {config.sequence_parallel.attention} chose all-gather "
                          f"({heads} attention heads), and {resolved.architecture.name}'s image-text rows hold "
                          "bidirectional image blocks, whose tokens attend to each other both ways: all-gather "
                          "attends each rank's slice of queries causally to the row's keys, so an image cut by a "
                          "rank boundary would not see its later tokens; use sequence_parallel.attention: ulysses "
                          "with a size that divides the attention heads")
    if share < size:
        refuse_allgather(model, config, resolved, where)
    if config.unpad == "always":
        raise ConfigError(f"{where} with unpad: always: padded calls are not split across ranks; use unpad: auto "
                          "(padded calls then run the model's own code on each rank) or off")
    if note is not None:
        logger.warning("padfree-plugins: %s", note)
    return share


def refuse_split_media(collator: Any, resolved: Plan, where: str, pools: bool) -> None:
    """What image-text rows under sequence parallelism do not take, refused before anything is patched: a pooled
    task, and media whose pixel rows the group's micro-batches cannot join into one row (pixels given with a batch
    axis, ``[1, tiles, ...]``: Idefics3 / SmolVLM; any-resolution patches padded per micro-batch: LLaVA-OneVision)."""
    name = resolved.architecture.name
    if pools:
        raise ConfigError(f"{where}: {name} is a vision-language family; under sequence parallelism its image-text "
                          f"rows train task: causal_lm, not {resolved.task.name!r}; set sequence_parallel.size: 1")
    for media in getattr(collator, "media", ()):
        if media.batch_dim or (media.grid is None and media.tokens_per_row is None):
            layout = ("given with a batch axis" if media.batch_dim else
                      "padded to the micro-batch's largest image, so they differ in shape between micro-batches")
            raise ConfigError(f"{where}: {name}'s {media.name} pixels ({media.pixels!r}) are {layout}, which the "
                              "group cannot join into one image-text row yet; train it with sequence_parallel.size: "
                              "1 (sequence parallelism takes Qwen-VL's grids and Gemma 3's images)")


def pad_token_of(model: Any, collator: Any) -> int:
    """The token the padding segment of a sequence-parallel row holds: the text config's ``pad_token_id`` (0
    without one); in an image-text row never a media placeholder (the model would fill it with image features)."""
    pad = getattr(model.config.get_text_config(), "pad_token_id", None) or 0
    placeholders = set(getattr(collator, "token_ids", {}).values())
    if pad in placeholders:
        pad = next(token for token in range(len(placeholders) + 1) if token not in placeholders)
    return pad


def refuse_allgather(model: Any, config: PadfreeConfig, resolved: Plan, where: str) -> None:
    """What all-gather sequence parallelism does not run, refused before anything is patched: an attention backend
    that does not align an example's queries to the end of its keys, a bidirectional sliding window."""
    chosen = "chose" if config.sequence_parallel.attention == "auto" else "is set to"
    for backend in (resolved.backend, resolved.fallback):
        if backend is not None and ALIGNED_FEATURE not in backend.features:
            raise ConfigError(
                f"{where}: sequence_parallel.attention {chosen} all-gather, whose ranks attend their slice of queries "
                f"to the row's keys, which the {backend.name!r} attention backend cannot do (it aligns queries and "
                "keys at each example's start): set attention: exact or flash_attn, or a sequence_parallel.size that "
                "divides the attention heads with sequence_parallel.attention: ulysses")
    window = any(layer_values(model.config.get_text_config(), "sliding_window"))
    if window and resolved.architecture.kind != "decoder":
        raise ConfigError(f"{where}: sequence_parallel.attention {chosen} all-gather, which does not run "
                          f"{type(model).__name__}'s bidirectional sliding windows: use sequence_parallel.attention: "
                          "ulysses with a size that divides the attention heads")


def tiling_of(model: Any, config: PadfreeConfig, resolved: Plan) -> tuple[int | None, int | None]:
    """(MLP tile, loss tile) to install for ``memory`` (None: that part untiled), checked against the model: a
    feed-forward that is not token-local, an LM head the tiled loss cannot compute with, are refused here."""
    if resolved.tiles is None:
        return None, None
    mlp = loss = None
    if config.memory.tile_mlp:
        tiled_modules(model)
        mlp = resolved.tiles[0]
    if config.memory.tile_loss and resolved.task.name == "causal_lm":
        check_tiled_loss(model)
        loss = resolved.tiles[1]
    return mlp, loss


def assemble(model: Any, config: PadfreeConfig | dict | str | None = None, *,
             host: PluginHost | None = None) -> Assembly:
    """Make ``model`` padding-free for ``config`` and return everything needed to feed it."""
    config = load_config(config)
    refuse_data_parallel(model)
    refuse_meta_weights(model)
    refuse_prompt_learning(model)
    host = host or PluginHost(block=config.plugins.block)
    inner = unwrap_model(model)
    resolved = _resolve(inner.config, config, host, None, inner)
    for note in resolved.notes:  # plugin precedence, a faster backend the config rules out …
        logger.warning("padfree-plugins: %s", note)
    parts = Parts.build(host, inner.config, config, resolved)
    collator = within_embeddings(refusing_undeclared(parts.collator, forward_parameters(inner)), inner)
    parts = dataclasses.replace(parts, collator=collator)
    check_model = getattr(parts.forward, "check_model", None)
    if check_model is not None:  # the head the task reads (an LM head, a classifier …) exists
        check_model(inner)
    tile_mlp, tile_loss = tiling_of(inner, config, resolved)  # refused before anything is patched
    sequence = layout = None
    if config.sequence_parallel.size > 1:
        share = refuse_sequence_parallel(inner, config, resolved, parts.collator, parts.forward)
        sequence = sequence_group(config.sequence_parallel.size)
        balance, why = balance_choice(config.sequence_parallel.balance, share, config.sequence_parallel.size)
        if config.sequence_parallel.balance == "zigzag" and not balance:
            logger.warning("padfree-plugins: sequence_parallel.balance: %s", why)
        layout = AttentionLayout.of(sequence, share, config.sequence_parallel.balance if balance else "off")
    patch = host.call_first("patch_model", model=inner, architecture=resolved.architecture,
                            backend=resolved.backend, fallback=resolved.fallback, config=config)
    if patch is None:
        raise PluginError(f"no plugin could patch {type(inner).__name__}.{host.filter_note('core')}")
    resolved.answers["patch_model"] = host.answered.get("patch_model")
    note_unused_mixer_backend(config.mixers, resolved.architecture.name, patch)
    if sequence is None and config.unpad != "off" and resolved.architecture.kind == "decoder":
        # padded calls, packed inside the body (not under sequence parallelism: they run the model's own code)
        patch.handles.append(UnpadPatch.install(inner, config.unpad))
    if getattr(parts.forward, "runs_inside_model_forward", False):  # per-example heads, run as the model's forward
        patch.route_compute()
    if resolved.architecture_plugin == PROBE_PLUGIN:
        try:
            verify(inner, resolved.position_start)
        except BaseException:
            patch.undo()
            raise
    if resolved.tiles is not None and config.memory.tile_mixers and sequence is None:
        try:  # the mixers to tile are known once patched: refused before any tiling, the patch undone
            refuse_tiled_mixers_under_zero3(inner)
        except BaseException:
            patch.undo()
            raise
    if tile_mlp is not None:
        patch.handles.append(MLPTiling.install(inner, tile_mlp))
    if resolved.tiles is not None and config.memory.tile_mixers:
        if sequence is None:
            patch.handles.append(MixerTiling.install(inner, resolved.tiles[0]))
        elif sequence_mixers(inner):
            logger.warning("padfree-plugins: memory.tile_mixers: under sequence parallelism each rank scans its "
                           "slice of the row whole; its sequence mixers are not tiled")
    if tile_loss is not None:
        parts = dataclasses.replace(parts, forward=TiledLossForward(parts.forward, tile_loss,
                                                                    LossKernel.of(config.memory.loss_kernel)))
    if sequence is not None:  # each rank computes its slice of the group's row
        media = tuple(getattr(parts.collator, "media_keys", None) or ())
        try:
            patch.handles.append(SequenceParallelPatch.install(patch, sequence, layout, config.sequence_parallel.mixers,
                                                               whole_rows=bool(media)))
        except BaseException:
            patch.undo()
            raise
        parts = dataclasses.replace(parts, forward=SequenceParallelForward(
            parts.forward, sequence, pad_token_of(inner, parts.collator), media))
    return Assembly(inner, config, resolved, patch, parts.collator, parts.pooler, parts.reverter, parts.forward, host)
