"""The packing collator: a list of tokenized examples -> one :class:`~padfree_plugins.packing.batch.PackedBatch`.

Vectorised: the only Python loop runs once per example (to read lengths and check keys); tokens, positions and
boundaries are built with numpy / torch ops. Instances are plain picklable objects (DataLoader workers).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import numpy as np
import torch

from padfree_plugins.errors import BatchError, ConfigError
from padfree_plugins.packing.batch import INDEX_KEY, MEDIA_KEYS, MODEL_INPUT_KEYS, PackedBatch

#: Per-token keys carried whenever every example has them.
DEFAULT_TOKEN_KEYS = ("token_type_ids",)
#: Model-forward parameters an example may carry that are never refused as undeclared (:func:`refusing_undeclared`):
#: what the collator builds or checks itself, the labels the tasks read, and call options rather than data.
HANDLED_KEYS = (*MODEL_INPUT_KEYS, "attention_mask", "seq_idx", *DEFAULT_TOKEN_KEYS, "labels", "label",
                "return_dict", "output_attentions", "output_hidden_states", "use_cache", "past_key_values",
                "cache_position", "logits_to_keep", "head_mask")


#: Per-token inputs the collator builds itself: an example may carry them only as the collator would build them
#: (key -> where its values start: ``None`` for the architecture's first position), never to be replaced silently.
BUILT_POSITION_KEYS = {"position_ids": None, "cache_position": 0}

#: How a collator's error names an example (or a row) by its position in the list the collator was given.
POSITION_NAME = re.compile(r"\b(example|row) (\d+)\b(?! of )")


def dataset_indices(examples: Sequence[Any]) -> list[int] | None:
    """The dataset index every example carries (:data:`~padfree_plugins.packing.batch.INDEX_KEY`, set by a trainer's
    dataloader), or ``None`` when some example carries none."""
    indices = [ex.get(INDEX_KEY) if isinstance(ex, Mapping) else None for ex in examples]
    return None if any(index is None for index in indices) else [int(index) for index in indices]


def by_dataset_index(message: str, indices: Sequence[int] | None) -> str:
    """``message`` with every example (or row) it names by position in the batch named by its dataset index
    (``example 57 of the dataset``); without ``indices``, the positions kept and said to be positions
    (``… (example 3: its position in this batch)``)."""
    if indices is None:
        named = list(dict.fromkeys(match.group(0) for match in POSITION_NAME.finditer(message)))
        if not named:
            return message
        what = "its position" if len(named) == 1 else "positions"
        return f"{message} ({', '.join(named)}: {what} in this batch)"

    def name(match: re.Match) -> str:
        word, position = match.group(1), int(match.group(2))
        if position >= len(indices):  # not one of the rows given (a text of a row): a position, said so
            return f"{word} {position} of this batch"
        return f"{word} {indices[position]} of the dataset"

    return POSITION_NAME.sub(name, message)


def collate_naming_examples(collate: Callable[[Sequence[Any]], Any], examples: Sequence[Any]) -> Any:
    """``collate(examples)``; a :class:`BatchError` it raises names its examples by dataset index, or as positions in
    this batch (:func:`by_dataset_index`). An error already named so by a collator inside passes unchanged."""
    try:
        return collate(examples)
    except BatchError as error:
        if getattr(error, "names_examples", False):
            raise
        named = BatchError(by_dataset_index(str(error), dataset_indices(examples)))
        named.names_examples = True
        raise named.with_traceback(error.__traceback__) from None


def outside_vocabulary_message(example: str, token: int, vocab_size: int | None) -> str:
    """The error for a token id the model's input embeddings do not have (``example`` names the example)."""
    limit = f"ids 0 to {vocab_size - 1}" if vocab_size is not None else "ids from 0"
    return (f"{example} has token id {token}, outside the model's vocabulary ({limit}): was it tokenized with "
            "another tokenizer, or were tokens added without resizing the embeddings (resize_token_embeddings)?")


def label_outside_vocabulary_message(example: str, label: int, vocab_size: int | None,
                                     ignore_index: int = -100) -> str:
    """The error for a per-token label the model's LM head has no logit for (``example`` names the example)."""
    limit = f"ids 0 to {vocab_size - 1}" if vocab_size is not None else "ids from 0"
    return (f"{example} has label {label} ('labels'), outside the model's vocabulary ({limit}; {ignore_index} marks "
            "a token without a label): were the labels made with another tokenizer, or masked with another value "
            f"than {ignore_index}?")


