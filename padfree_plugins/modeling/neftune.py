"""NEFTune (``neftune_noise_alpha``) on packed batches: the noise padded training adds, not a weaker one.

transformers adds uniform noise of magnitude ``alpha / sqrt(L * d)`` to the input embeddings, with ``L`` the
length of the batch's rows. On a padded batch that is the longest example; on a packed row it would be the total
number of tokens (for 16 examples, noise about 2-4× weaker, silently). Here the noise is drawn as for the
right-padded batch ``[n, L_max, d]`` and each real token takes the noise of its padded slot: the same magnitude
as padded training, and, from the same random state, the same values.

The trainer patch installs :class:`PackedNeftune` in place of the trainer's own hook and tells it the packed batch
of each training forward (:meth:`PackedNeftune.for_batch`); outside those forwards it adds nothing, as the trainer's
hook exists only during ``train()``. ``undo()`` removes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from padfree_plugins.modeling.attention.backends import padded_slots


@dataclass
class PackedNeftune:
    """A forward hook for the input embeddings: NEFTune noise per example of the packed batch in progress (another
    input during it gets transformers' own formula; a forward outside :meth:`for_batch` gets no noise)."""

    alpha: float
    batch: Mapping | None = field(default=None, repr=False)
    handle: Any = field(default=None, repr=False)

    def __call__(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if not module.training or batch is None:
            return output
        if "cu_seq_lens_q" not in batch or output.ndim != 3 or output.shape[0] != 1:
            return output + self.noise(output.shape, output.size(1), output)  # transformers' own formula
        cu_seq_lens = batch["cu_seq_lens_q"].to(output.device)
        examples, longest, total = cu_seq_lens.numel() - 1, int(batch["max_length_q"]), output.shape[1]
        noise = self.noise((examples, longest, output.shape[2]), longest, output).view(examples * longest, -1)
        slots, _ = padded_slots(cu_seq_lens, total, longest)
        return output + noise.index_select(0, slots).unsqueeze(0)

    def noise(self, shape: tuple[int, ...], length: int, like: torch.Tensor) -> torch.Tensor:
        """Uniform noise of ``shape`` for rows of ``length`` tokens, drawn as transformers draws it."""
        magnitude = self.alpha / torch.sqrt(torch.tensor(length * like.size(-1)))
        return torch.zeros(shape, dtype=like.dtype, device=like.device).uniform_(-magnitude, magnitude)

    @contextmanager
    def for_batch(self, batch: Mapping) -> Iterator[None]:
        """Within the block, forwards of the embeddings belong to ``batch``."""
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None

    @classmethod
    def install(cls, embeddings: torch.nn.Module, alpha: float) -> "PackedNeftune":
        hook = cls(alpha)
        hook.handle = embeddings.register_forward_hook(hook)
        return hook

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
