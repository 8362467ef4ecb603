"""Re-pad packed outputs for code that insists on padded tensors (vectorised, differentiable)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from padfree_plugins.packing.batch import packed_tokens, token_examples


@dataclass(frozen=True)
class Reverter:
    """``(packed [1, T, ...], batch) -> (padded [n, Lmax, ...], attention_mask [n, Lmax])``.

    ``side`` puts the padding on the right (default) or on the left; ``pad_value`` fills it.
    """

    side: Literal["right", "left"] = "right"
    pad_value: float = 0.0

    def __call__(self, packed: torch.Tensor, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
        if packed.ndim < 2 or packed.shape[0] != 1:
            raise ValueError(f"packed outputs are [1, T, ...]; got shape {tuple(packed.shape)}")
        rows = packed[0]
        total = packed_tokens(batch)
        if total is not None and rows.shape[0] != total:
            raise ValueError(f"the packed outputs have {rows.shape[0]} tokens but the packed batch has {total}")
        cu = batch["cu_seq_lens_q"].to(rows.device, torch.long)
        lengths = cu.diff()
        n, longest, total = lengths.numel(), int(batch["max_length_q"]), rows.shape[0]
        example = token_examples(cu, total)
        column = torch.arange(total, device=rows.device) - cu[:-1].repeat_interleave(lengths, output_size=total)
        if self.side == "left":
            column = column + (longest - lengths).repeat_interleave(lengths, output_size=total)
        padded = rows.new_full((n, longest, *rows.shape[1:]), self.pad_value).index_put((example, column), rows)
        mask = torch.zeros(n, longest, dtype=torch.long, device=rows.device).index_put(
            (example, column), torch.ones(total, dtype=torch.long, device=rows.device)
        )
        return padded, mask
