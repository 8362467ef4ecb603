"""The packed-batch contract: what a padding-free collator produces and every later stage reads.

A batch of ``n`` examples of lengths ``L_1 … L_n`` (``T = sum L_i``) is one row::

    input_ids       int64 [1, T]     tokens of all examples, back to back, no padding
    position_ids    int64 [1, T]     restart at ``position_start`` for every example (2 for RoBERTa-family)
    cu_seq_lens_q   int32 [n + 1]    example boundaries: 0, L_1, L_1 + L_2, …, T
    cu_seq_lens_k   int32 [n + 1]    the same tensor (self-attention)
    max_length_q    int              max L_i, a python int so kernels need no GPU->CPU sync
    max_length_k    int              the same
    seq_idx         int32 [1, T]     example index of every token
    <token keys>    [1, T]           e.g. labels, token_type_ids — concatenated like input_ids
    <example keys>  [n] or [n, k]    e.g. a class label, a group id — one row per example

The boundaries are computed once, in the collator; nothing downstream re-derives them from ``position_ids``.
"""

from __future__ import annotations

import torch

#: The keys that carry the boundaries into attention (``**kwargs`` of transformers models).
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: What a patched model is called with on every packed batch: the tokens, their positions and the boundaries.
MODEL_INPUT_KEYS = ("input_ids", "position_ids", *BOUNDARY_KEYS)


def token_examples(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """The example of every one of the ``total`` packed tokens (int64 ``[T]``, on ``cu_seq_lens``' device), from
    the boundaries ``0, L1, …, T``; sizes come from ``total``, so nothing is read back from the device."""
    lengths = cu_seq_lens.diff().long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seq_lens.device), lengths,
                                   output_size=total)


class PackedBatch(dict):
    """A ``dict`` of tensors (and two ints) following the contract above.

    It stays a plain ``dict`` for ``Trainer`` (which rebuilds it with ``type(batch)(...)`` when moving it to a
    device) and for pickling; the properties only read it.
    """

    @property
    def num_examples(self) -> int:
        return int(self["cu_seq_lens_q"].numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self["input_ids"].shape[-1])

    @property
    def lengths(self) -> torch.Tensor:
        """Example lengths, int64 ``[n]``."""
        return self["cu_seq_lens_q"].diff().long()

    def model_inputs(self, *extra: str) -> dict:
        """``input_ids``, ``position_ids`` and the boundaries, plus the named ``extra`` keys that are present."""
        return {key: self[key] for key in (*MODEL_INPUT_KEYS, *extra) if key in self}

    def to(self, device: torch.device | str) -> "PackedBatch":
        """A copy with every tensor on ``device``."""
        return PackedBatch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})