def positions_message(example: str, key: str, start: int, token: int, value: int) -> str:
    """The error for an example whose ``position_ids`` / ``cache_position`` are not ``start, start+1, …``."""
    return (f"{example} carries {key!r} that differ from the positions the collator builds (token {token} has "
            f"{value}, not {start + token}): a packed example's {key} are always {start}, {start + 1}, … (one per "
            f"token, restarting at every example), and custom ones are not honoured. Remove the {key!r} column, or "
            "train these examples padded")


def unlabelled_message(rows: Sequence[int], count: int, max_length: int, where: str = "",
                       dropped: bool = False) -> str:
    """The warning for examples (``rows``, the first of ``count``) whose every label truncation to ``max_length``
    erases; ``dropped``: the dataset check drops them."""
    named = ", ".join(str(int(row)) for row in rows[:8])
    more = f" ({count} in all)" if count > len(rows[:8]) else ""
    subject = f"example {named}{where} keeps" if count == 1 else f"examples {named}{where}{more} keep"
    action = ("dropped from training, as TRL drops such examples" if dropped else
              "trained on nothing (no loss, no gradient)")
    return (f"{subject} no label once truncated to max_length={max_length} (on_overlong: truncate; the prompt "
            f"fills it): {'it is' if count == 1 else 'they are'} {action}. Raise max_length, or shorten the prompts, "
            "to train on them")


def padded_message(example: str) -> str:
    """The error for an example whose ``attention_mask`` has zeros (``example`` names the example)."""
    return (f"{example} is padded (its attention_mask has zeros): pass unpadded examples; the collator packs them "
            "without any padding")


def _is_nested(value: Any) -> bool:
    """Whether ``value`` is a Python list / tuple of sequences (``[[1, 2, 3]]``, ``[[1, 2], [3]]``) rather than one
    flat sequence: a list of lists holds several texts (:func:`holds_several_texts`), never one example's tokens."""
    if not isinstance(value, (list, tuple)) or not len(value):
        return False
    first = value[0]
    return isinstance(first, (list, tuple)) or isinstance(first, (np.ndarray, torch.Tensor)) and first.ndim >= 1


def _nested_message(key: str, index: int) -> str:
    """The error for a list holding one list (``[[1, 2, 3]]``) where one flat list is expected."""
    if key == "input_ids":
        return (f"example {index}: 'input_ids' is a list holding one token list ([[...]]), where one flat list of "
                "token ids is expected: unwrap it (input_ids[0]); a list of token lists is a listwise reranker row, "
                "which task reranker with objective: listwise expands into its candidates")
    return (f"example {index}: {key!r} is a list holding one list ([[...]]), where one flat list with one value per "
            f"token of input_ids is expected: unwrap it ({key}[0]), as it came from a batch")


