"""The acceleration config (``padfree.yaml``): typed dataclasses, loaded and validated strictly.

Unknown keys are errors that suggest the nearest valid key; every value is checked against its type and its
allowed values. Names that plugins provide (tasks, attention backends, architectures) are checked against the
installed plugins at assembly, where the host knows them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from padfree_plugins.errors import ConfigError, did_you_mean


def _help(text: str, *, minimum: int | None = None, **kwargs: Any) -> Any:
    return field(metadata={"help": text, "minimum": minimum}, **kwargs)


@dataclass
class PluginsConfig:
    """Which plugins this config relies on or refuses."""

    require: list[str] = _help("plugins that must load; the config fails if one is missing or broken",
                               default_factory=list)
    block: list[str] = _help("plugins never to load for this config", default_factory=list)


@dataclass
class BatchingConfig:
    """How training batches are formed: a fixed number of examples, or a token budget filled by bin packing."""

    strategy: Literal["examples", "tokens"] = _help(
        "examples: the trainer's usual fixed number of examples per batch; tokens: micro-batches filled up to "
        "max_tokens_per_batch by bin packing, balanced across ranks", default="examples")
    max_tokens_per_batch: int | None = _help(
        "token budget of one micro-batch on one rank (required with strategy: tokens)", default=None, minimum=1)
    max_pixels_per_batch: int | None = _help(
        "with strategy: tokens, also a budget of the pixels the vision tower embeds per micro-batch on one rank (every "
        "image, tile or patch as the processor resized it, height x width, as often as the forwards compute it); "
        "both budgets are kept. Image-text examples of HF Trainer / SFTTrainer and DPO pairs", default=None,
        minimum=1)
    window: int = _help("examples shuffled and packed together at a time; more packs tighter, fewer mixes more "
                        "(raised to at least 4 steps' worth of tokens)", default=1024, minimum=1)
    on_overlong_example: Literal["error", "split"] = _help(
        "an example longer than max_tokens_per_batch: error, or split into chunks trained as independent examples "
        "(positions restart in every chunk)", default="error")
    seed: int | None = _help("shuffle seed; each epoch reshuffles (null: the trainer's data_seed or seed, else 0)",
                             default=None)
    drop_last: bool = _help("cut every epoch to the fewest steps its shuffles pack into, dropping the last, lightest "
                            "steps; their examples sit out that epoch (default: every example once per epoch, the "
                            "last steps lighter)", default=False)
    length_column: str = _help("dataset column with example lengths, used when present and checked against "
                               "input_ids at accelerate() (otherwise lengths are computed once from input_ids)",
                               default="length")
    group_prefixes: bool = _help(
        "HF Trainer / SFTTrainer with strategy: examples: micro-batches that keep the examples of one prompt together "
        "(an equal unlabelled prefix: best-of-N answers), groups shuffled each epoch, so that prefix_sharing computes "
        "each prompt once. It changes which examples meet in a step (see docs/prefix-sharing.md)", default=False)

    def __post_init__(self) -> None:
        if self.group_prefixes and self.strategy == "tokens":
            raise ConfigError("batching.group_prefixes lays whole prompt groups into the trainer's micro-batches of a "
                              "fixed number of examples (strategy: examples); with strategy: tokens set "
                              "group_prefixes: false")
        if self.strategy == "tokens" and self.max_tokens_per_batch is None:
            raise ConfigError("batching.max_tokens_per_batch is not set: strategy: tokens needs the number of tokens "
                              "one rank processes per micro-batch (e.g. 4 x the longest example)")
        if self.strategy == "examples" and self.max_pixels_per_batch is not None:
            raise ConfigError(f"batching.max_pixels_per_batch: {self.max_pixels_per_batch} is set, but strategy is "
                              "examples: a pixel budget is kept beside a token budget (strategy: tokens with "
                              "max_tokens_per_batch); add them, or remove max_pixels_per_batch")
        if self.strategy == "examples" and self.max_tokens_per_batch is not None:
            raise ConfigError(f"batching.max_tokens_per_batch: {self.max_tokens_per_batch} is set, but strategy is "
                              "examples (the default), which keeps the trainer's fixed number of examples per batch "
                              "and ignores a token budget: add strategy: tokens to the batching section to use it, "
                              "or remove max_tokens_per_batch")


@dataclass
class SequenceParallelConfig:
    """Sequence parallelism: the ranks of a group train one packed row, each computing a slice of it."""

    size: int = _help(
        "ranks that share one packed row (1: off). Each group of size consecutive ranks joins its micro-batches into "
        "one row; every rank computes 1/size of its tokens, attention sees the whole row (attention), sequence "
        "mixers pass their state across the cuts (mixers). Must divide the number of processes (and, for attention: "
        "ulysses, the attention heads)", default=1, minimum=1)
    attention: Literal["auto", "ulysses", "allgather"] = _help(
        "how attention sees the whole row: ulysses (all-to-all from tokens to heads and back; size must divide the "
        "attention heads); allgather (each rank gathers the row's keys and values and attends its own slice of "
        "queries to them: any size, the row's keys and values on every rank; with the exact or flash_attn "
        "backend); auto (ulysses where size divides the heads; else Ulysses over the largest factor of "
        "size that divides the heads and allgather over the rest, or allgather alone; with a warning)",
        default="auto")
    balance: Literal["auto", "off", "zigzag"] = _help(
        "causal attention work across the ranks that attend by all-gather (attention: allgather, or the all-gather "
        "across Ulysses blocks): zigzag (the row cut into 2 x ranks chunks, rank r attends the queries of chunks r "
        "and 2 x ranks - 1 - r, exchanged by all-to-all before the attention and sent back after it; the rest of the "
        "layer keeps its contiguous slices; exact); off (each rank attends its own slice's queries: the rank holding "
        "the end of a long example does the most work); auto (zigzag wherever attention runs all-gather, for the rows "
        "whose contiguous slices are unbalanced: the largest slice's causal work above 1.1 x the mean; nothing to "
        "balance under Ulysses alone)", default="auto")
    mixers: Literal["split", "gather"] = _help(
        "sequence mixers of hybrid models (gated delta rule, KDA, Mamba2, short conv) under sequence parallelism: "
        "split (each rank runs its own slice; an example crossing a cut continues from the previous rank's final "
        "state and conv taps, passed point to point; Mamba1 mixers, which cannot start from a state, run gathered, "
        "with a warning); gather (every rank runs the mixer on the whole row, its input all-gathered: more memory "
        "and compute, no wait at a cut)", default="split")


@dataclass
class MemoryConfig:
    """Tiled computation of the layers whose working set grows with the row (see docs/memory.md)."""

    tile_tokens: int | Literal["auto"] | None = _help(
        "tiles of a row's tokens for the MLP of every decoder layer and for the LM head with its loss, each recomputed "
        "tile by tile in the backward, so their activations are one tile's, not the row's (exact: same loss and "
        "gradients). null: off (the default); auto: MLP tiles of max(1024, hidden_size) tokens and loss tiles whose "
        "logits are no larger than an MLP tile's intermediate (at least 128 tokens); a number: tiles of that many "
        "tokens. A row no longer than a tile runs untiled", default=None)
    tile_mlp: bool = _help("with tile_tokens: tile the feed-forward of every decoder layer (a dense MLP, or the routed "
                           "and shared experts of a mixture of experts)", default=True)
    tile_loss: bool = _help("with tile_tokens: tile the LM head and its cross-entropy in the loss-only calls of HF "
                            "Trainer and of assembly.forward on a batch with labelled logits (the logits of the whole "
                            "row are never built)", default=True)
    loss_kernel: Literal["auto", "torch", "liger"] = _help(
        "what computes the tiled LM head and loss: auto (Liger's fused linear cross-entropy where liger-kernel is "
        "installed and the call fits: CUDA tensors of float32, bfloat16 or float16; the torch tiles otherwise); "
        "torch (the torch tiles); liger (as auto, but an error at accelerate() where liger-kernel is not installed, "
        "and a warning, once per kind, for calls it does not fit). Install it with pip install "
        "'padfree-plugins[liger]'. Both compute the same loss (sum over labelled tokens, -100 ignored, label "
        "smoothing, divided by num_items_in_batch or the label count)", default="auto")
    tile_mixers: bool = _help("with tile_tokens: scan the sequence mixers of a hybrid (gated delta rule, Mamba2, KDA) "
                              "in tiles of the MLP's size, each tile continuing the previous tile's state, "
                              "recomputed tile by tile in the backward (Mamba1 mixers, LFM2's short conv, and mixers "
                              "under sequence parallelism stay whole, with a warning)", default=True)

    def __post_init__(self) -> None:
        tokens = self.tile_tokens
        if tokens is not None and tokens != "auto" and tokens < 1:
            raise ConfigError(f"memory.tile_tokens: {tokens}: a tile holds at least 1 token; give a number of tokens "
                              "(e.g. 4096), auto, or null for no tiling")
        if self.loss_kernel == "liger" and (tokens is None or not self.tile_loss):
            off = "memory.tile_tokens: null" if tokens is None else "memory.tile_loss: false"
            raise ConfigError(f"memory.loss_kernel: liger computes the tiled loss, which is off ({off}): set "
                              "memory.tile_tokens (e.g. auto) with memory.tile_loss: true, or remove loss_kernel")


@dataclass
class PadfreeConfig:
    """Everything ``padfree.yaml`` can say. Defaults give padding-free causal-LM training with the fastest
    attention backend available on the machine."""

    task: str = _help("training task: causal_lm, seq_cls, reranker, embedding, hidden_states, or one a plugin "
                      "provides", default="causal_lm")
    attention: str = _help("attention backend: auto (fastest available), exact, repad, varlen, flash_attn, or a "
                           "plugin's", default="auto")
    architecture: str = _help("architecture plugin to use: auto (from config.model_type), an architecture name, or "
                              "probe (an undeclared model type, accepted after an equivalence check)", default="auto")
    attention_dropout: Literal["keep", "disable"] = _help(
        "keep: attention-probability dropout as the model defines it (the varlen backend cannot do it, so auto then "
        "picks flash_attn, repad or exact); disable: no attention dropout, so varlen can run (hidden dropout "
        "unaffected)", default="keep")
    mixers: Literal["auto", "exact", "kernels"] = _help(
        "sequence-mixer backend of hybrid models (gated delta rule, KDA, Mamba scans): auto (kernels where the "
        "family has a boundary-aware CUDA route and its packages are installed, else exact); exact (every example "
        "alone, equal lengths batched, transformers' own code); kernels (flash-linear-attention / causal-conv1d / "
        "mamba-ssm with the boundaries; CUDA only)", default="auto")
    unpad: Literal["auto", "always", "off"] = _help(
        "ordinary padded batches given to a patched decoder (a Trainer subclass's own compute_loss, TRL, a loop of "
        "your own): auto (training forwards run padding-free inside the model, outputs scattered back to the padded "
        "shape); always (evaluation and no_grad forwards too); off (the model's own padded code)", default="auto")
    prefix_sharing: Literal["auto", "on", "off"] = _help(
        "preference, reward and RL trainers (TRL DPO, Reward, GRPO, RLOO, KTO), and HF Trainer / SFTTrainer on "
        "causal_lm (examples of a micro-batch that begin with the same unlabelled tokens: best-of-N answers, a "
        "conversation split per turn): each prompt computed once in a packed row, followed by its completions (exact: "
        "they attend to it and continue its positions); auto (where the attention backend takes shared prefixes, the "
        "model is a decoder whose sequence mixers, if any, start from a prompt's state (not Mamba1; not mixers: "
        "kernels) and the batch holds a repeated prompt); on (the same, refused where it cannot apply and with "
        "trainers that share nothing: a Trainer subclass with its own loss); off. "
        "YAML's booleans (a bare on / off) are read as on / off", default="auto")
    max_length: int | None = _help("longest example in tokens (default: no limit)", default=None, minimum=1)
    on_overlong: Literal["error", "truncate"] = _help("what to do with an example longer than max_length (truncate: "
                                                      "rows left without a label are dropped, with a warning)",
                                                      default="error")
    pooling: str | None = _help("per-example pooling for the embedding and hidden_states tasks: first (cls), last, "
                                "mean, max, weighted_mean, mean_sqrt_len, or a plugin's (default: the model's)",
                                default=None)
    task_options: dict[str, Any] = _help("options passed to the task plugin", default_factory=dict)
    plugins: PluginsConfig = _help("plugins this config requires or blocks", default_factory=PluginsConfig)
    batching: BatchingConfig = _help("how training batches are formed (token budget, balance across ranks)",
                                     default_factory=BatchingConfig)
    sequence_parallel: SequenceParallelConfig = _help(
        "sequence parallelism over packed rows (long examples split across ranks)",
        default_factory=SequenceParallelConfig)
    memory: MemoryConfig = _help("tiled MLP and loss for long rows (activation memory of one tile, not the row's)",
                                 default_factory=MemoryConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, source: str = "config") -> "PadfreeConfig":
        return _build(cls, data or {}, source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(config: str | Path | dict[str, Any] | PadfreeConfig | None) -> PadfreeConfig:
    """A :class:`PadfreeConfig` from a YAML path, a dict, an existing config or ``None`` (all defaults)."""
    if config is None:
        return PadfreeConfig()
    if isinstance(config, PadfreeConfig):
        return config
    if isinstance(config, dict):
        return PadfreeConfig.from_dict(config)
    if not isinstance(config, (str, Path)):
        raise ConfigError(f"an acceleration config is a YAML path, a dict or a PadfreeConfig, not "
                          f"{type(config).__name__} {config!r}")
    path = Path(config)
    if path.is_dir():
        raise ConfigError(f"acceleration config {str(path)!r} is a directory; give the path of its YAML file")
    if not path.is_file():
        raise ConfigError(f"acceleration config {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, not {type(data).__name__}")
    return PadfreeConfig.from_dict(data, source=str(path))


def describe_fields(cls: type = PadfreeConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, type, help) for every key, nested sections flattened with dots: the config's schema, with which the
    tests check that every key is documented and accepted."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe_fields(hint, f"{prefix}{f.name}."))
        else:
            rows.append((prefix + f.name, _type_name(hint), f.metadata.get("help", "")))
    return rows


# -- validation ----------------------------------------------------------------------------------------------------


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(hint))
        return f"{origin.__name__}[{args}]"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def bare_word_hint(value: Any) -> str:
    """For a value YAML may have read from a bare word meant as text (``on``, ``no``, ``1``): quote it."""
    if isinstance(value, bool):
        return (f" YAML reads a bare on, off, yes, no, true or false as a boolean (here {value}): write the word you "
                "meant in quotes")
    if isinstance(value, (int, float)):
        return f" YAML reads {value!r} as a number: write it in quotes ('{value}') where it is meant as text"
    return ""


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(
                f"{where}: unknown key {key!r}.{did_you_mean(str(key), fields)} Valid keys: {', '.join(fields)}."
            )
        values[key] = _check(hints[key], value, f"{where}: {key}")
        minimum = fields[key].metadata.get("minimum")
        if minimum is not None and values[key] is not None and values[key] < minimum:
            raise ConfigError(f"{where}: {key} must be at least {minimum}, got {values[key]}")
    return cls(**values)


def _check(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, where)  # an empty section (keys commented out)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _check(option, value, where)
            except ConfigError:
                continue
        bare = bare_word_hint(value) if str in args else ""
        raise ConfigError(f"{where} must be {_type_name(hint)}, got {value!r}{'.' + bare if bare else ''}")
    if origin is Literal:
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            word = "on" if value else "off"
            if word in args:  # YAML 1.1 reads a bare on / off (yes / no, true / false) as a boolean
                return word
        if value not in args:
            allowed = ", ".join(map(repr, args))
            hint = did_you_mean(str(value), map(str, args))
            bare = bare_word_hint(value) if isinstance(value, bool) else ""
            raise ConfigError(f"{where} must be one of {allowed}, got {value!r}.{hint}{bare}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_check(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if value is None:  # an empty section
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where} must be a non-empty string, got {value!r}.{bare_word_hint(value)}")
        return value
    if hint is Any:
        return value
    raise ConfigError(f"{where}: cannot check values of type {hint!r}")  # pragma: no cover - schema bug
