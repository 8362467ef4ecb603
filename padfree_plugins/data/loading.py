"""Reading and tokenizing training rows: what ``padfree-plugins train`` and the benchmarks' ``--dataset`` share.

A low layer: it imports nothing of padfree_plugins but :mod:`padfree_plugins.errors` (``datasets`` and the
tokenizer are the caller's, imported when used).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from padfree_plugins.errors import ConfigError

#: The instruction / response pairs shipped with the package (``padfree_plugins/data``).
DEFAULT_DATASET = "instructions.jsonl"
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n### Response:\n"
#: The rows train reads, by the columns that make each (the first one present wins).
ROW_FORMATS = {"input_ids": ("input_ids",), "prompt + completion": ("prompt", "completion"), "text": ("text",)}


def load_rows(path: str | None, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from a local file or a ``save_to_disk`` directory (the shipped dataset if ``None``)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    source = Path(path) if path is not None else None
    loaded = datasets.load_from_disk(str(source)) if source is not None and source.is_dir() else None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{path}: no split {split!r}; splits: {', '.join(loaded)} (use --dataset_split)")
        return loaded[split]
    if split != "train":
        raise ConfigError(f"--dataset_split {split!r}: {f'dataset {path!r}' if path else 'the shipped dataset'} has "
                          "a single (train) split; --dataset_split selects a split of a saved DatasetDict")
    if loaded is not None:
        return loaded
    if source is None:
        text = files("padfree_plugins.data").joinpath(DEFAULT_DATASET).read_text()
        return datasets.Dataset.from_list([json.loads(line) for line in text.splitlines() if line.strip()])
    if not source.is_file():
        raise ConfigError(f"dataset {path!r} does not exist (give a local file or a save_to_disk directory)")
    kinds = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
    kind = kinds.get(source.suffix.lower())
    if kind is None:
        raise ConfigError(f"dataset {path!r}: unknown format {source.suffix!r}; use one of {', '.join(kinds)} or a "
                          "save_to_disk directory")
    try:
        return datasets.load_dataset(kind, data_files=str(source), split="train")
    except (DatasetGenerationError, ValueError, StopIteration) as error:  # StopIteration: an empty .jsonl
        cause = str(error.__cause__ or error).splitlines()
        raise ConfigError(f"dataset {path!r} cannot be read as {kind}: {cause[0] if cause else 'it has no rows'}"
                          ) from error


def row_format(rows: Any) -> str:
    """Which of :data:`ROW_FORMATS` ``rows`` hold, after checking the types of its columns (token ids: lists of
    integers; prompt, completion, text: strings), so that bad data fails before any model or tokenizer loads."""
    import pyarrow as pa

    columns = rows.column_names
    kind = next((kind for kind, needed in ROW_FORMATS.items() if set(needed) <= set(columns)), None)
    if kind is None:
        raise ConfigError(f"the dataset has columns {', '.join(columns)}; give input_ids (and labels), or prompt + "
                          "completion, or text")
    schema = rows.features.arrow_schema
    for name in (*ROW_FORMATS[kind], *(["labels"] if kind == "input_ids" and "labels" in columns else [])):
        kind_of = schema.field(name).type
        if name in ("input_ids", "labels"):
            good = (pa.types.is_list(kind_of) or pa.types.is_large_list(kind_of)) and pa.types.is_integer(
                kind_of.value_type)
            wanted = "lists of integer token ids"
        else:
            good, wanted = pa.types.is_string(kind_of) or pa.types.is_large_string(kind_of), "text (strings)"
        if not good:
            raise ConfigError(f"the dataset's {name!r} column holds {kind_of} values; it must hold {wanted}")
    return kind


def tokenize(rows: Any, tokenizer: Any, completion_only_loss: bool = True, truncate_to: int | None = None) -> Any:
    """``input_ids`` + ``labels`` from pre-tokenized, prompt + completion, or text rows (no padding anywhere)."""
    columns = rows.column_names
    kind = row_format(rows)
    eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []

    def cut(example: dict) -> dict:
        if truncate_to is not None:
            example = {k: v[:truncate_to] for k, v in example.items()}
        return example

    if kind == "input_ids":
        keep = [c for c in columns if c in ("input_ids", "labels")]
        return rows.select_columns(keep).map(cut) if truncate_to else rows.select_columns(keep)
    if kind == "prompt + completion":
        def encode(row: dict) -> dict:
            prompt = tokenizer(PROMPT_TEMPLATE.format(prompt=row["prompt"]), add_special_tokens=False)["input_ids"]
            answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + eos
            labels = ([-100] * len(prompt) if completion_only_loss else prompt) + answer
            return cut({"input_ids": prompt + answer, "labels": labels})
    else:
        def encode(row: dict) -> dict:
            ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"] + eos
            return cut({"input_ids": ids, "labels": list(ids)})
    return rows.map(encode, remove_columns=columns)


def quietly(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function`` without datasets' progress bars (a few hundred rows map in milliseconds)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return function(*args)
    finally:
        if shown:
            datasets.enable_progress_bars()