def _as_int_array(value: Any, key: str, index: int) -> np.ndarray:
    """A 1-D int64 array from a flat list, tuple, numpy array or tensor (a ``[1, L]`` array or tensor, as
    ``tokenizer(text, return_tensors="pt")`` gives, is one example); a :class:`BatchError` otherwise — also for a list
    of lists, which holds several sequences (:func:`holds_several_texts`), even when it holds just one."""
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().numpy()
    else:
        try:
            array = np.asarray(value)
        except Exception as exc:  # noqa: BLE001 - ragged nested lists and the like
            raise BatchError(f"example {index}: {key!r} is not a flat sequence of integers ({exc})") from None
    if array.ndim == 2 and array.shape[0] == 1:
        if _is_nested(value):
            raise BatchError(_nested_message(key, index))
        array = array[0]
    if array.ndim != 1:
        raise BatchError(
            f"example {index}: {key!r} must be 1-D (one example, unpadded); got shape {tuple(array.shape)}. "
            "Pass examples one by one, not an already-batched tensor."
        )
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise BatchError(f"example {index}: {key!r} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def as_examples(examples: Any) -> Any:
    """``examples`` as a sequence of rows: any other iterable (a generator, a ``datasets.Dataset``) becomes a list;
    a single row (a dict) is a :class:`BatchError`."""
    if isinstance(examples, Mapping):
        raise BatchError(
            "the collator takes a list of examples (one dict per example), got a single dict; "
            "wrap it in a list or use the dataset's rows"
        )
    if isinstance(examples, Sequence) and not isinstance(examples, (str, bytes)):
        return examples
    return list(examples)


def holds_several_texts(input_ids: Any) -> bool:
    """Whether one row's ``input_ids`` holds several texts — a listwise reranker row, one token list per candidate
    of its query — rather than one example's tokens. The task collators expand such a row into its candidates and
    the token-budget sampler counts (and refuses to split) it through this one test:

    * a list or tuple holds several texts when its first element is a token sequence itself (a list, a tuple, or a
      numpy array / tensor with at least one dimension); a flat list of ints (or of 0-d tensors) is one text;
    * a numpy **object** array (``datasets``' numpy format of ragged candidates) is a container of Python objects
      and is judged like a list, by its first element: an object array of lists or arrays holds several texts;
    * any other numpy array or tensor holds several texts when it is 2-D with at least two rows (``[k, L]``: ``k``
      candidates of equal length). A ``[1, L]`` one is **one text** — what ``tokenizer(text, return_tensors="pt")``
      gives for one example, and what :class:`PackingCollator` reads as one example; a 1-D one is one text;
    * an empty row, ``None`` and anything else hold one text (or none).
    """
    if isinstance(input_ids, torch.Tensor) or isinstance(input_ids, np.ndarray) and input_ids.dtype != object:
        return input_ids.ndim == 2 and input_ids.shape[0] > 1
    if isinstance(input_ids, np.ndarray) and input_ids.ndim == 0:  # an object scalar
        return False
    if not isinstance(input_ids, (list, tuple, np.ndarray)) or len(input_ids) == 0:
        return False
    first = input_ids[0]
    return isinstance(first, (list, tuple)) or isinstance(first, (np.ndarray, torch.Tensor)) and first.ndim >= 1


def stack_example_values(values: Sequence[Any], what: str, float_values: bool = False) -> torch.Tensor:
    """One number (or fixed-length list of numbers) per example as one tensor: int64 for integers and booleans,
    float32 otherwise or with ``float_values``; a :class:`BatchError` naming ``what`` for anything else."""
    values = [v.tolist() if isinstance(v, (torch.Tensor, np.ndarray)) else v for v in values]
    try:
        array = np.asarray(values)
    except ValueError:  # ragged lists
        array = np.asarray(values, dtype=object)
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise BatchError(f"{what} must be a number or a fixed-length list of numbers in every example; got "
                         f"{', '.join(sorted({type(v).__name__ for v in values}))}")
    if float_values or not (np.issubdtype(array.dtype, np.integer) or array.dtype == bool):
        return torch.from_numpy(array.astype(np.float32))
    return torch.from_numpy(array.astype(np.int64))


def _token_rows(value: Any, key: str, index: int, length: int) -> np.ndarray:
    """One example's per-token model input as an array ``[L, ...]`` (trailing dimensions allowed, e.g. a box of 4
    per token; a ``[1, L, ...]`` array or tensor is one example); a :class:`BatchError` otherwise."""
    try:
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - ragged nested lists and the like
        raise BatchError(f"example {index}: {key!r} is not a sequence of numbers, one per token ({exc})") from None
    if array.ndim >= 2 and array.shape[0] == 1 and length != 1:
        array = array[0]
    if array.ndim == 0 or array.shape[0] != length:
        got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} values"
        raise BatchError(f"example {index}: {key!r} has {got} but input_ids has {length} tokens; they must be the "
                         "same length")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise BatchError(f"example {index}: {key!r} must hold numbers, got dtype {array.dtype}")
    return array.astype(np.int64 if np.issubdtype(array.dtype, np.integer) or array.dtype == bool else np.float32,
                        copy=False)


