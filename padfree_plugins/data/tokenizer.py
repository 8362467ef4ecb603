"""A tokenizer trained on the spot: ``padfree-plugins train``'s embedded default, and the tests' local tokenizer.

A low layer: it imports nothing of padfree_plugins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def train_tokenizer(texts: Sequence[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic, under a second for a few hundred rows)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
