"""What a trainer must not have before it is made padding-free: each check refuses (or, for TRL's ``eval_packing``,
warns) while the trainer is unchanged, with what to do instead (a model ``accelerate`` already assembled is
restored).

* parallelism that splits a packed row: ``torch.nn.DataParallel``, accelerate's context / sequence parallelism;
  under padfree's own sequence parallelism (``sequence_parallel.size > 1``) what it does not train yet;
* a ``model_init`` (its new models would not be padding-free);
* a data collator that may build features or labels (only those in :data:`REPLACEABLE_COLLATORS` are replaced);
  transformers' ``DataCollatorForLanguageModeling`` with a ``labels`` column in the train or an eval set;
* over-long, empty or misaligned examples, and datasets laid out in a way the trainer's batches would break;
* a token budget the trainer cannot keep: accelerate's ``split_batches=True``, TRL
  ``packing=True`` rows it would have to split;
* ``prefix_sharing: on`` where repeated prompts cannot be shared (:func:`shares_prefixes`), and with a trainer whose
  plugin shares nothing (:func:`refuse_prefix_sharing`).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from padfree_plugins.batching.sampler import check_whole_micro_batches, combined_loads, example_lengths
from padfree_plugins.errors import BatchError, ConfigError, PadfreeError
from padfree_plugins.modeling.attention.context_parallel import ulysses_share
from padfree_plugins.modeling.mixers import why_no_prompt_state
from padfree_plugins.packing.datacheck import inspect_dataset
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_FEATURE

logger = logging.getLogger("padfree_plugins")


def check_parallelism(trainer: Any, config: Any = None, not_sequence_parallel: str | None = None, *,
                      gathers_logits: bool = False) -> None:
    """Refuse parallelism that splits a batch's rows or a row's tokens without its boundaries (a packed batch is one
    row), and, under padfree's own sequence parallelism (``config.sequence_parallel.size > 1``), what it does not
    train (:func:`check_sequence_parallel`; ``not_sequence_parallel``: why the trainer's plugin does not train
    sequence-parallel, ``None`` when it does; ``gathers_logits``: whether its evaluation gathers the group's logits
    into each rank's own examples)."""
    if getattr(trainer.args, "n_gpu", 1) > 1:
        raise PadfreeError(
            "the trainer would use torch.nn.DataParallel (several GPUs in one process), which splits a batch by "
            "rows; a packed batch is one row. Launch with `accelerate launch` or `torchrun` (one process per "
            "GPU), or make one GPU visible with CUDA_VISIBLE_DEVICES."
        )
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    if parallelism is not None and parallelism.sp_enabled:
        raise PadfreeError(
            "accelerate's sequence parallelism (parallelism_config sp_size > 1): its sp_backend=deepspeed (ALST) "
            "shards [batch, length] tensors and cannot carry a packed row's boundaries (cu_seq_lens). Set sp_size=1 "
            "and use padfree.yaml sequence_parallel: {size: N} instead (Ulysses over packed rows; works with DDP, "
            "FSDP2 and ZeRO)"
        )
    if parallelism is not None and parallelism.cp_enabled:
        raise PadfreeError(
            "context parallelism (parallelism_config cp_size > 1): torch context parallel is broken with packed "
            "sequences upstream (it shards rows without their boundaries; TRL refuses it too). Set cp_size=1; for "
            "rows too long for one device use padfree.yaml sequence_parallel: {size: N} (Ulysses over packed rows)"
        )
    check_model_parallelism(parallelism)
    check_fsdp_enabled(trainer)
    check_sequence_parallel(trainer, config, not_sequence_parallel, gathers_logits=gathers_logits)


def check_fsdp_enabled(trainer: Any) -> None:
    """Refuse ``TrainingArguments(fsdp=…)`` that accelerate did not turn on: accelerate 1.15 never enables FSDP for
    CPU processes (``DistributedType.MULTI_CPU``), and the run would silently train DDP, the whole model on every
    rank."""
    if getattr(trainer.args, "fsdp", None) and getattr(trainer, "is_fsdp_enabled", True) is False:
        state = getattr(getattr(trainer.accelerator, "state", None), "distributed_type", None)
        raise PadfreeError(
            f"TrainingArguments fsdp={trainer.args.fsdp!r} is set, but accelerate did not turn FSDP on ({state}; "
            "accelerate 1.15 never does for CPU processes): the run would silently train DDP with the whole model "
            "on every rank. On CPU drop the fsdp options, or shard with torch's fully_shard in a plain loop "
            "(docs/scaling.md, tests/sharded_run.py)")


def check_model_parallelism(parallelism: Any) -> None:
    """Refuse accelerate's tensor parallelism (``tp_size > 1``) and hybrid sharding (HSDP: ``dp_replicate_size``
    and ``dp_shard_size`` both > 1): neither is verified with packed rows here, and neither runs on CPU (accelerate
    1.15 takes no FSDP there), so they are refused rather than left to train unchecked."""
    if parallelism is None:
        return
    if getattr(parallelism, "tp_enabled", False):
        raise PadfreeError(
            f"tensor parallelism (parallelism_config tp_size={parallelism.tp_size}) is not verified with packed rows "
            "in padfree-plugins (the heads and hidden units each rank holds, the per-example heads and losses over "
            "them): set tp_size=1 and shard the model with FSDP2 (dp_shard_size) or DeepSpeed ZeRO-3, which are "
            "tested to train exactly as one process"
        )
    if getattr(parallelism, "dp_replicate_enabled", False) and getattr(parallelism, "dp_shard_enabled", False):
        raise PadfreeError(
            f"hybrid sharding (HSDP: parallelism_config dp_replicate_size={parallelism.dp_replicate_size} x "
            f"dp_shard_size={parallelism.dp_shard_size}) is not verified with packed rows in padfree-plugins: shard "
            "over every process (dp_replicate_size=1, FSDP2) or replicate only (DDP), both tested to train exactly "
            "as one process"
        )


def sequence_parallel_size(config: Any) -> int:
    """``sequence_parallel.size`` of a padfree config (1 without one)."""
    return int(getattr(getattr(config, "sequence_parallel", None), "size", 1) or 1)


def check_sequence_parallel(trainer: Any, config: Any, not_sequence_parallel: str | None = None, *,
                            gathers_logits: bool = False) -> None:
    """Under ``sequence_parallel.size > 1`` (each rank computes a slice of its group's row, joined from every rank's
    micro-batch), refuse a trainer whose plugin does not train that way (``not_sequence_parallel`` says why), a
    per-rank token count, ``compute_metrics`` where evaluation does not hand each rank its own examples' outputs
    (``gathers_logits`` False: a plugin that does not say it does), and NEFTune. Every builtin plugin that trains
    sequence-parallel hands them (HF ``Trainer`` / ``SFTTrainer`` gather the slices back; TRL's DPO and KTO
    ``compute_metrics`` logits come from TRL's own padded forward of each rank's batch; RewardTrainer scores each
    rank's own texts; GRPO and RLOO hand ``compute_metrics`` nothing)."""
    size = sequence_parallel_size(config)
    if size <= 1:
        return
    where, name = f"sequence_parallel.size: {size}", type(trainer).__name__
    if not_sequence_parallel is not None:
        raise ConfigError(f"{name} is not yet supported under sequence parallelism ({where}): "
                          f"{not_sequence_parallel}. Train it with sequence_parallel.size: 1 (HF Trainer, TRL "
                          "SFTTrainer, DPOTrainer, GRPOTrainer, RLOOTrainer, KTOTrainer and RewardTrainer train "
                          "sequence-parallel)")
    if not getattr(trainer.args, "average_tokens_across_devices", True):
        raise ConfigError(f"{where} with average_tokens_across_devices=False: each rank's loss would be divided by "
                          "its own micro-batch's label count, but its slice of the group's row holds labels of every "
                          "rank's micro-batch. Set average_tokens_across_devices=True (the default)")
    if getattr(trainer, "compute_metrics", None) is not None and not gathers_logits:
        raise ConfigError(f"{where} with compute_metrics: {name}'s trainer plugin does not hand evaluation each "
                          "rank's own examples' outputs (its prediction_step does not gather the group's per-token "
                          "slices back: gathers_logits is off), so compute_metrics would get per-token logits of this "
                          "rank's slice of the group's row, not of its own examples. Evaluate the loss alone (no "
                          "compute_metrics: trainer.evaluate() reports eval_loss, exact under sequence "
                          "parallelism), or compute the metrics with sequence_parallel.size: 1")
    if getattr(trainer, "neftune_noise_alpha", None) is not None:
        raise ConfigError(f"{where} with neftune_noise_alpha: NEFTune scales its noise per example of the batch it "
                          "is given, and each rank embeds a slice of the group's row. Train without NEFTune, or "
                          "with sequence_parallel.size: 1")


def check_model_given(trainer: Any) -> None:
    """Refuse a trainer without a model, or with a ``model_init`` (it would re-create the model unpatched)."""
    if getattr(trainer, "model", None) is None:
        raise PadfreeError("the trainer has no model yet (model_init?): pass a model to the trainer, then accelerate")
    if getattr(trainer, "model_init", None) is not None:
        raise PadfreeError("the trainer has a model_init, which train() (and every hyperparameter-search trial) calls "
                           "for a new model that would not be padding-free: pass the model itself, "
                           "Trainer(model=model_init(), ...), then accelerate")


#: Collators whose work the packing collator does (padding, labels from input_ids, flattening): replacing them
#: changes nothing but the padding. Any other collator may compute features or labels, and is refused.
REPLACEABLE_COLLATORS = {
    "transformers": ("DataCollatorWithPadding", "DataCollatorForSeq2Seq", "DataCollatorWithFlattening",
                     "DataCollatorForLanguageModeling", "DefaultDataCollator", "default_data_collator"),
    "trl": ("DataCollatorForLanguageModeling", "DataCollatorForPreference"),
}


def check_collator(collator: Any) -> None:
    """Refuse to replace a data collator that may build features or labels of its own (never silently wrong)."""
    if collator is None:
        return
    kind = collator if inspect.isfunction(collator) else type(collator)
    name, module = getattr(kind, "__name__", ""), getattr(kind, "__module__", "") or ""
    library = module.split(".")[0]
    if name in REPLACEABLE_COLLATORS.get(library, ()) and not getattr(collator, "mlm", False):
        return
    raise PadfreeError(
        f"the trainer's data_collator is {module}.{name}, which padfree-plugins would replace with its packing "
        "collator: that keeps input_ids and the dataset's labels (-100 where no loss) but nothing a custom collator "
        "computes. Build such features and labels in the dataset (dataset.map), or, if the collator only pads, set "
        "trainer.data_collator = None before accelerating."
    )


def language_modeling_pad_id(trainer: Any) -> int | None:
    """The pad id of the trainer's collator when it is transformers' ``DataCollatorForLanguageModeling`` (causal):
    it builds the labels from ``input_ids`` with every token equal to the pad id at -100 — real ones too (an EOS
    that doubles as the pad token). Replacing it keeps that, and refuses a dataset ``labels`` column, which that
    collator overwrites and padfree-plugins would keep (the two trainings would differ)."""
    collator = trainer.data_collator
    if type(collator).__name__ != "DataCollatorForLanguageModeling" or not type(collator).__module__.startswith(
            "transformers") or getattr(collator, "mlm", False):
        return None
    for what, dataset in trainer_datasets(trainer):
        if "labels" in (getattr(dataset, "column_names", None) or ()):
            raise PadfreeError(
                f"the trainer's DataCollatorForLanguageModeling overwrites the {what} dataset's labels column with "
                "input_ids (your -100 masks are lost in padded training), and padfree-plugins would keep it: remove "
                "the column to train on every token as that collator does, or set trainer.data_collator = None to "
                "keep your labels"
            )
    return getattr(getattr(collator, "tokenizer", None), "pad_token_id", None)


def trainer_datasets(trainer: Any) -> list[tuple[str, Any]]:
    """The trainer's training and evaluation sets that are set, named for messages: ``train``, ``eval``, or
    ``eval (name)`` for each of several."""
    evals = trainer.eval_dataset
    named = dict(evals) if isinstance(evals, Mapping) else {"": evals}
    datasets = [("train", trainer.train_dataset)] + [(f"eval ({name})" if name else "eval", dataset)
                                                      for name, dataset in named.items()]
    return [(what, dataset) for what, dataset in datasets if dataset is not None]


def check_datasets(trainer: Any, collator: Any) -> dict[str, np.ndarray]:
    """Find over-long, empty or misaligned examples before training starts (see
    :mod:`padfree_plugins.packing.datacheck`),
    and a training or evaluation set laid out in a way the trainer's batches would break (the collator's
    ``check_trainer_dataset``). Returns, by the dataset's name (:func:`trainer_datasets`), the rows truncation leaves
    without a label (``on_overlong: truncate``), for datasets that have any."""
    layout_check = getattr(collator, "check_trainer_dataset", None)
    unlabelled = {}
    for what, dataset in trainer_datasets(trainer):
        check_tokenized(dataset, collator, what)
        report = inspect_dataset(dataset, collator, what)
        if report.unlabelled.size:
            unlabelled[what] = report.unlabelled
        if layout_check is not None:
            layout_check(dataset)
    return unlabelled


def without_rows(dataset: Any, rows: np.ndarray) -> Any:
    """``dataset`` without ``rows``: a ``datasets.Dataset`` selected (no copy), a list of rows as a new list."""
    kept = np.setdiff1d(np.arange(len(dataset)), rows)
    if hasattr(dataset, "select"):
        return dataset.select(kept)
    return [dataset[int(i)] for i in kept]


def _text_columns(dataset: Any) -> tuple[list[str], list[str]]:
    """(every column, the columns of strings) of a ``datasets.Dataset`` (from its features) or a list of rows (from
    the first); ``([], [])`` for a dataset that says neither."""
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping):
        texts = [name for name, feature in features.items()
                 if getattr(feature, "dtype", None) in ("string", "large_string")]
        return list(features), texts
    if isinstance(dataset, Sequence) and len(dataset) and isinstance(dataset[0], Mapping):
        return list(dataset[0]), [name for name, value in dataset[0].items() if isinstance(value, str)]
    return [], []


