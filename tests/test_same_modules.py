"""Every rank runs the same modules, and as many micro-batches, each step: under FSDP2 and ZeRO-3 (2 CPU processes)
a rank that skips a module's forward leaves the others in its all-gather.

One launch (tests/same_modules_run.py, started once: tests/shared_launch.py) trains six scenarios under each engine,
each equal to one process on the same global batches (loss and every weight to 1e-5): a tiny Qwen2-VL, Gemma 3,
Idefics3 and LLaVA-OneVision whose rank 1 sees text only (its vision tower runs on the family's idle image,
``modeling.vision.IdleTower``), a tiny Qwen3-MoE whose rank 1 routes its two tokens to at most
two of 8 experts (transformers' experts are fused 3-D parameters in one ``*Experts`` module, which runs whatever
the routing: nothing to skip), and token budgets with over-long examples split into chunks (every rank gets the
same number of micro-batches: the plan is step-major, ``N`` per step). Without the idle tower the Qwen2-VL launch
fails fast with a collective mismatch, rank 0 having run the vision tower and rank 1 not (a hang fails the test). In
one process, every family's idle image (SmolVLM's too) adds exactly zero to the logits, gives its tower and projector
zero gradients and reaches the parameters a forward with an image reaches.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from padfree_plugins import BatchError, assemble
from tests.distributed_common import engine_runs, launch_diverging
from tests.same_modules_run import SPLIT_CONFIG, STEPS, VLM_SCENARIOS, build, reference, split_steps
from tests.test_sharded import needs_deepspeed

pytest.importorskip("PIL")
TOLERANCE = 1e-5
#: Launched: every vision-language family's own packing (SmolVLM's is Idefics3's: one process only).
SCENARIOS = ("vlm", "gemma3", "idefics3", "llava_onevision", "moe", "split")


@functools.lru_cache(maxsize=None)
def reference_of(scenario: str) -> dict:
    return reference(scenario)


def differences(run: dict, want: dict) -> tuple[float, float]:
    loss = max(abs(a - b) for a, b in zip(run["losses"], want["losses"]))
    assert run["state"].keys() == want["state"].keys()
    weight = max((run["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    return loss, weight


@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_every_rank_runs_the_same_modules_and_equals_one_process(request, tmp_path_factory, engine):
    started = time.monotonic()
    runs = engine_runs(request, tmp_path_factory, "same_modules_run.py", *SCENARIOS)
    for scenario in SCENARIOS:
        run, want = runs[scenario], reference_of(scenario)
        assert run["sharding"]["local_numel"] < run["sharding"]["numel"]  # really sharded
        assert run["micro_batches"] == [want["micro_batches"]] * 2 == [len(run["losses"])] * 2
        loss, weight = differences(run, want)
        print(f"{engine} {scenario}: max loss difference {loss:.2e}, max weight difference {weight:.2e}")
        assert loss < TOLERANCE and weight < TOLERANCE, scenario
        initial = dict(build(scenario, 2)[0].named_parameters())
        moved = {k: (want["state"][k] - initial[k]).abs().max().item() for k in want["state"]}
        assert max(moved.values()) > 100 * TOLERANCE  # the comparison has teeth
        if scenario in VLM_SCENARIOS:  # the tower trains (from rank 0's images), so its weights are compared too
            assert max(v for k, v in moved.items() if tower_parameter(scenario, k)) > 100 * TOLERANCE
        if scenario == "moe":  # per forward, the experts each rank's tokens reached (one list per MoE layer)
            rank0, rank1 = run["experts"]
            assert all(len(hit) == 8 for hit in rank0) and all(len(hit) <= 2 for hit in rank1)
    print(f"{engine}: {time.monotonic() - started:.0f} s")


def tower_parameter(scenario: str, name: str) -> bool:
    return any(part in name for part in VLM_SCENARIOS[scenario])


def test_the_scenarios_are_what_they_claim():
    """Rank 1 of each vision-language scenario never has an image, rank 0 always; the split scenario splits examples
    and its plan gives both ranks a micro-batch in every step."""
    for scenario in VLM_SCENARIOS:
        model, config, steps = build(scenario, 2)
        assert len(steps) == STEPS
        assert all(any("pixel_values" in ex for ex in images) and not any("pixel_values" in ex for ex in texts)
                   for images, texts in steps), scenario
        assert any(tower_parameter(scenario, name) for name, _ in model.named_parameters()), scenario
    model, config, dataset = build("split", 2)
    budget = SPLIT_CONFIG["batching"]["max_tokens_per_batch"]
    assert max(len(example["input_ids"]) for example in dataset) > 2 * budget
    plan = split_steps(dataset, assemble(model, config).collator, 2)
    chunks = [example for step in plan for examples in step for example in examples]
    assert len(chunks) > len(dataset)  # over-long examples became several chunks
    assert all(len(step) == 2 and all(step) for step in plan)


def test_without_the_idle_tower_a_text_only_rank_runs_other_modules(tmp_path):
    """The old behaviour: rank 1's text-only micro-batch skips the vision tower, whose FSDP2 units rank 0
    all-gathers; the launch fails fast with a collective mismatch, rank 0 having run the tower and rank 1 not."""
    ran = launch_diverging("same_modules_run.py", tmp_path / "fsdp2.pt", "fsdp2", "vlm", "--no-idle-tower",
                           timeout=240)
    assert any(".visual" in name for name in ran[0] - ran[1]), ran
    assert not any(".visual" in name for name in ran[1]), ran


# -- one process: what the idle tower adds (nothing) and when it runs ------------------------------------------------


def text_only_batch(scenario: str):
    """The scenario's model in train mode, its assembly, rank 1's first (text-only) batch and rank 0's (an image)."""
    model, config, steps = build(scenario, 2)
    model.train()
    assembly = assemble(model, config)
    return model, assembly, assembly.collator(steps[0][1]), assembly.collator(steps[0][0])


