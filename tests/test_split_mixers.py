"""Sequence mixers split across sequence-parallel ranks, without processes: where a slice's segments and cuts are, which
mixers run split and which gathered (Mamba1, with a warning saying why; everything under ``mixers: gather``), the
config key. The distributed equivalence of every hybrid family (logits, loss, gradients against one process, and the
deliberate faults ``mixer_scans_only_its_slice`` / ``state_from_wrong_rank``) is in tests/test_sequence_parallel.py
(its sp2 launch); training through HF Trainer in tests/test_sequence_parallel_trainers.py."""

from __future__ import annotations

import warnings

import pytest

from padfree_plugins import assemble
from padfree_plugins.config.schema import PadfreeConfig
from padfree_plugins.errors import ConfigError
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.modeling.sequence_parallel import SequenceParallelPatch, SplitMixer, WholeRowMixer
from padfree_plugins.modeling.split_mixers import SliceSegments, slice_segments
from tests.hybrids_common import hybrid_model


def test_slice_segments_find_the_pieces_that_cross_a_cut():
    """Row 0 3 | 7 11 | 12 (slices of 4 tokens): rank 1's slice [4, 8) continues the example 3..7 and its last
    example goes on past 8; a slice that starts and ends at boundaries neither continues nor is continued; an example
    spanning a whole slice is both."""
    cu = [0, 3, 7, 11, 12]
    assert slice_segments(cu, 0, 4) == SliceSegments((0, 3, 4), False, True)
    assert slice_segments(cu, 4, 4) == SliceSegments((0, 3, 4), True, True)
    assert slice_segments(cu, 8, 4) == SliceSegments((0, 3, 4), True, False)
    assert slice_segments([0, 4, 8], 4, 4) == SliceSegments((0, 4), False, False)
    assert slice_segments([0, 1, 11, 12], 4, 4) == SliceSegments((0, 4), True, True)


def forwards(model, kind):
    return [module for module in model.modules() if isinstance(module.__dict__.get("forward"), kind)]


def installed(model_type: str, mixers: str = "split"):
    """The model assembled (one process), then sequence parallelism over a group of 2 installed (no communication
    at install); the warnings raised."""
    model = hybrid_model(model_type)
    assembly = assemble(model, {"attention": "exact"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch = SequenceParallelPatch.install(assembly.patch, SequenceGroup(None, 0, 2), mixers=mixers)
    return model, assembly, patch, [str(w.message) for w in caught if "sequence_parallel.mixers" in str(w.message)]


def test_mixers_that_start_from_a_state_run_split_and_undo_restores_them():
    model, assembly, patch, warned = installed("qwen3_5_text")
    assert len(forwards(model, SplitMixer)) == 2 and not forwards(model, WholeRowMixer) and not warned
    patch.remove()
    assert not forwards(model, SplitMixer)
    assembly.undo()


def test_undoing_an_assembly_with_split_mixers_leaves_the_model_as_it_was(monkeypatch):
    """``assemble`` with ``sequence_parallel.size: 2`` then ``undo()``: no mixer keeps a patched forward (the split
    mixer went over the packed one; undone last-first), so assembling again splits the mixers again."""
    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))
    model = hybrid_model("qwen3_5_text")
    before = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    config = {"attention": "exact", "sequence_parallel": {"size": 2}}
    assembly = assemble(model, config)
    assert len(forwards(model, SplitMixer)) == 2
    assembly.undo()
    assert {name: module.__dict__.get("forward") for name, module in model.named_modules()} == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot start from another rank's state" warning
        again = assemble(model, config)
    assert len(forwards(model, SplitMixer)) == 2 and not forwards(model, WholeRowMixer)
    again.undo()


def test_a_split_mixer_partitioned_by_zero3_after_assembly_is_refused_at_its_first_call():
    """A model DeepSpeed ZeRO-3 wrapped after assembly with no configuration the assembly could see: the split
    mixer refuses its first packed call (on every rank alike, before any exchange) rather than hang in a gather."""
    import torch

    model, assembly, patch, _ = installed("qwen3_5_text")
    module = forwards(model, SplitMixer)[0]
    for number, parameter in enumerate(module.parameters()):
        parameter.ds_id = number
    hidden = torch.zeros(1, 4, model.config.hidden_size)
    with pytest.raises(ConfigError, match=r"mixers: split under DeepSpeed ZeRO-3 \(Qwen3_5GatedDeltaNet\).*"
                                          r"sequence_parallel.mixers: gather"):
        module(hidden_states=hidden, cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32))
    patch.remove()
    assembly.undo()


def test_mamba1_runs_gathered_with_a_warning_saying_why():
    model, assembly, patch, warned = installed("jamba")
    assert forwards(model, WholeRowMixer) and not forwards(model, SplitMixer)
    assert len(warned) == 1 and "whole row" in warned[0] and "initial SSM state" in warned[0], warned
    patch.remove()
    assembly.undo()


def test_mixers_gather_keeps_every_mixer_on_the_whole_row_without_a_warning():
    model, assembly, patch, warned = installed("bamba", "gather")
    assert len(forwards(model, WholeRowMixer)) == 2 and not forwards(model, SplitMixer) and not warned
    patch.remove()
    assembly.undo()


def test_an_unknown_mixers_value_is_refused_with_the_nearest():
    assert PadfreeConfig.from_dict({"sequence_parallel": {"size": 2}}).sequence_parallel.mixers == "split"
    with pytest.raises(ConfigError, match="mixers must be one of 'split', 'gather', got 'gathr'. Did you mean "
                                          "'gather'?"):
        PadfreeConfig.from_dict({"sequence_parallel": {"mixers": "gathr"}})