def _how_to_tokenize(texts: list[str], collator: Any) -> str:
    """How to tokenize the text columns ``texts`` for ``collator``: a ``dataset.map`` call, or TRL's SFTTrainer."""
    removed = ", ".join(f'"{column}"' for column in texts)
    if getattr(collator, "columns", None) is not None:  # the embedding task: one <column>_input_ids per text
        return (f'tokenize it first: dataset = dataset.map(lambda row: {{f"{{c}}_input_ids": '
                f'tokenizer(row[c])["input_ids"] for c in ({removed}{"," if len(texts) == 1 else ""})}}, '
                f"remove_columns=[{removed}])")
    if {"prompt", "completion"} <= set(texts):
        return ("tokenize it first (input_ids of prompt + completion, labels -100 on the prompt tokens), or train "
                "with TRL's SFTTrainer, which tokenizes prompt + completion rows itself")
    return (f'tokenize it first: dataset = dataset.map(lambda row: tokenizer(row["{texts[0]}"]), '
            f'remove_columns=["{texts[0]}"])')


def check_tokenized(dataset: Any, collator: Any, name: str = "train") -> None:
    """Refuse a dataset of text where the collator reads token ids: strings in an ``input_ids`` column, or text
    columns without any token-id column (the trainer would drop them, then find no column the model takes). A
    collator that processes raw rows itself (``processing``: TRL's vision-language rows) is left alone."""
    if getattr(collator, "processing", None) is not None:
        return
    columns, texts = _text_columns(dataset)
    if not texts:
        return
    id_columns = tuple(getattr(collator, "id_columns", None) or ())

    def holds_ids(column: str) -> bool:
        return column == "input_ids" or column.endswith("_input_ids") or column in id_columns

    as_ids = [column for column in texts if holds_ids(column)]
    if as_ids:
        raise BatchError(f"the {name} dataset's {as_ids[0]!r} column holds text (strings), not token ids: "
                         f"{_how_to_tokenize(as_ids, collator)}")
    if not any(holds_ids(column) for column in columns):
        raise BatchError(f"the {name} dataset has text ({', '.join(map(repr, texts))}), not input_ids: "
                         f"{_how_to_tokenize(texts, collator)}")