def _concat_int_lists(values: Sequence[Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    """All examples' ``key`` as one flat int64 array plus the per-example lengths.

    Plain Python lists (what tokenizers and datasets give) take one conversion for the whole batch; anything else,
    or anything suspicious, goes example by example so that errors name the example.
    """
    if all(type(v) is list for v in values):
        try:
            flat = np.asarray(list(chain.from_iterable(values)))
        except ValueError:  # ragged nested lists: the per-example path names the culprit
            flat = np.empty((0, 0))
        if flat.ndim == 1 and (flat.size == 0 or np.issubdtype(flat.dtype, np.integer)):
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            return flat.astype(np.int64, copy=False), lengths
    arrays = [_as_int_array(v, key, i) for i, v in enumerate(values)]
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    return np.concatenate(arrays), lengths


@dataclass
class PackingCollator:
    """Packs examples into one row with explicit boundaries.

    Args:
        position_start: first position id of every example (architecture-given: 0, or 2 for RoBERTa-family).
        token_keys: per-token keys to concatenate like ``input_ids`` when present (in all examples or none).
        example_keys: per-example keys to stack (scalars or fixed-length vectors), required in every example.
        required_keys: keys every example must have.
        max_length: longest example allowed (``None``: no limit).
        on_overlong: ``"error"`` (default) or ``"truncate"`` examples longer than ``max_length``.
        masked_first_keys: token keys (e.g. ``"labels"``) whose first value in every example is set to
            ``ignore_index``, so that no example learns to predict its first token from the one before it.
        model_keys: the token keys the task's model reads (e.g. ``token_type_ids``, and ``labels`` for causal LM),
            recorded on every batch as :attr:`PackedBatch.model_keys` for :meth:`PackedBatch.model_inputs`; only
            keys that are also ``token_keys`` are recorded (a per-example key is never a bare model's input).
        input_token_keys: per-token model inputs the architecture declares (``Architecture.token_keys``, e.g. RoCBert's
            ``input_shape_ids``): concatenated like ``input_ids`` when present (in all examples or none), trailing
            dimensions kept (LayoutLM's ``bbox`` ``[L, 4]`` -> ``[1, T, 4]``), and recorded in ``model_keys``.
        input_example_keys: per-example model inputs the architecture declares (``Architecture.example_keys``, e.g.
            X-MOD's ``lang_ids``): stacked ``[n, ...]`` when present (in all examples or none), recorded in
            ``model_keys``.
        refused_keys: keys an example must not carry: parameters of the model's forward that no declaration carries,
            which the batch would drop (set by assembly, :func:`refusing_undeclared`).
        limit_source: when ``max_length`` is the model's own limit rather than the config's, what sets it (e.g.
            ``LlamaConfig.max_position_embeddings=2048``); error messages name it.
        vocab_size: token ids must be below it (``None``: unchecked); negative ids are always refused.
    """

    position_start: int = 0
    token_keys: tuple[str, ...] = DEFAULT_TOKEN_KEYS
    example_keys: tuple[str, ...] = ()
    required_keys: tuple[str, ...] = ("input_ids",)
    max_length: int | None = None
    on_overlong: Literal["error", "truncate"] = "error"
    masked_first_keys: tuple[str, ...] = ()
    ignore_index: int = -100
    limit_source: str = ""
    vocab_size: int | None = None
    model_keys: tuple[str, ...] = DEFAULT_TOKEN_KEYS
    input_token_keys: tuple[str, ...] = ()
    input_example_keys: tuple[str, ...] = ()
    refused_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.on_overlong not in ("error", "truncate"):
            raise ValueError(f"on_overlong must be 'error' or 'truncate', not {self.on_overlong!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be a positive integer or None, not {self.max_length!r}")

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        """The packed batch of ``examples``; a :class:`BatchError` names a bad example by its dataset index when the
        examples carry it (a trainer's rows), else by its position in this batch."""
        return collate_naming_examples(self._pack, as_examples(examples))

    def _pack(self, examples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        examples = self._check_examples(examples)
        ids, full_lengths = _concat_int_lists([ex["input_ids"] for ex in examples], "input_ids")
        self._check_masks(examples, full_lengths)
        self._check_lengths(full_lengths)
        self._check_token_ids(ids, full_lengths)
        self._check_positions(examples, full_lengths)
        keep = self._kept_tokens(full_lengths)
        lengths = full_lengths if keep is None else np.minimum(full_lengths, self.max_length)
        if keep is not None:
            ids = ids[keep]

        n, total = len(examples), int(lengths.sum())
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lengths) + self.position_start
        example_index = np.repeat(np.arange(n, dtype=np.int32), lengths)
        columns = {"input_ids": ids, "position_ids": positions, "seq_idx": example_index}
        for key in self.token_keys:
            values = self._token_key(examples, key, full_lengths, keep)
            if values is not None:
                columns[key] = values
        if "labels" in columns:
            self._check_label_ids(columns["labels"], lengths)
        for key in self.input_token_keys:
            if key not in columns and self._present(examples, key):
                rows = [_token_rows(ex[key], key, i, int(n)) for i, (ex, n) in enumerate(zip(examples, full_lengths))]
                if len({row.shape[1:] for row in rows}) > 1:
                    raise BatchError(f"{key!r} has values of shape {rows[0].shape[1:]} per token in example 0 but "
                                     f"not in every example: give every example the same shape")
                values = np.concatenate(rows)
                columns[key] = values if keep is None else values[keep]
        for key in self.masked_first_keys:
            if key in columns:
                columns[key][cu[:-1]] = self.ignore_index
        if keep is not None and "labels" in columns:
            self._note_unlabelled(columns["labels"], cu, full_lengths, dataset_indices(examples))
        batch = PackedBatch({key: torch.from_numpy(values[None]) for key, values in columns.items()})
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.from_numpy(cu.astype(np.int32))
        batch["max_length_q"] = batch["max_length_k"] = int(lengths.max())
        for key in self.example_keys:
            batch[key] = stack_example_values([ex[key] for ex in examples], repr(key))
        for key in self.input_example_keys:
            if key not in batch and self._present(examples, key):
                batch[key] = stack_example_values([ex[key] for ex in examples], repr(key))
        inputs = (*self.input_token_keys, *self.input_example_keys)
        batch.model_keys = tuple(dict.fromkeys((*(key for key in self.model_keys if key in self.token_keys),
                                                *(key for key in inputs if key in batch))))
        return batch

    @staticmethod
    def _present(examples: Sequence[Mapping[str, Any]], key: str) -> bool:
        """Whether every example has ``key`` (not ``None``): ``False`` when none has; a :class:`BatchError` when
        only some have."""
        have = [ex.get(key) is not None for ex in examples]
        if all(have) or not any(have):
            return have[0]
        raise BatchError(f"{key!r} is present in some examples but not in example {have.index(False)}: "
                         "give it to every example or to none")

    # -- checks --------------------------------------------------------------------------------------------------

    def _check_examples(self, examples: Any) -> Sequence[Mapping[str, Any]]:
        examples = as_examples(examples)
        if len(examples) == 0:
            raise BatchError("empty batch: the collator got no examples")
        for i, ex in enumerate(examples):
            if not isinstance(ex, Mapping):
                raise BatchError(f"example {i} is a {type(ex).__name__}, not a dict of features")
            missing = [key for key in (*self.required_keys, *self.example_keys) if key not in ex]
            if missing:
                raise BatchError(
                    f"example {i} is missing {', '.join(map(repr, missing))}; it has "
                    f"{', '.join(repr(key) for key in ex if key != INDEX_KEY)}"
                )
            media = [key for key in MEDIA_KEYS if ex.get(key) is not None]
            if media:
                raise BatchError(
                    f"example {i} carries {', '.join(map(repr, media))} (images or video), but this model's plugin "
                    "packs text only, and the packed batch would drop them. Vision-language families are packed by "
                    "their own plugins (padfree-plugins list: qwen2_vl, qwen2_5_vl …), which concatenate every "
                    "example's pixels beside its tokens; to add one, see docs/writing-a-plugin.md")
            refused = [key for key in self.refused_keys if ex.get(key) is not None]
            if refused:
                raise BatchError(self._refused_message(i, refused))
        return examples

    @staticmethod
    def _refused_message(index: int, keys: Sequence[str]) -> str:
        names = ", ".join(map(repr, keys))
        return (f"example {index} carries {names}, an input of the model's forward that no declaration carries: the "
                "packed batch would drop it and the model run without it. Declare it in the architecture plugin — "
                f"Architecture(token_keys=({keys[0]!r},)) for one value per token, example_keys=({keys[0]!r},) for one "
                "per example (docs/writing-a-plugin.md, Declaration fields) — or the task's token_keys / example_keys, "
                "or remove it from the examples")

    def _check_masks(self, examples: Sequence[Mapping[str, Any]], lengths: np.ndarray) -> None:
        """An example's ``attention_mask``, when it has one, is its own: one value per token (1-D, or ``[1, L]`` like
        its ``input_ids``), all ones (the collator packs unpadded examples; the packed row carries no mask)."""
        for i, ex in enumerate(examples):
            mask = ex.get("attention_mask")
            if mask is None:
                continue
            try:
                array = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
            except ValueError:  # ragged nested lists
                array = np.asarray(mask, dtype=object)
            if array.ndim == 2 and array.shape[0] == 1:
                if _is_nested(mask):
                    raise BatchError(_nested_message("attention_mask", i))
                array = array[0]
            if array.ndim != 1 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
                got = f"shape {tuple(array.shape)}" if array.dtype != object else "a ragged or non-numeric value"
                raise BatchError(
                    f"example {i}: 'attention_mask' must be one example's 1-D mask of 0/1 values (or [1, L]); got "
                    f"{got}. Pass examples one by one with their own masks, or leave attention_mask out"
                )
            if not bool(np.all(array)):
                raise BatchError(padded_message(f"example {i}"))
            if array.size != lengths[i]:
                raise BatchError(
                    f"example {i}: 'attention_mask' has {array.size} values but input_ids has {int(lengths[i])} "
                    "tokens; a mask must cover its own example's tokens exactly (was input_ids changed after "
                    "tokenizing, or the mask taken from another example?). Fix it, or leave attention_mask out: the "
                    "packed row needs none"
                )

    def _check_lengths(self, lengths: np.ndarray) -> None:
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            raise BatchError(
                f"example {int(empty[0])} has no tokens (zero-length input_ids); "
                f"{empty.size} empty example(s) in this batch — filter them out of the dataset"
            )
        if self.max_length is not None and self.on_overlong == "error":
            over = np.flatnonzero(lengths > self.max_length)
            if over.size:
                i = int(over[0])
                raise BatchError(f"{self.overlong_message(i, int(lengths[i]))} ({over.size} such example(s))")

    def _check_token_ids(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Refuse ids the embedding table does not have (an index error on CPU, a device assert on GPU)."""
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and (self.vocab_size is None or high < self.vocab_size):
            return
        bad = low if low < 0 else high
        example = int(np.searchsorted(np.cumsum(lengths), int(np.flatnonzero(ids == bad)[0]), side="right"))
        raise BatchError(outside_vocabulary_message(f"example {example}", bad, self.vocab_size))

    def _check_label_ids(self, labels: np.ndarray, lengths: np.ndarray) -> None:
        """Refuse per-token labels the LM head has no logit for: ``ignore_index`` or ``0 .. vocab_size - 1``."""
        vocab = self.vocab_size
        if not labels.size or int(labels.min()) >= 0 and (vocab is None or int(labels.max()) < vocab):
            return
        bad = (labels < 0) if vocab is None else (labels < 0) | (labels >= vocab)
        bad &= labels != self.ignore_index
        if not bad.any():
            return
        at = int(np.flatnonzero(bad)[0])
        example = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        raise BatchError(label_outside_vocabulary_message(f"example {example}", int(labels[at]), vocab,
                                                          self.ignore_index))

    def _note_unlabelled(self, labels: np.ndarray, cu: np.ndarray, full_lengths: np.ndarray,
                         indices: Sequence[int] | None) -> None:
        """Warn about truncated examples left without a label (their prompt fills ``max_length``): they train on
        nothing. The trainers' dataset check drops them before training (as TRL does); this is for the rest."""
        counts = np.add.reduceat((labels != self.ignore_index).astype(np.int64), cu[:-1])
        empty = np.flatnonzero((counts == 0) & (full_lengths > self.max_length)).tolist()
        if empty:
            rows, where = ([indices[i] for i in empty], " of the dataset") if indices is not None else \
                (empty, " (by position in this batch)")
            warnings.warn(unlabelled_message(rows, len(rows), self.max_length, where), stacklevel=4)

    def _check_positions(self, examples: Sequence[Mapping[str, Any]], lengths: np.ndarray) -> None:
        """An example's ``position_ids`` / ``cache_position``, when it carries them, are those the collator builds
        (one per token, from the architecture's start / from 0): anything else would be replaced, so it is refused."""
        for key, start in BUILT_POSITION_KEYS.items():
            if not self._present(examples, key):
                continue
            start = self.position_start if start is None else start
            for i, (ex, n) in enumerate(zip(examples, lengths)):
                values = _as_int_array(ex[key], key, i)
                if values.size != n:
                    raise BatchError(f"example {i}: {key!r} has {values.size} values but input_ids has {int(n)} "
                                     f"tokens; they must be the same length (or leave {key!r} out: the collator "
                                     "builds every example's positions)")
                wrong = np.flatnonzero(values != np.arange(start, start + n))
                if wrong.size:
                    raise BatchError(positions_message(f"example {i}", key, start, int(wrong[0]),
                                                       int(values[wrong[0]])))

    def overlong_message(self, index: int | str, length: int, where: str = "") -> str:
        """The error for an example longer than ``max_length`` (also used by the dataset check)."""
        if self.limit_source:
            return (
                f"example {index}{where} has {length} tokens but the model takes at most {self.max_length} "
                f"({self.limit_source}); truncate it when tokenizing, or set max_length: {self.max_length} and "
                "on_overlong: truncate in the acceleration config"
            )
        return (
            f"example {index}{where} has {length} tokens, more than max_length={self.max_length}; truncate it when "
            "tokenizing or set on_overlong: truncate in the acceleration config"
        )

    def _kept_tokens(self, full_lengths: np.ndarray) -> np.ndarray | None:
        """Boolean mask over the concatenated tokens when truncating, else ``None``."""
        if self.max_length is None or self.on_overlong != "truncate" or full_lengths.max() <= self.max_length:
            return None
        total = int(full_lengths.sum())
        starts = np.repeat(np.cumsum(full_lengths) - full_lengths, full_lengths)
        return np.arange(total) - starts < self.max_length

    def _token_key(self, examples: Sequence[Mapping[str, Any]], key: str, lengths: np.ndarray,
                   keep: np.ndarray | None) -> np.ndarray | None:
        """``key`` of every example concatenated; ``lengths`` are the untruncated ``input_ids`` lengths."""
        have = [key in ex and ex[key] is not None for ex in examples]
        if not any(have):
            if key in self.required_keys:
                raise BatchError(f"every example needs {key!r}")
            return None
        if not all(have):
            raise BatchError(
                f"{key!r} is present in some examples but not in example {have.index(False)}: "
                "give it to every example or to none"
            )
        flat, key_lengths = _concat_int_lists([ex[key] for ex in examples], key)
        wrong = np.flatnonzero(key_lengths != lengths)
        if wrong.size:
            i = int(wrong[0])
            raise BatchError(
                f"example {i}: {key!r} has {int(key_lengths[i])} values but input_ids has {int(lengths[i])} tokens; "
                "they must be the same length"
            )
        return flat if keep is None else flat[keep]  # always a fresh array: masking never touches the caller's data


class WrapsPackingCollator:
    """Mixin for task collators built around a :class:`PackingCollator` in ``self.packing``: exposes its
    ``max_length`` and ``on_overlong`` (read by the dataset checks before training)."""

    packing: PackingCollator

    @property
    def max_length(self) -> int | None:
        return self.packing.max_length

    @property
    def on_overlong(self) -> str:
        return self.packing.on_overlong


def split_packed_row(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A row that TRL packed (``seq_lengths``) -> its examples; per-token lists are cut, other values copied."""
    lengths = [int(n) for n in row["seq_lengths"]]
    total = len(row["input_ids"])
    if sum(lengths) != total:
        raise BatchError(f"a packed row has {total} tokens but its seq_lengths add up to {sum(lengths)}")
    per_token = {k: v for k, v in row.items() if k != "seq_lengths" and hasattr(v, "__len__") and not isinstance(v, str)
                 and len(v) == total}
    other = {k: v for k, v in row.items() if k != "seq_lengths" and k not in per_token}
    examples, start = [], 0
    for n in lengths:
        examples.append({**other, **{k: v[start : start + n] for k, v in per_token.items()}})
        start += n
    return examples


def split_packed_rows(rows: Sequence[Mapping[str, Any]]) -> list:
    """``rows`` with every row that holds several examples (a ``seq_lengths`` column, as TRL's ``packing=True``
    writes) split into them (:func:`split_packed_row`); other rows as they are."""
    if rows and isinstance(rows[0], Mapping) and "seq_lengths" in rows[0]:
        return [example for row in rows for example in split_packed_row(row)]
    return list(rows)


def rope_tables(text_config) -> list[dict]:
    """The config's RoPE parameter tables (``rope_parameters``, else the older ``rope_scaling``): one, or one per
    layer type; ``[]`` for a model without them."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(text_config, name, None)
        if isinstance(value, dict) and value:
            tables = list(value.values()) if all(isinstance(v, dict) for v in value.values()) else [value]
            return [table for table in tables if isinstance(table, dict)]
    return []


def extends_positions(text_config) -> bool:
    """Whether the model's RoPE serves examples longer than ``max_position_embeddings``: dynamic NTK scaling
    (``rope_type`` ``dynamic``, in every layer type) recomputes its frequencies for the longest position of the call
    beyond it. (``yarn``, ``llama3`` and ``longrope`` scale up to ``max_position_embeddings``, already the extended
    length; ``linear`` and ``default`` do not extend.)"""
    tables = rope_tables(text_config)
    return bool(tables) and all("dynamic" in str(t.get("rope_type", t.get("type", ""))) for t in tables)


def switching_length(text_config) -> int | None:
    """For ``longrope``: ``original_max_position_embeddings``, beyond which a call's longest position switches every
    token of the call to the long factors (``None`` for other RoPE types)."""
    lengths = [t.get("original_max_position_embeddings", getattr(text_config, "original_max_position_embeddings", None))
               for t in rope_tables(text_config) if t.get("rope_type", t.get("type")) == "longrope"]
    lengths = [int(n) for n in lengths if isinstance(n, int) and n > 0]
    return min(lengths) if lengths else None


def model_token_limit(model_config, position_start: int = 0, sequence_parallel: int = 1) -> int | None:
    """The longest example the model's positions take (``None`` when the config states no limit, or its dynamic
    RoPE extends them: :func:`extends_positions`). Under sequence parallelism each rank's slice would pick its RoPE
    frequencies by its own longest position: dynamic RoPE keeps ``max_position_embeddings`` and ``longrope`` its
    :func:`switching_length`, within which every call uses the same frequencies."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(text_config, "max_position_embeddings", None)
    limit = int(limit) if isinstance(limit, int) and limit > 0 else None
    if sequence_parallel <= 1 and extends_positions(text_config):
        return None
    switch = switching_length(text_config) if sequence_parallel > 1 else None
    if switch is not None:
        limit = switch if limit is None else min(limit, switch)
    return limit - int(position_start) if limit is not None else None


def packing_collator(task, architecture, model_config, config) -> PackingCollator:
    """The core packing collator for a task and a model: positions from the architecture, keys from the task,
    and ``max_length`` from the config or else the model's own limit (so that an over-long example is a clear
    error, not an index error deep inside the position embeddings)."""
    start = int(architecture.position_start(model_config))
    size = getattr(getattr(config, "sequence_parallel", None), "size", 1)
    limit = model_token_limit(model_config, start, size)
    source = f"{type(model_config).__name__}.max_position_embeddings={limit + start}" if limit else ""
    alone = model_token_limit(model_config, start)
    if limit and size > 1 and alone is None:
        source += (f"; its dynamic RoPE serves longer examples, but not under sequence_parallel.size: {size}, where "
                   "each rank would scale its frequencies by the longest position of its own slice")
    elif limit and size > 1 and limit != alone:
        source = (f"{type(model_config).__name__} longrope original_max_position_embeddings={limit + start}: past it "
                  "a call switches every token to the long factors, and under sequence_parallel.size: "
                  f"{size} each rank would pick its factors by the longest position of its own slice; train longer "
                  "examples with sequence_parallel.size: 1")
    if config.max_length is not None and limit is not None and config.max_length > limit:
        raise ConfigError(
            f"max_length: {config.max_length} is more than the model takes ({limit} tokens, {source}); "
            f"set max_length to at most {limit}"
        )
    token_keys = tuple(dict.fromkeys((*DEFAULT_TOKEN_KEYS, *task.token_keys)))
    task_keys = (*token_keys, *task.example_keys)
    return PackingCollator(
        position_start=start,
        token_keys=token_keys,
        example_keys=task.example_keys,
        required_keys=task.required_keys,
        max_length=config.max_length if config.max_length is not None else limit,
        on_overlong=config.on_overlong,
        masked_first_keys=task.masked_first_keys,
        limit_source="" if config.max_length is not None or limit is None else source,
        vocab_size=getattr(getattr(model_config, "get_text_config", lambda: model_config)(), "vocab_size", None),
        model_keys=tuple(key for key in token_keys if key in task.model_keys),
        input_token_keys=tuple(key for key in architecture.token_keys if key not in task_keys),
        input_example_keys=tuple(key for key in architecture.example_keys if key not in task_keys),
    )


def _packing_of(collator: Any) -> PackingCollator | None:
    if isinstance(collator, PackingCollator):
        return collator
    packing = getattr(collator, "packing", None)
    return packing if isinstance(packing, PackingCollator) else None


def _with_packing(collator: Any, change: Callable[[PackingCollator], PackingCollator]) -> Any:
    """``collator`` with its :class:`PackingCollator` (itself, or in ``packing`` of a dataclass, or in ``collator`` of a
    dataclass wrapping the task's collator, as the multimodal one) replaced by ``change(packing)``; any other
    collator, or one that ``change`` leaves as it is, is returned as it is."""
    names = {field.name for field in dataclasses.fields(collator)} if dataclasses.is_dataclass(collator) else set()
    if "collator" in names and "packing" not in names:  # a wrapper of the task's collator (the multimodal one)
        inner = _with_packing(collator.collator, change)
        return collator if inner is collator.collator else dataclasses.replace(collator, collator=inner)
    packing = _packing_of(collator)
    if packing is None or not dataclasses.is_dataclass(collator):
        return collator
    changed = change(packing)
    if changed is packing:
        return collator
    return changed if isinstance(collator, PackingCollator) else dataclasses.replace(collator, packing=changed)


def refusing_undeclared(collator: Any, forward_parameters: Iterable[str]) -> Any:
    """``collator`` (a :class:`PackingCollator`, or a dataclass wrapping one in ``packing``) refusing, in any example,
    the ``forward_parameters`` of the model that it does not carry — which the batch would otherwise drop without a
    word (``Trainer``'s ``remove_unused_columns`` keeps exactly such columns) — except :data:`HANDLED_KEYS`. Any
    other collator is returned as it is."""
    def refusing(packing: PackingCollator) -> PackingCollator:
        carried = {*HANDLED_KEYS, *packing.token_keys, *packing.example_keys, *packing.required_keys,
                   *packing.model_keys, *packing.input_token_keys, *packing.input_example_keys}
        refused = tuple(key for key in forward_parameters if key not in carried)
        if not refused:
            return packing
        return dataclasses.replace(packing, refused_keys=tuple(dict.fromkeys((*packing.refused_keys, *refused))))

    return _with_packing(collator, refusing)


def embedding_rows(model: Any) -> int | None:
    """How many token ids the model's input embeddings take (``get_input_embeddings().num_embeddings``, which may
    differ from ``config.vocab_size``), or ``None`` when it does not say."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def within_embeddings(collator: Any, model: Any) -> Any:
    """``collator`` refusing token ids the model's input embeddings do not have (:func:`embedding_rows`, in place of
    the config's ``vocab_size``); as it is when the model does not say how many it has."""
    rows = embedding_rows(model)
    if rows is None:
        return collator
    return _with_packing(collator, lambda packing: packing if packing.vocab_size == rows else
                         dataclasses.replace(packing, vocab_size=rows))
