"""Accelerate a trainer that someone else's code builds: ``with accelerating_on_train(cfg): their_main()``.

TRL's scripts build their trainer inside ``main()``, where no hook sees it. For the duration of the block,
``transformers.Trainer.train`` first applies :func:`~padfree_plugins.integrations.accelerate.accelerate` to the
trainer it is called on (once per trainer; one already made padding-free is left as it is), then trains. On leaving
the block ``Trainer.train`` is restored.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from padfree_plugins.config.schema import PadfreeConfig
from padfree_plugins.integrations.accelerate import ACCELERATION_ATTRIBUTE, accelerate


@contextmanager
def accelerating_on_train(config: PadfreeConfig) -> Iterator[list[Any]]:
    """Within the block, every ``transformers.Trainer`` (subclasses included) is made padding-free with ``config``
    when its ``train()`` starts. Yields the list of :class:`Acceleration` objects applied, in order."""
    from transformers import Trainer

    original = Trainer.__dict__["train"]
    applied: list[Any] = []

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(self, ACCELERATION_ATTRIBUTE, None)
        if previous is None or not previous.active:
            applied.append(accelerate(self, config))
        return original(self, *args, **kwargs)

    Trainer.train = train
    try:
        yield applied
    finally:
        Trainer.train = original