@pytest.fixture
def text_only():
    return text_only_batch("vlm")[:3]


def forward_backward(model, assembly, batch):
    """The logits and every parameter's gradient (``None`` where the forward did not reach it)."""
    model.zero_grad(set_to_none=True)
    logits = assembly.forward(model, batch).logits
    logits.sum().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("scenario", list(VLM_SCENARIOS))
def test_idle_tower_adds_exactly_zero_and_runs_only_with_several_processes(scenario, monkeypatch):
    import padfree_plugins.modeling.vision as vision

    model, assembly, batch, with_image = text_only_batch(scenario)
    assert "pixel_values" not in batch and "pixel_values" in with_image
    _, grads = forward_backward(model, assembly, with_image)
    with_images = {name for name, grad in grads.items() if grad is not None}  # what a forward with images reaches
    tower = {name for name in with_images if tower_parameter(scenario, name)}
    alone, grads = forward_backward(model, assembly, batch)
    assert tower and all(grads[name] is None for name in tower)  # one process: the tower does not run
    monkeypatch.setattr(vision, "several_processes", lambda: True)
    logits, grads = forward_backward(model, assembly, batch)
    assert torch.equal(logits, alone)  # exactly the text's logits
    assert all(grads[name] is not None and not grads[name].any() for name in tower)  # ran; zero gradients
    assert {name for name, grad in grads.items() if grad is not None} == with_images  # every rank the same modules
    assembly.undo()
    assert "forward" not in model.base_model.__dict__


def test_a_sharded_tower_without_an_idle_image_is_refused(text_only, monkeypatch):
    import padfree_plugins.modeling.vision as vision

    model, assembly, batch = text_only
    monkeypatch.setattr(vision, "several_processes", lambda: True)
    monkeypatch.setattr(vision, "sharded", lambda module: True)
    monkeypatch.setattr(model.model.forward, "idle_image", lambda config: None)
    with pytest.raises(BatchError, match="without images.*sharded.*idle_image"):
        assembly.forward(model, batch)
