"""Every length law of the benchmarks and the demo, in one place: what example lengths a workload draws.

Token values are drawn at random everywhere (speed does not depend on them), so a workload is its length law:

* :func:`lognormal_lengths` — one clipped lognormal (SFT sets such as OrcaMath or Alpaca: median 120, sigma
  0.6), drawn in float32: ``bench collator``, ``bench embedding``, ``bench batching``'s ``lognormal`` and the demo;
* :func:`mixture_lengths` — a clipped mixture of lognormals, drawn in float64; :data:`SFT_LAWS` names
  ``bench sft``'s (``lognormal``, and ``mix`` = :data:`SHORT_TEXTS_AND_600_TOKEN_ANSWERS`), :func:`draw_lengths`
  draws one by name;
* :func:`short_texts_and_long_documents` — ``bench batching``'s ``mix`` (longer documents than bench sft's
  ``mix``, to be hard to balance across ranks); :func:`batching_law_lengths` draws a law of
  :data:`BATCHING_LAWS` by name;
* :func:`dataset_lengths` / :func:`sample_lengths` — the length law of a user's dataset (the benchmarks'
  ``--dataset`` option, "how much on my data?"), the law :data:`DATASET_LAW` of bench sft.

Two laws share each name across benchmarks and stay distinct on purpose: bench sft's ``lognormal`` has bench
batching's parameters but another sampler (a one-component mixture, float64), and the two ``mix`` laws differ in
their long share (answers of median 600, clipped by ``--max-length``, vs documents of median 1000, clipped to
4096); unifying either would change the published figures.

Dataset rows may be pre-tokenized (``input_ids``, or ``<column>_input_ids`` as the embedding task takes them) or
text, tokenized with a local tokenizer (a seeded random sample of at most :data:`MAX_TOKENIZED_ROWS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from padfree_plugins.data.loading import load_rows, quietly, tokenize
from padfree_plugins.errors import PadfreeError

#: Text rows tokenized to estimate a dataset's length law (a seeded random sample of a larger dataset).
MAX_TOKENIZED_ROWS = 20_000

# -- lognormal laws ------------------------------------------------------------------------------------------------


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int, seed: int) -> list[int]:
    """Example lengths drawn from a clipped lognormal law (like SFT datasets such as OrcaMath or Alpaca)."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(n, generator=generator) * sigma + math.log(median))
    return draws.round().clamp(low, high).long().tolist()


#: A mixture of lognormals: its components as (weight, median, sigma).
Mixture = tuple[tuple[float, float, float], ...]