def check_token_budget(trainer: Any, config: Any) -> None:
    """``batching.strategy: tokens`` on this trainer: accelerate's ``split_batches=True`` would cut the planned
    micro-batches across ranks; a length column (``batching.length_column``) must hold every row's own token count
    (:func:`~padfree_plugins.batching.sampler.example_lengths` checks it); TRL ``packing=True`` rows (up to
    ``max_length`` tokens) are the examples, and cannot be split without losing the sequence boundaries inside them."""
    batching = getattr(config, "batching", None)
    if getattr(batching, "strategy", "examples") != "tokens":
        return
    check_whole_micro_batches(trainer.accelerator)
    dataset = trainer.train_dataset
    if batching.length_column in (getattr(dataset, "column_names", None) or ()):
        example_lengths(dataset, length_column=batching.length_column)  # checked against the rows' own lengths
    if not getattr(trainer.args, "packing", False):
        return
    longest = getattr(trainer.args, "max_length", None)
    if batching.on_overlong_example == "split":
        raise ConfigError("batching.on_overlong_example: split cannot cut TRL's packed rows (each holds several "
                          "examples' boundaries); use error, with max_tokens_per_batch at least TRL's max_length")
    if longest is not None and batching.max_tokens_per_batch < longest:
        raise ConfigError(f"batching.max_tokens_per_batch={batching.max_tokens_per_batch} is less than TRL's "
                          f"max_length={longest}: with packing=True, TRL's packed rows are the examples; raise the "
                          "budget to at least max_length")


