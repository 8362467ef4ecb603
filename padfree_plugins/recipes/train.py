"""``padfree-plugins train``: fine-tune a causal LM padding-free with HF ``Trainer``, from the command line.

Every ``TrainingArguments`` flag passes through (``--learning_rate``, ``--bf16``, ``--gradient_accumulation_steps``,
…), plus the script's own (:class:`TrainScriptArguments`) and ``--acceleration_config`` (:class:`~padfree_plugins.
arguments.AccelerationArguments`). With no model and no dataset it runs its embedded default: a tiny Llama built
from a config, a byte-level BPE tokenizer trained on the spot, and the instruction dataset shipped in
``padfree_plugins/data`` — no downloads, well under a minute on two CPU cores.

``--output_dir DIR`` receives the checkpoints (``--save_strategy``) and, after training, the trained model and its
tokenizer; ``--resume_from_checkpoint DIR/checkpoint-N`` continues a run from one of its checkpoints.

Everything that can be wrong with the input is checked before the first step: the acceleration config, the
architecture and attention backend (``plan``), the dataset (examples longer than the model takes, labels not
aligned with ``input_ids``, empty examples), in that order.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from padfree_plugins.config.model_configs import load_model_config, local_directory
from padfree_plugins.config.schema import PadfreeConfig
from padfree_plugins.data.loading import PROMPT_TEMPLATE, load_rows, quietly, row_format, tokenize
from padfree_plugins.data.tokenizer import train_tokenizer
from padfree_plugins.errors import ConfigError, PadfreeError
from padfree_plugins.integrations.arguments import AccelerationArguments

#: TrainingArguments of the embedded default (any of them can still be given on the command line).
EMBEDDED_FLAGS = [
    "--num_train_epochs", "3", "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32",
    "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine", "--warmup_steps", "6", "--weight_decay", "0.0",
    "--save_strategy", "no", "--seed", "0",
]
#: TrainingArguments defaults of the command (overridable): quiet, countable, nothing reported anywhere.
COMMON_FLAGS = ["--report_to", "none", "--disable_tqdm", "true", "--include_num_input_tokens_seen", "true"]
#: Without --logging_steps, a run logs every step up to this many steps; a longer one every ceil(steps / this)
#: steps (at most logging_steps, 500 by default), so between half this many and this many times up to 25,000 steps.
LOGGED_STEPS = 50
#: TrainingArguments flags ``--help`` lists after the command's own, in this order (``--help-all``: every flag).
COMMON_TRAINING_FLAGS = (
    "output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "bf16", "logging_steps",
    "save_strategy", "seed", "report_to",
)
TRAINING_ARGUMENTS_DOCS = "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"
#: TrainingArguments counts that must be at least 1 (torch's DataLoader would fail deep inside on 0).
POSITIVE_TRAINING_ARGUMENTS = ("per_device_train_batch_size", "per_device_eval_batch_size",
                               "gradient_accumulation_steps")
#: Ids at or above this are refused when the vocabulary would be sized from the data (no tokenizer, no model):
#: the largest vocabulary of common tokenizers (Gemma 3's 262,144 ids); a stray larger id would only make the model
#: huge (400,000 ids: a 52M-parameter "tiny" Llama).
MAX_DATA_VOCAB = 262_144
#: Words of torch's optimizer errors -> the TrainingArguments field they are about.
OPTIMIZER_ARGUMENTS = {"learning rate": "learning_rate", "epsilon": "adam_epsilon", "index 0": "adam_beta1",
                       "index 1": "adam_beta2", "weight_decay": "weight_decay"}


@dataclass
class TrainScriptArguments:
    """What to train on what (``padfree-plugins train --help`` lists these with the TrainingArguments)."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "local model directory (config and weights). Default: a tiny Llama built from a config"})
    model_config: str | None = field(default=None, metadata={
        "help": "a config.json (or a directory holding one) to build a randomly initialised model from"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={
        "help": "local tokenizer directory (default: the model's; for a model built from a config, a byte-level "
                "BPE tokenizer trained on the dataset)"})
    dataset: str | None = field(default=None, metadata={
        "help": "a local .json / .jsonl / .parquet / .csv file, or a directory written by datasets' save_to_disk. "
                "Rows hold input_ids (and optional labels), or prompt + completion, or text. Default: the "
                "instruction dataset shipped with padfree-plugins"})
    dataset_split: str = field(default="train", metadata={
        "help": "split to read from a saved DatasetDict (a file or a saved Dataset has the train split only)"})
    eval_fraction: float = field(default=0.1, metadata={"help": "share of the dataset held out for evaluation"})
    max_examples: int | None = field(default=None, metadata={"help": "use only the first N examples"})
    completion_only_loss: bool = field(default=True, metadata={
        "help": "prompt + completion rows: train on the completion only (prompt labels are -100)"})
    truncate_to: int | None = field(default=None, metadata={
        "help": "truncate examples to this many tokens when tokenizing (default: keep them whole; an example "
                "longer than the model takes is then an error before training)"})
    vocab_size: int = field(default=512, metadata={"help": "vocabulary of the tokenizer trained for a model built "
                                                           "from a config"})


@dataclass
class TrainReport:
    """What a run did: the loss curve, evaluation before and after, throughput."""

    losses: list[tuple[int, float]]
    eval_before: float | None
    eval_after: float | None
    steps: int
    runtime_s: float
    tokens: int
    setup: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.runtime_s if self.runtime_s else 0.0


# -- inputs ------------------------------------------------------------------------------------------------------


def _has_flag(argv: Sequence[str], name: str) -> bool:
    """Whether ``argv`` gives the option ``name`` (``--model_config``), as ``--model_config x``,
    ``--model_config=x`` or with dashes (``--model-config x``), which ``HfArgumentParser`` accepts too."""
    spelling = name.replace("-", "_")
    return any(arg.startswith("--") and arg.split("=", 1)[0].replace("-", "_") == spelling for arg in argv)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default said once: none after a help that states its own, after ``None``, or after a ``--no_*`` flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text.lower() or isinstance(action, argparse._StoreFalseAction):
            return text
        return super()._get_help_string(action)


def argument_parser() -> Any:
    """The parser of ``padfree-plugins train``: :class:`TrainScriptArguments`, ``TrainingArguments`` and
    ``--acceleration_config``."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser(
        (TrainScriptArguments, TrainingArguments, AccelerationArguments), prog="padfree-plugins train",
        usage="%(prog)s [OPTIONS]", formatter_class=_HelpFormatter,
        description="Fine-tune a causal LM padding-free with HF Trainer: the flags of padfree-plugins train, every "
                    "TrainingArguments flag, and --acceleration_config padfree.yaml. The defaults shown are "
                    f"TrainingArguments', except these of the command: {' '.join(COMMON_FLAGS)}, --output_dir a "
                    "temporary directory (nothing saved); without --model_name_or_path, --model_config and "
                    f"--dataset (the embedded default), also {' '.join(EMBEDDED_FLAGS)}. Without --logging_steps, "
                    f"a run logs every step up to {LOGGED_STEPS} steps; a longer one every ceil(steps / "
                    f"{LOGGED_STEPS}) steps, at most 500 apart: {LOGGED_STEPS // 2} to {LOGGED_STEPS} times up to "
                    "25,000 steps (108 steps: every 3rd, 36 times).")
    for action in parser._actions:
        if isinstance(action, argparse._StoreFalseAction):  # HfArgumentParser gives --no_X the help of --X
            action.help = f"turn --{action.dest} off (the same as --{action.dest} false)"
    parser.add_argument("--help-all", action=_FullHelp, nargs=0, default=argparse.SUPPRESS,
                        help="show every TrainingArguments flag too, and exit")
    parser.format_help = lambda: short_help(parser)  # --help: the command's flags and the common ones
    return parser


class _FullHelp(argparse.Action):
    """``--help-all``: argparse's help of every flag, TrainingArguments' included."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(argparse.ArgumentParser.format_help(parser))
        parser.exit()


def short_help(parser: argparse.ArgumentParser) -> str:
    """``--help``: the command's own flags (:class:`TrainScriptArguments`, ``--acceleration_config``), then the
    :data:`COMMON_TRAINING_FLAGS`, then where every other TrainingArguments flag is documented."""
    own = {f.name for cls in (TrainScriptArguments, AccelerationArguments) for f in fields(cls)}
    own_actions = [a for a in parser._actions if a.dest in own or a.dest in ("help", "help_all")]
    common = sorted((a for a in parser._actions if a.dest in COMMON_TRAINING_FLAGS),
                    key=lambda a: COMMON_TRAINING_FLAGS.index(a.dest))
    others = {a.dest for a in parser._actions} - own - set(COMMON_TRAINING_FLAGS) - {"help", "help_all"}
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    for title, actions in (("options", own_actions), ("common transformers.TrainingArguments options", common)):
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
    formatter.add_text(f"Every other transformers.TrainingArguments flag is accepted too ({len(others)} more; "
                       "--help-all lists them), documented at:")
    return f"{formatter.format_help()}  {TRAINING_ARGUMENTS_DOCS}\n"  # one line: a link cut in two opens nothing


def parse_arguments(argv: Sequence[str]) -> tuple[TrainScriptArguments, Any, AccelerationArguments, bool]:
    """Parse the command line; the embedded default's flags come first, so that anything given overrides them."""
    parser = argument_parser()
    embedded = not any(_has_flag(argv, f) for f in ("--model_name_or_path", "--model_config", "--dataset"))
    prefix = list(COMMON_FLAGS)
    if embedded:
        prefix += EMBEDDED_FLAGS
    if not _has_flag(argv, "--dataloader_pin_memory") and not _has_flag(argv, "--no_dataloader_pin_memory"):
        import torch

        if not torch.cuda.is_available():
            prefix += ["--dataloader_pin_memory", "false"]  # pinning needs an accelerator (torch warns otherwise)
    if not _has_flag(argv, "--output_dir"):
        prefix += ["--output_dir", tempfile.mkdtemp(prefix="padfree-train-")]
        if not _has_flag(argv, "--save_strategy"):
            prefix += ["--save_strategy", "no"]  # a throwaway directory: nothing worth saving into it
    try:
        script, training, acceleration = parser.parse_args_into_dataclasses(args=[*prefix, *argv])
    except ConfigError:
        raise
    except ValueError as error:  # TrainingArguments' own checks (e.g. --bf16 on a machine without bf16 support)
        raise ConfigError(f"invalid training arguments: {error}") from error
    if not 0 <= script.eval_fraction < 1:
        raise ConfigError(f"--eval_fraction must be in [0, 1), got {script.eval_fraction}")
    if script.truncate_to is not None and script.truncate_to < 1:
        raise ConfigError(f"--truncate_to must be at least 1 (tokens kept per example), got {script.truncate_to}; "
                          "leave it out to keep examples whole")
    for name in POSITIVE_TRAINING_ARGUMENTS:
        if getattr(training, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(training, name)}")
    return script, training, acceleration, embedded


def _texts(rows: Any) -> list[str]:
    """The texts of prompt + completion or text rows, to train a tokenizer on."""
    if row_format(rows) == "prompt + completion":
        return [PROMPT_TEMPLATE.format(prompt=p) + c for p, c in zip(rows["prompt"], rows["completion"])]
    return list(rows["text"])


def tiny_llama_config(vocab_size: int, tokenizer: Any = None) -> Any:
    """The embedded default model: 4 layers, d=128, GQA 4 heads / 2 key-value heads, 512 positions."""
    from transformers import LlamaConfig

    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")}
    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, **special)


