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
from padfree_plugins.errors import BoundaryError, ConfigError
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.modeling.sequence_parallel import SequenceParallelPatch, SplitMixer, WholeRowMixer
from padfree_plugins.modeling.split_mixers import PREVIOUS_RANK, SlicePlan, slice_plan
from padfree_plugins.testing.undo import assert_state_restored, model_state
from tests.hybrids_common import hybrid_model


def test_slice_plans_find_the_pieces_that_cross_a_cut():
    """Row 0 3 | 7 11 | 12 (slices of 4 tokens): rank 1's slice [4, 8) continues the example 3..7 and its last
    example goes on past 8; a slice that starts and ends at boundaries neither continues nor is continued; an example
    spanning a whole slice is both. Without shared prefixes only the cut piece's state crosses a cut."""
    cu = [0, 3, 7, 11, 12]
    fresh = (-1, -1)
    assert slice_plan(cu, 0, 4) == SlicePlan((0, 3, 4), (fresh, fresh), frozenset({1}), (), ((PREVIOUS_RANK, 1),))
    assert slice_plan(cu, 4, 4) == SlicePlan((0, 3, 4), ((PREVIOUS_RANK,) * 2, fresh), frozenset({1}),
                                             (PREVIOUS_RANK,), ((PREVIOUS_RANK, 1),))
    assert slice_plan(cu, 8, 4) == SlicePlan((0, 3, 4), ((PREVIOUS_RANK,) * 2, fresh), frozenset(),
                                             (PREVIOUS_RANK,), ())
    assert slice_plan([0, 4, 8], 4, 4) == SlicePlan((0, 4), (fresh,), frozenset(), (), ())
    assert slice_plan([0, 1, 11, 12], 4, 4) == SlicePlan((0, 4), ((PREVIOUS_RANK,) * 2,), frozenset({0}),
                                                         (PREVIOUS_RANK,), ((PREVIOUS_RANK, 0),))


def test_slice_plans_hand_a_parent_state_on_to_every_rank_that_holds_a_child():
    """A shared row of slices of 5 tokens: prompt 0 (0..3) with children 1 (3..6, cut at 5), 2 (6..8) and 5 (16..19,
    on rank 3); prompt 3 (8..12, cut at 10) with child 4 (12..16, cut at 15). Prompt 0's final state, kept on rank 0,
    is handed to rank 1 (children 1's rest needs it not, child 2 does) and relayed by ranks 1 and 2 to rank 3; prompt
    3's from rank 2 to rank 2's own child 4, then nowhere; each cut also hands on its cut piece."""
    cu = [0, 3, 6, 8, 12, 16, 19, 20]
    sources = [(-1, -1), (0, 0), (0, 0), (-1, -1), (3, 3), (0, 0), (-1, -1)]
    parent = ("segment", 0)
    plans = [slice_plan(cu, start, 5, sources) for start in range(0, 20, 5)]
    assert plans[0] == SlicePlan((0, 3, 5), ((-1, -1), (0, 0)), frozenset({0, 1}), (),
                                 ((PREVIOUS_RANK, 1), (parent, 0)))
    assert plans[1] == SlicePlan((0, 1, 3, 5), ((PREVIOUS_RANK,) * 2, (parent, parent), (-1, -1)), frozenset({2}),
                                 (PREVIOUS_RANK, parent), ((PREVIOUS_RANK, 2), (parent, parent)))
    assert plans[2] == SlicePlan((0, 2, 5), ((PREVIOUS_RANK,) * 2, (0, 0)), frozenset({0, 1}),
                                 (PREVIOUS_RANK, parent), ((PREVIOUS_RANK, 1), (parent, parent)))
    assert plans[3] == SlicePlan((0, 1, 4, 5), ((PREVIOUS_RANK,) * 2, (parent, parent), (-1, -1)), frozenset(),
                                 (PREVIOUS_RANK, parent), ())
    with pytest.raises(BoundaryError, match="continues segment 2, which is not an earlier one"):
        slice_plan(cu, 0, 5, [(-1, -1), (2, 2), *sources[2:]])


def forwards(model, kind):
    return [module for module in model.modules() if isinstance(module.__dict__.get("forward"), kind)]


def installed(model_type: str, mixers: str = "split"):
    """The model assembled (one process), then sequence parallelism over a group of 2 installed (no communication
    at install); the warnings raised."""
    model = hybrid_model(model_type)
    installed.before = model_state(model)
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
    assert_state_restored(installed.before, model)


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