def note_trl_eval_packing(trainer: Any) -> None:
    """TRL ``eval_packing=True`` without its padding-free collator (``packing=False``): TRL evaluates each packed row
    as one sequence, its examples attending to each other; here every example is evaluated on its own (the row's
    ``seq_lengths`` are kept), so ``eval_loss`` and the eval metrics differ from TRL's a little. Said, not refused."""
    args = trainer.args
    if (not getattr(args, "eval_packing", None) or getattr(trainer, "padding_free", True)
            or trainer.eval_dataset is None or getattr(args, "packing_strategy", "bfd") == "wrapped"):
        return
    warnings.warn("eval_packing=True with packing=False: TRL's own evaluation lets the examples packed into one eval "
                  "row attend to each other; padfree-plugins evaluates each example on its own, so eval_loss and the "
                  "eval metrics differ slightly from TRL's. Set packing=True as well (TRL then keeps the boundaries "
                  "too) or eval_packing=False to compare like with like.", stacklevel=3)


def refuse_own_batches_options(trainer: Any, config: Any, name: str, batches: str, noise: str,
                               budgets: bool = False) -> None:
    """Refuse what a trainer that keeps its own padded batches cannot do packed: a token budget (``batches``
    says whose batches they are; unless the plugin ``budgets`` its rows itself) and NEFTune (``noise`` says where the
    trainer's hook would see the packed row), and prompt groups (``batching.group_prefixes``)."""
    if config.batching.group_prefixes:
        raise ConfigError(f"batching.group_prefixes: {name} keeps {batches} (prompt groups are laid out for HF Trainer "
                          "and SFTTrainer). Remove batching.group_prefixes")
    if config.batching.strategy == "tokens" and not budgets:
        raise ConfigError(
            f"batching.strategy: tokens fills packed batches up to a token budget, but {name} keeps {batches}: use "
            "batching.strategy: examples")
    if getattr(trainer, "neftune_noise_alpha", None) is not None:
        raise PadfreeError(
            f"neftune_noise_alpha with {name}: the trainer's NEFTune hook scales its noise by the length of the "
            f"row it sees, which {noise}")