def _largest_token(rows: Any) -> tuple[int, int]:
    """The largest token id of the rows' ``input_ids`` and the first row that holds it (``(0, 0)`` for none)."""
    import pyarrow.compute as pc

    column = rows.with_format("arrow")[:]["input_ids"].combine_chunks()
    ids = pc.list_flatten(column)
    largest = pc.max(ids).as_py()
    if largest is None:
        return 0, 0
    return int(largest), int(pc.list_parent_indices(column)[pc.index(ids, largest).as_py()].as_py())


def data_vocabulary(rows: Any) -> int:
    """The vocabulary of a model built for pretokenized rows without a tokenizer: the largest id + 1, refused when
    no common tokenizer has that many ids (:data:`MAX_DATA_VOCAB`)."""
    largest, row = _largest_token(rows)
    if largest >= MAX_DATA_VOCAB:
        raise ConfigError(
            f"example {row} of the dataset holds token id {largest}: without a tokenizer or a model, the model's "
            f"vocabulary is sized from the largest id, {largest + 1:,} tokens here, more than any common tokenizer's "
            f"({MAX_DATA_VOCAB:,}). Check the data for a stray id, or give --tokenizer_name_or_path (its "
            "vocabulary then bounds the ids) or --model_config (a config with its vocab_size)")
    return largest + 1


