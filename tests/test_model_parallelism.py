"""accelerate's tensor parallelism (``tp_size > 1``) and hybrid sharding (HSDP, ``dp_replicate_size`` x
``dp_shard_size``) are refused at ``accelerate()`` with the reason and what to use instead, the trainer unchanged:
neither is verified with packed rows, and neither runs on CPU processes (accelerate 1.15 takes no FSDP there), so
neither may train unchecked. Replicating only (DDP) and sharding only (FSDP2) pass this check."""

from __future__ import annotations

import pytest
from accelerate.parallelism_config import ParallelismConfig

from padfree_plugins import accelerate
from padfree_plugins.errors import PadfreeError
from padfree_plugins.integrations.checks import check_model_parallelism
from padfree_plugins.modeling.patching import patch_of
from tests.test_trainer import make_trainer


@pytest.mark.parametrize("sizes, match", [
    ({"tp_size": 2}, r"tensor parallelism \(parallelism_config tp_size=2\).*set tp_size=1"),
    ({"dp_replicate_size": 2, "dp_shard_size": 2}, r"hybrid sharding \(HSDP.*dp_replicate_size=2 x dp_shard_size=2"),
])
def test_tensor_parallelism_and_hsdp_are_refused_trainer_untouched(monkeypatch, sizes, match):
    trainer, _ = make_trainer("hf", packed=False)
    collator, get_loader = trainer.data_collator, trainer.get_train_dataloader
    parallelism = ParallelismConfig(**sizes)
    monkeypatch.setattr(type(trainer.accelerator), "parallelism_config", property(lambda self: parallelism))
    with pytest.raises(PadfreeError, match=match):
        accelerate(trainer, {"task": "causal_lm"})
    assert patch_of(trainer.model) is None
    assert trainer.data_collator is collator and trainer.get_train_dataloader == get_loader


@pytest.mark.parametrize("sizes", [{}, {"dp_shard_size": 2}, {"dp_replicate_size": 2}, {"dp_replicate_size": 2,
                                                                                       "dp_shard_size": 1}])
def test_replicate_only_or_shard_only_pass(sizes):
    check_model_parallelism(ParallelismConfig(**sizes))
    check_model_parallelism(None)


def test_trainer_fsdp_options_that_accelerate_ignored_are_refused(monkeypatch):
    """On CPU processes accelerate 1.15 turns TrainingArguments(fsdp=...) into DDP silently (Trainer's
    is_fsdp_enabled stays False, checked with 2 torchrun processes): refused, the trainer unchanged."""
    trainer, _ = make_trainer("hf", packed=False)
    collator = trainer.data_collator
    monkeypatch.setattr(trainer.args, "fsdp", ["full_shard"])
    monkeypatch.setattr(trainer, "is_fsdp_enabled", False)
    with pytest.raises(PadfreeError, match=r"fsdp=\['full_shard'\] is set, but accelerate did not turn FSDP on"):
        accelerate(trainer, {"task": "causal_lm"})
    assert patch_of(trainer.model) is None and trainer.data_collator is collator
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True)  # FSDP really on (a GPU launch): accepted
    accelerate(trainer, {"task": "causal_lm"}).undo()