def why_prompts_not_shared(trainer: Any, assembly: Any, prompt_column: bool = True,
                           splits_shared_rows: bool = False) -> str | None:
    """Why ``trainer``'s packed rows cannot hold each repeated prompt once (see :mod:`padfree_plugins.packing.
    prefixes`), or ``None``. ``prompt_column``: rows repeat a prompt only when the dataset has a prompt column (TRL's
    preference and RL trainers; a RewardTrainer's pairs share whatever tokens they begin with).
    ``splits_shared_rows``: the trainer's plugin splits a shared row across a sequence-parallel group (the fused
    log-probability calls): then only what the split row cannot do is a reason (:func:`why_not_split_shared`)."""
    config, plan = assembly.config, assembly.plan
    size = sequence_parallel_size(config)
    if size > 1 and not splits_shared_rows:
        return f"a shared row is not split across ranks (sequence_parallel.size: {size})"
    if size > 1 and (reason := why_not_split_shared(assembly, size)):
        return reason
    if plan.architecture.kind != "decoder":
        return f"a shared prompt is read causally, and {plan.architecture.name} is an {plan.architecture.kind}"
    if getattr(trainer, "_is_vision_dataset", False) or getattr(trainer, "_is_vlm", False):
        collator = getattr(assembly, "collator", None)
        why = getattr(collator, "why_prompts_not_shared", "its family declares no multimodal collator")
        if why:
            return f"image-text prompts of {plan.architecture.name} are not shared: {why}"
    for backend in (plan.backend, plan.fallback):
        if backend is not None and SHARED_PREFIXES_FEATURE not in backend.features:
            return f"the {backend.name!r} attention backend does not take shared prefixes (exact and flash_attn do)"
    if reason := why_no_prompt_state(assembly.model, getattr(config, "mixers", "auto")):
        return f"{plan.architecture.name} runs sequence mixers: {reason}"
    if getattr(trainer, "aux_loss_enabled", False):
        return ("the MoE router aux loss is not a sum over tokens, so a prompt counted once would change it: set "
                "router_aux_loss_coef=0.0 to share prompts")
    columns = getattr(getattr(trainer, "train_dataset", None), "column_names", None)
    if prompt_column and columns is not None and not any(column.startswith("prompt") for column in columns):
        return f"its dataset has no prompt column (columns: {', '.join(columns)}), so no row repeats a prompt"
    return None