def check_token_ids(data: Any, vocab_size: int, vocabulary: str = "the model's vocabulary", hint: str = "") -> None:
    """Every token id in ``[0, vocab_size)`` (labels: or -100); one outside fails only mid-training (IndexError).
    ``vocabulary`` names whose ids these are, ``hint`` ends the message."""
    import pyarrow.compute as pc

    keys = [key for key in ("input_ids", "labels") if key in data.column_names]
    offset = 0
    for table in data.select_columns(keys).with_format("arrow").iter(batch_size=50_000):
        for key in keys:
            column = table.column(key).combine_chunks()
            ids = pc.list_flatten(column)
            bad = pc.or_(pc.less(ids, 0), pc.greater_equal(ids, vocab_size))
            if key == "labels":
                bad = pc.and_(bad, pc.not_equal(ids, -100))
            first = pc.index(bad, True).as_py()
            if first >= 0:
                row = offset + pc.list_parent_indices(column)[first].as_py()
                raise ConfigError(f"example {row} of the dataset: {key} holds {ids[first].as_py()}, outside "
                                  f"{vocabulary} [0, {vocab_size}){' (or -100)' if key == 'labels' else ''}{hint}")
        offset += table.num_rows


def _model_config(script: TrainScriptArguments) -> Any:
    if script.model_name_or_path:
        return load_model_config(local_directory(script.model_name_or_path, "--model_name_or_path"),
                                 "--model_name_or_path")
    return load_model_config(script.model_config)


