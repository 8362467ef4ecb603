"""TRL ``DPOTrainer`` on image-text pairs under FSDP2 and ZeRO-3 (2 gloo CPU processes): a rank whose micro-batch has
no image still runs the vision towers, every step, so the sharded towers' all-gathers never wait on it.

The worker (tests/dpo_vision_sharded_run.py, one launch for both engines: tests/shared_launch.py) builds the DPO
trainer (tiny Qwen2.5-VL and its reference model) in each rank, makes it padding-free with ``accelerate(trainer)``,
shards both models and drives 3 steps itself: rank 0's pairs with images, rank 1's text only, through TRL's collator
and ``compute_loss`` (each fused log-probability call packed by ``pack_media_call``), plain SGD. Checked: the launch
finishes within its timeout; every fused call of both models on both ranks is packed; on rank 1 both towers run once
a step on the idle image (``modeling.vision.IdleTower``, reached through TRL's fused forward); the losses and every
final weight equal one process that trains the same global batches (each step the mean of the two micro-batches'
losses) within 1e-5. Without the idle tower the launch fails fast with a collective mismatch, after rank 0 ran the
policy's vision tower and rank 1 no tower.
"""

from __future__ import annotations

import functools
import time

import pytest

from tests.distributed_common import engine_runs, launch_diverging
from tests.dpo_vision_sharded_run import STEPS, reference
from tests.test_sharded import needs_deepspeed

pytest.importorskip("PIL")
pytest.importorskip("trl")

TOLERANCE = 1e-5
ENGINES = ["fsdp2", pytest.param("zero3", marks=needs_deepspeed)]


@functools.lru_cache(maxsize=1)
def reference_run() -> dict:
    return reference()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_text_only_rank_runs_the_towers_every_step_and_trains_as_one_process(request, tmp_path_factory, engine):
    started = time.monotonic()
    run = engine_runs(request, tmp_path_factory, "dpo_vision_sharded_run.py")
    assert run["media"] == [[True] * STEPS, [False] * STEPS]  # rank 0 images every step, rank 1 never
    assert run["sharding"]["local_numel"] < run["sharding"]["numel"] and all(run["ref_sharded"])
    assert run["packed"] == [[True] * 2 * STEPS] * 2  # each step the policy's and the reference's call, packed
    assert run["towers"] == [[2] * STEPS] * 2  # both models' towers, every step, on both ranks
    assert run["idle"] == [[0] * STEPS, [2] * STEPS]  # on rank 1 through the idle tower

    want = reference_run()
    losses = max(abs(a - b) / abs(b) for got, ref in zip(run["losses"], want["losses"]) for a, b in zip(got, ref))
    assert run["state"].keys() == want["state"].keys() and len(run["losses"]) == len(want["losses"]) == STEPS
    weights = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    print(f"{engine}: losses {losses:.1e} relative, weights {weights:.1e}, {time.monotonic() - started:.0f} s")
    assert losses < TOLERANCE and weights < TOLERANCE


def test_the_comparison_has_teeth():
    """The reference's weights move far beyond the tolerance, the vision tower's too (from rank 0's images)."""
    from tests.test_vision_trainers import model

    want, initial = reference_run(), dict(model().named_parameters())
    moved = {k: (want["state"][k] - initial[k]).abs().max().item() for k in want["state"]}
    assert max(moved.values()) > 100 * TOLERANCE
    assert max(value for name, value in moved.items() if ".visual." in name) > 100 * TOLERANCE


@pytest.mark.parametrize("engine", ENGINES)
def test_without_the_idle_tower_the_text_only_rank_runs_other_modules(tmp_path, engine):
    """Rank 1's fused calls skip both towers, whose sharded blocks rank 0 all-gathers: the launch fails fast with a
    collective mismatch, rank 0 having run the policy's tower and rank 1 no tower."""
    ran = launch_diverging("dpo_vision_sharded_run.py", tmp_path / f"{engine}.pt", engine, "--no-idle-tower",
                           timeout=240)
    assert any(name.startswith("policy.") and ".visual" in name for name in ran[0] - ran[1]), ran
    assert not any(".visual" in name for name in ran[1]), ran