def why_not_split_shared(assembly: Any, size: int) -> str | None:
    """Why a shared row cannot be split across a sequence-parallel group of ``size`` for ``assembly``'s model, or
    ``None``: attention must be Ulysses alone (after its all-to-all every rank holds the whole row of its heads, so
    a completion's prompt is there whichever rank's slice holds it) or all-gather alone (each slice's queries against
    their segments' keys of the gathered row); Ulysses within blocks mixed with all-gather across them is not tested
    with shared rows. Sequence mixers take a split shared row either way: split (each segment starts from its
    parent's final state, handed on from the rank where the parent ended) or gathered (the whole row on every rank);
    a mixer that cannot start from a state at all is refused by :func:`why_prompts_not_shared` itself."""
    config = assembly.config
    heads = getattr(assembly.model.config.get_text_config(), "num_attention_heads", None)
    share, _ = ulysses_share(config.sequence_parallel.attention, heads, size)
    if 1 < share < size:
        return (f"under sequence_parallel.size: {size} attention runs Ulysses over blocks of {share} ranks mixed with "
                f"all-gather across them (sequence_parallel.attention: {config.sequence_parallel.attention}, {heads} "
                "heads), which is not yet supported with shared prefixes; use sequence_parallel.attention: ulysses "
                "with a size that divides the attention heads, or allgather")
    return None


def shares_prefixes(trainer: Any, assembly: Any, prompt_column: bool = True, splits_shared_rows: bool = False,
                    refusal: str | None = None) -> bool:
    """Whether ``trainer``'s packed rows share repeated prompts under the config's ``prefix_sharing``: ``off`` never;
    ``auto`` where :func:`why_prompts_not_shared` finds no reason against (the reason is logged); ``on`` the same,
    refusing (a :class:`ConfigError`, nothing changed yet) where it cannot apply. ``refusal``: a reason the trainer's
    plugin knows itself, which comes first."""
    mode = getattr(assembly.config, "prefix_sharing", "off")
    if mode == "off":
        return False
    name = type(trainer).__name__
    reason = refusal or why_prompts_not_shared(trainer, assembly, prompt_column, splits_shared_rows)
    if reason and mode == "on":
        raise ConfigError(f"prefix_sharing: on with {name}: {reason}. Set prefix_sharing: auto (shared where it "
                          "applies) or off")
    if reason:
        logger.info("padfree-plugins: prompts are not shared for %s: %s", name, reason)
    return reason is None