def mixture_lengths(components: Mixture, n: int, seed: int, low: int, high: int) -> list[int]:
    """``n`` example lengths from a mixture of lognormals, clipped to ``[low, high]``."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([w for w, _, _ in components])
    component = torch.multinomial(weights, n, replacement=True, generator=generator)
    medians = torch.tensor([m for _, m, _ in components], dtype=torch.float64)[component]
    sigmas = torch.tensor([s for _, _, s in components], dtype=torch.float64)[component]
    draws = torch.exp(torch.randn(n, generator=generator, dtype=torch.float64) * sigmas + medians.log())
    return draws.round().clamp(low, high).long().tolist()


# -- bench sft's laws ----------------------------------------------------------------------------------------------

#: 80% short texts (median 40) and 20% answers of median 600: mostly short, a few long, the worst case for padding.
#: bench sft's ``mix``; bench batching's ``mix`` has longer documents (:func:`short_texts_and_long_documents`).
SHORT_TEXTS_AND_600_TOKEN_ANSWERS: Mixture = ((0.8, 40, 0.5), (0.2, 600, 0.3))
#: bench sft's length laws by name: lognormal mixtures (:func:`mixture_lengths`).
SFT_LAWS: dict[str, Mixture] = {
    "lognormal": ((1.0, 120, 0.6),),  # OrcaMath / Alpaca-like
    "mix": SHORT_TEXTS_AND_600_TOKEN_ANSWERS,
}
#: The law of bench sft whose lengths are drawn from a dataset (``BenchSettings.dataset``).
DATASET_LAW = "dataset"


def draw_lengths(law: str, n: int, seed: int, low: int, high: int) -> list[int]:
    """``n`` example lengths from a law of :data:`SFT_LAWS` (a mixture of lognormals), clipped to ``[low, high]``."""
    if law not in SFT_LAWS:
        raise PadfreeError(f"unknown length law {law!r}; choose from {', '.join(SFT_LAWS)}, or {DATASET_LAW} with a "
                           "--dataset")
    return mixture_lengths(SFT_LAWS[law], n, seed, low, high)


# -- bench batching's laws -----------------------------------------------------------------------------------------


def short_texts_and_long_documents(n: int, seed: int = 0) -> list[int]:
    """bench batching's ``mix``: 80% short texts (lognormal median 40, sigma 0.5) and 20% long documents
    (median 1000, sigma 0.3), clipped to 8..4096 — hard to balance across ranks by example count. Not the ``mix``
    of bench sft (:data:`SHORT_TEXTS_AND_600_TOKEN_ANSWERS`)."""
    short = lognormal_lengths(n, 40, 0.5, 8, 4096, seed)
    long = lognormal_lengths(n, 1000, 0.3, 8, 4096, seed + 1)
    is_long = np.random.default_rng(seed + 2).random(n) < 0.2
    return np.where(is_long, long, short).tolist()


def preference_pairs(n: int, seed: int = 0) -> list[int]:
    """bench batching's ``dpo-pairs``: the tokens of DPO pairs as a packed row holds them (the prompt once, then the
    chosen and the rejected completion): prompts lognormal median 300, sigma 1.0 (8..3000: a question to a RAG
    context), completions median 200, sigma 0.8 (8..1500) each; a pair is clipped to 4096 tokens (the default budget:
    no pair is longer)."""
    prompt = np.asarray(lognormal_lengths(n, 300, 1.0, 8, 3000, seed))
    chosen = np.asarray(lognormal_lengths(n, 200, 0.8, 8, 1500, seed + 1))
    rejected = np.asarray(lognormal_lengths(n, 200, 0.8, 8, 1500, seed + 2))
    return np.minimum(prompt + chosen + rejected, 4096).tolist()


#: bench batching's length laws by name: ``n, seed -> lengths`` (for ``dpo-pairs``, an example is a pair).
BATCHING_LAWS: dict[str, Callable[[int, int], list[int]]] = {
    "lognormal": lambda n, seed: lognormal_lengths(n, 120, 0.6, 8, 2048, seed),  # as bench sft's, float32 draws
    "mix": short_texts_and_long_documents,
    "dpo-pairs": preference_pairs,
}


def batching_law_lengths(law: str, n: int, seed: int = 0) -> list[int]:
    """``n`` example lengths drawn from a law of :data:`BATCHING_LAWS`."""
    if law not in BATCHING_LAWS:
        raise ValueError(f"unknown length law {law!r}; choose from {', '.join(BATCHING_LAWS)}")
    return BATCHING_LAWS[law](n, seed)


# -- a dataset's law -----------------------------------------------------------------------------------------------


def dataset_lengths(path: str, *, split: str = "train", tokenizer: str | None = None, seed: int = 0,
                    texts: Literal["sft", "each"] = "sft") -> list[int]:
    """Token counts of the non-empty examples of a local dataset (file or ``save_to_disk`` directory).

    Token columns (``input_ids``, ``*_input_ids``) are counted as they are. Otherwise rows are text, tokenized
    with ``tokenizer``: ``texts="sft"`` as ``padfree-plugins train`` builds SFT examples (prompt + completion, or
    text, each one example); ``texts="each"`` counts every string column's texts as separate examples with the
    tokenizer's special tokens (query / positive / negative columns of an embedding dataset).
    """
    import pyarrow.compute as pc

    rows = quietly(load_rows, path, split)
    columns = [c for c in rows.column_names if c == "input_ids" or c.endswith("_input_ids")]
    if not columns:
        if tokenizer is None:
            raise PadfreeError(f"{path}: rows have no input_ids (columns: {', '.join(rows.column_names)}); give "
                               "--tokenizer DIR to tokenize their text, or pre-tokenize the dataset")
        if len(rows) > MAX_TOKENIZED_ROWS:
            rows = rows.shuffle(seed=seed).select(range(MAX_TOKENIZED_ROWS))
        rows, columns = _tokenized(rows, tokenizer, texts)
    table = rows.with_format("arrow")[:]
    lengths = [n for c in columns for n in pc.list_value_length(table[c]).to_pylist() if n]
    if not lengths:
        raise PadfreeError(f"{path}: no non-empty example to draw lengths from")
    return lengths


def _tokenized(rows: Any, tokenizer: str, texts: str) -> tuple[Any, list[str]]:
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