def _build_trainer(training: Any, **kwargs: Any) -> Any:
    """The ``Trainer`` and its optimizer, built now: an argument they refuse (``--learning_rate -1``) is then a
    :class:`ConfigError` naming it, before any step. Where ``train()`` builds the optimizer only after wrapping the
    model (FSDP, DeepSpeed), it is left to ``train()``."""
    from transformers import Trainer

    try:
        trainer = Trainer(args=training, **kwargs)
        if not (trainer.is_fsdp_enabled or trainer.is_fsdp_xla_enabled or trainer.is_deepspeed_enabled):
            trainer.create_optimizer()  # train() uses this one
    except (ValueError, TypeError, RuntimeError, ImportError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        name = next((name for words, name in OPTIMIZER_ARGUMENTS.items() if words in message.lower()), None)
        given = f"--{name} {getattr(training, name)}: " if name else ""
        raise ConfigError(f"invalid training arguments: {given}{message}") from error
    return trainer


# -- the run -----------------------------------------------------------------------------------------------------


def _loss_curve_callback(print_fn: Callable[[str], None] | None, log_often: bool = False) -> Any:
    from transformers import TrainerCallback

    class LossCurve(TrainerCallback):
        """Collects the training loss at every logging step (and prints one line per log). With ``log_often``, a
        run logs every step up to :data:`LOGGED_STEPS` steps; a longer one every ``ceil(max_steps / LOGGED_STEPS)``
        steps (at most ``logging_steps`` apart), so ``LOGGED_STEPS // 2`` to ``LOGGED_STEPS`` times."""

        def __init__(self) -> None:
            self.losses: list[tuple[int, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            if log_often:
                state.logging_steps = min(state.logging_steps, max(1, math.ceil(state.max_steps / LOGGED_STEPS)))

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                self.losses.append((state.global_step, float(logs["loss"])))
                if print_fn:
                    print_fn(f"step {state.global_step:>4}  loss {logs['loss']:.4f}  "
                             f"lr {logs.get('learning_rate', 0):.2e}")

    return LossCurve()


def run_train(argv: Sequence[str] = (), print_fn: Callable[[str], None] | None = print) -> TrainReport:
    """Parse ``argv``, check everything, train, evaluate; see the module docstring."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from padfree_plugins.assembly import plan
    from padfree_plugins.integrations.accelerate import accelerate

    script, training, acceleration_args, embedded = parse_arguments(argv)
    config = acceleration_args.config or PadfreeConfig()
    if config.task != "causal_lm":
        raise ConfigError(
            f"--acceleration_config {acceleration_args.acceleration_config} sets task: {config.task}, but "
            "padfree-plugins train fine-tunes causal LMs only (task: causal_lm). For other tasks build the trainer "
            "in Python (HF Trainer, or sentence-transformers' trainers for embeddings) and call "
            f"padfree_plugins.accelerate(trainer, {acceleration_args.acceleration_config!r}): see docs/tasks.md")
    say = print_fn or (lambda _: None)
    if script.model_name_or_path and script.model_config:
        raise ConfigError("give either --model_name_or_path or --model_config, not both")

    given_config = _model_config(script) if script.model_name_or_path or script.model_config else None
    # resolve what will be patched before reading any data (the embedded model is planned once its vocab is known)
    planned = plan(given_config, config, device_type=training.device.type) if given_config is not None else None
    rows = quietly(load_rows, script.dataset, script.dataset_split)
    if script.max_examples is not None:
        rows = rows.select(range(min(script.max_examples, len(rows))))
    if len(rows) == 0:
        raise ConfigError("the dataset has no rows" + (f" (--max_examples {script.max_examples})"
                                                      if script.max_examples is not None else ""))
    pretokenized = row_format(rows) == "input_ids"
    if script.tokenizer_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(local_directory(script.tokenizer_name_or_path,
                                                                  "--tokenizer_name_or_path"))
    elif script.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    elif not pretokenized:
        tokenizer = train_tokenizer(_texts(rows), script.vocab_size)
    else:
        tokenizer = None  # already tokenized: nothing to encode
    if tokenizer is not None and pretokenized:  # ids of another tokenizer would train on the wrong tokens
        check_token_ids(rows, len(tokenizer), "the tokenizer's vocabulary",
                        "; were these rows tokenized with another tokenizer?")
    if tokenizer is not None:
        vocab = len(tokenizer)
    elif given_config is None:
        vocab = data_vocabulary(rows)
    else:
        vocab = _largest_token(rows)[0] + 1  # checked against the config's vocab_size below
    if given_config is not None:
        model_config = given_config
        if not script.model_name_or_path and vocab > model_config.get_text_config().vocab_size:
            raise ConfigError(f"the data uses {vocab} token ids but the model config's vocab_size is "
                              f"{model_config.get_text_config().vocab_size}; raise vocab_size in the config")
    else:
        model_config = tiny_llama_config(vocab, tokenizer)
    setup = (planned or plan(model_config, config, device_type=training.device.type)).describe()

    data = quietly(tokenize, rows, tokenizer, script.completion_only_loss, script.truncate_to)
    check_token_ids(data, model_config.get_text_config().vocab_size)
    evaluation = None
    if script.eval_fraction > 0 and len(data) >= 10:
        split = data.train_test_split(test_size=script.eval_fraction, seed=training.seed)
        data, evaluation = split["train"], split["test"]

    torch.manual_seed(training.seed)
    if script.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")
    curve = _loss_curve_callback(print_fn if training.disable_tqdm else None,
                                 log_often=not _has_flag(argv, "--logging_steps"))
    trainer = _build_trainer(training, model=model, train_dataset=data, eval_dataset=evaluation,
                             processing_class=tokenizer, callbacks=[curve])
    if training.disable_tqdm:
        trainer.remove_callback(PrinterCallback)  # the loss curve prints its own lines
    acceleration = accelerate(trainer, config)  # checks every example against the model before training
    described = acceleration.describe()
    setup = {"model": f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
                      f"parameters{', embedded default' if embedded else ''})",
             **({"vocabulary": f"{vocab} token ids, sized from the largest id in the dataset (no tokenizer)"}
                if tokenizer is None and given_config is None else {}),
             "examples": f"{len(data)} train, {len(evaluation) if evaluation is not None else 0} eval",
             "acceleration config": acceleration_args.acceleration_config or "defaults (no --acceleration_config)",
             "architecture": setup["architecture"], "attention backend": setup["attention backend"],
             "collator": described["collator"], "device": str(training.device)}
    for key, value in setup.items():
        say(f"{key}: {value}")
    eval_before = trainer.evaluate()["eval_loss"] if evaluation is not None else None
    result = trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    if _has_flag(argv, "--output_dir"):
        trainer.save_model()  # the trained model and its tokenizer, for plain transformers
    eval_after = trainer.evaluate()["eval_loss"] if evaluation is not None else None
    for value in (eval_before, eval_after, *(loss for _, loss in curve.losses)):
        if value is not None and not math.isfinite(value):
            raise PadfreeError(f"the loss is not finite ({value}); lower --learning_rate or check the data")
    runtime = float(result.metrics.get("train_runtime", 0.0))
    return TrainReport(curve.losses, eval_before, eval_after, trainer.state.global_step, runtime,
                       int(trainer.state.num_input_tokens_seen), setup)
