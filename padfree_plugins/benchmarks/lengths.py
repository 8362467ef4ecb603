"""Example lengths from a user's dataset, for the benchmarks' ``--dataset`` option ("how much on my data?").

The benchmarks only need lengths: token values are drawn at random, so a dataset contributes its length law and
nothing else. Rows may be pre-tokenized (``input_ids``, or ``<column>_input_ids`` as the embedding task takes
them) or text, tokenized with a local tokenizer (a seeded random sample of at most :data:`MAX_TOKENIZED_ROWS`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from padfree_plugins.errors import PadfreeError

#: Text rows tokenized to estimate a dataset's length law (a seeded random sample of a larger dataset).
MAX_TOKENIZED_ROWS = 20_000


def dataset_lengths(path: str, *, split: str = "train", tokenizer: str | None = None, seed: int = 0,
                    texts: Literal["sft", "each"] = "sft") -> list[int]:
    """Token counts of the non-empty examples of a local dataset (file or ``save_to_disk`` directory).

    Token columns (``input_ids``, ``*_input_ids``) are counted as they are. Otherwise rows are text, tokenized
    with ``tokenizer``: ``texts="sft"`` as ``padfree-plugins train`` builds SFT examples (prompt + completion, or
    text, each one example); ``texts="each"`` counts every string column's texts as separate examples with the
    tokenizer's special tokens (query / positive / negative columns of an embedding dataset).
    """
    import pyarrow.compute as pc

    from padfree_plugins.recipes.train import load_rows, quietly, tokenize

    rows = quietly(load_rows, path, split)
    columns = [c for c in rows.column_names if c == "input_ids" or c.endswith("_input_ids")]
    if not columns:
        if tokenizer is None:
            raise PadfreeError(f"{path}: rows have no input_ids (columns: {', '.join(rows.column_names)}); give "
                               "--tokenizer DIR to tokenize their text, or pre-tokenize the dataset")
        if len(rows) > MAX_TOKENIZED_ROWS:
            rows = rows.shuffle(seed=seed).select(range(MAX_TOKENIZED_ROWS))
        rows, columns = _tokenized(rows, tokenizer, texts, quietly, tokenize)
    table = rows.with_format("arrow")[:]
    lengths = [n for c in columns for n in pc.list_value_length(table[c]).to_pylist() if n]
    if not lengths:
        raise PadfreeError(f"{path}: no non-empty example to draw lengths from")
    return lengths


def _tokenized(rows: Any, tokenizer: str, texts: str, quietly: Any, tokenize: Any) -> tuple[Any, list[str]]:
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as error:
        raise PadfreeError(f"cannot load the tokenizer {tokenizer!r} (a local directory with its files): "
                           f"{str(error).splitlines()[0]}") from error
    if texts == "sft":
        return quietly(tokenize, rows, loaded), ["input_ids"]
    strings = [c for c, kind in rows.features.items() if getattr(kind, "dtype", None) in ("string", "large_string")]
    if not strings:
        raise PadfreeError(f"no text column to tokenize among {', '.join(rows.column_names)}")

    def encode(batch: dict) -> dict:  # a missing text (None) is no example: an empty list, dropped below
        return {f"{c}_input_ids": [[] if t is None else ids for t, ids in
                                   zip(batch[c], loaded([t or "" for t in batch[c]])["input_ids"])]
                for c in strings}

    return quietly(lambda: rows.map(encode, batched=True, remove_columns=rows.column_names)), \
        [f"{c}_input_ids" for c in strings]


def sample_lengths(lengths: list[int] | tuple[int, ...], n: int, seed: int, low: int, high: int) -> list[int]:
    """``n`` lengths drawn at random from a dataset's (as a shuffled loader would), clipped to ``[low, high]``."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(lengths), (n,), generator=generator).tolist()
    return [min(max(lengths[i], low), high) for i in picks]