#: The trainers whose builtin plugins share repeated prompts (``prefix_sharing``), for messages.
SHARING_TRAINERS = ("HF Trainer, TRL SFTTrainer, DPOTrainer, RewardTrainer, GRPOTrainer, RLOOTrainer and "
                    "KTOTrainer")


def refuse_prefix_sharing(trainer: Any, config: Any, plugin: str) -> None:
    """For a trainer whose plugin (named ``plugin``) shares no prompts: ``prefix_sharing: on`` refused (a
    :class:`ConfigError`, nothing changed yet); ``auto`` is off, and the log says why, as :func:`shares_prefixes`
    does."""
    mode = getattr(config, "prefix_sharing", "off")
    if mode == "off":
        return
    name = type(trainer).__name__
    reason = (f"its plugin ({plugin}) trains every example whole, so no prompt is shared (prompts are shared by the "
              f"plugins of {SHARING_TRAINERS})")
    if mode == "on":
        raise ConfigError(f"prefix_sharing: on with {name}: {reason}. Set prefix_sharing: auto or off")
    logger.info("padfree-plugins: prompts are not shared for %s: %s", name, reason)


def check_whole_rows_budget(trainer: Any, batching: Any, lengths: Callable[[], Any], rows: str) -> None:
    """``batching.strategy: tokens`` for a trainer whose rows are trained whole (preference pairs, KTO rows):
    ``split_batches`` and ``on_overlong_example: split`` refused, and every row's tokens (``lengths()``, read only for
    a dataset with a length) within the budget — a :class:`BatchError` naming the first row over it."""
    name = type(trainer).__name__
    check_whole_micro_batches(trainer.accelerator)
    if batching.on_overlong_example == "split":
        raise ConfigError(f"batching.on_overlong_example: split cannot cut {name}'s {rows}s (each is trained whole: "
                          f"its texts are compared): use error, with a budget of at least the longest {rows}")
    if trainer.train_dataset is None or not hasattr(trainer.train_dataset, "__len__"):
        return
    tokens = np.asarray(lengths())
    over = np.flatnonzero(tokens > batching.max_tokens_per_batch)
    if over.size:
        raise BatchError(f"{rows} {int(over[0])} of {name}'s dataset holds {int(tokens[over[0]])} tokens, more than "
                         f"batching.max_tokens_per_batch={batching.max_tokens_per_batch} ({over.size} such {rows}(s), "
                         f"the longest {int(tokens[over].max())}); a {rows} is never split: raise the budget or lower "
                         "max_length")


def image_text_loads(name: str, tokens: np.ndarray, pixels: np.ndarray, batching: Any) -> np.ndarray:
    """Every image-text row's share of the budgets (its tokens, or with ``max_pixels_per_batch`` its combined load,
    :func:`~padfree_plugins.batching.sampler.combined_loads`); a :class:`BatchError` naming the first row over
    either budget (``name``: the trainer's, for the message)."""
    remedies = {"tokens": "raise the budget or lower max_length",
                "pixels": "raise the budget, or resize the images (the processor's max_pixels / size)"}
    for sizes, limit, what in ((tokens, batching.max_tokens_per_batch, "tokens"),
                               (pixels, batching.max_pixels_per_batch, "pixels")):
        over = np.flatnonzero(sizes > limit) if limit is not None else np.zeros(0, dtype=np.int64)
        if over.size:
            raise BatchError(f"row {int(over[0])} of {name}'s dataset holds {int(sizes[over[0]])} {what} (image "
                             f"placeholders are tokens), more than batching.max_{what}_per_batch={limit} "
                             f"({over.size} such row(s), the largest {int(sizes[over].max())}); a row with images "
                             f"is never split: {remedies[what]}")
    if batching.max_pixels_per_batch is None:
        return tokens
    return combined_loads(tokens, pixels, batching.max_tokens_per_batch, batching.max_pixels_per_batch)
