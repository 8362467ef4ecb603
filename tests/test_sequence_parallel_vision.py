"""Image-text rows under sequence parallelism (``sequence_parallel: {size: 2}``) on 2 CPU processes (gloo; the worker
is tests/sequence_parallel_vision_run.py, every case in one torchrun launch with a timeout).

Each rank loads its own image-text micro-batch; the group joins them into one row (the media with them, in rank
order) and the model embeds the whole row, runs its vision tower on every image and merges the features on every
rank; its language model then takes this rank's half (``SliceRow``). In every case the group's row is cut inside an
image's tokens (asserted), and every result equals one process on the same examples: losses to 1e-5 (relative),
gradients — the vision tower's included — to 1e-4:

* ``assembly.forward`` + backward on Qwen2.5-VL (mRoPE ``[4, 1, T]`` positions; also with one rank's micro-batch
  without images, which sends no pixels), Qwen2-VL, Gemma 3 (the cut image's tokens attend to each other both ways
  across the two slices), Qwen3-VL and Qwen3-VL-MoE (deepstack features per visual token);
* HF ``Trainer`` on Qwen2.5-VL processor rows and TRL ``SFTTrainer`` on conversational rows with images (TRL's
  vision collator, gradient checkpointing), 2 SGD steps each (logged losses, first step's gradients after DDP);
* TRL ``DPOTrainer`` on Qwen2.5-VL image-text pairs (the fused log-probability path), 2 SGD steps, against TRL's own
  one-process run (padded) of the same global batches (losses, reward margins, first step's gradients);
* TRL ``GRPOTrainer`` on Qwen2.5-VL prompts with images, one SGD step, against TRL's own run on the same 2 processes
  (the same sampled completions; its rows are split, but not necessarily inside an image).

The deliberate fault ``image_features_sliced_off_by_one`` (a later rank's merged embeddings cut one token early) is
far off. What image-text rows under sequence parallelism do not take is refused in one process (the group faked),
before anything changes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from padfree_plugins import ConfigError, assemble, patch_of
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from tests.test_distributed import ROOT, free_port, run_group

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

LOSS = 1e-5
GRADIENT = 1e-4
FORWARDS = ("qwen2_5_vl", "qwen2_vl", "gemma3", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl-text-rank")
TOWERS = ("visual", "vision_tower", "multi_modal_projector")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every case of the worker, in one 2-process launch."""
    from tests.sequence_parallel_vision_run import CASES

    out = tmp_path_factory.mktemp("sequence_parallel_vision") / "runs.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / "sequence_parallel_vision_run.py"), str(out), *CASES]
    returncode, output = run_group(command, env, timeout=240, results=[out])
    assert returncode == 0, output[-6000:]
    return torch.load(out, weights_only=False)


def tower(name: str) -> bool:
    return any(part in name for part in TOWERS)


def gradient_difference(got: dict, want: dict) -> tuple[float, float]:
    """The largest gradient difference over every parameter, and over the vision tower's (and projector's) alone;
    every parameter that has a gradient in one has it in the other, the tower's among them and not all zero."""
    assert got.keys() == want.keys()
    towers = [name for name in want if tower(name)]
    assert towers and max(want[name].abs().max().item() for name in towers) > 1e-3  # the tower learns
    every = max((got[name] - want[name]).abs().max().item() for name in want)
    return every, max((got[name] - want[name]).abs().max().item() for name in towers)


@pytest.mark.parametrize("family", FORWARDS)
def test_an_image_text_row_split_across_ranks_equals_one_process(launched, family):
    run = launched[f"forward-{family}"]
    assert run["cut"], "the group's row must be cut inside an image's tokens"
    assert run["seen"] == [run["slice"]] and run["slice"] * 2 >= run["row"]  # the language model got a half
    every, towers = gradient_difference(run["grads"], run["reference_grads"])
    loss = abs(run["loss"] - run["reference_loss"]) / abs(run["reference_loss"])
    print(f"{family} sp2: loss {loss:.1e} (relative), gradients {every:.1e}, tower {towers:.1e}")
    assert loss < LOSS and every < GRADIENT and towers < GRADIENT


def test_image_features_sliced_off_by_one_are_far_off(launched):
    """The fault: the later rank's slice of the merged embeddings one token early (its positions right)."""
    run = launched["forward-qwen2_5_vl-fault"]
    every, towers = gradient_difference(run["grads"], run["reference_grads"])
    loss = abs(run["loss"] - run["reference_loss"]) / abs(run["reference_loss"])
    assert loss > 100 * LOSS and every > 100 * GRADIENT and towers > 100 * GRADIENT


def trainer_reference(kind: str) -> dict:
    from tests.sequence_parallel_vision_run import dpo_trainer, hf_trainer, sft_trainer, trainer_result

    builders = {"hf": lambda: hf_trainer({"task": "causal_lm"}, ranks=2),
                "sft": lambda: sft_trainer({"task": "causal_lm"}, ranks=2),
                "dpo": lambda: dpo_trainer(None, batch_size=4)}
    trainer, keep = builders[kind]()
    trainer.train()
    return trainer_result(trainer, keep)


@pytest.mark.parametrize("kind", ["hf", "sft", "dpo"])
def test_image_text_trainers_under_sequence_parallelism_equal_one_process(launched, kind):
    """HF Trainer and TRL SFTTrainer (one process, padding-free: one micro-batch of both ranks' examples — the trainer
    gives Qwen2.5-VL no token count, so a micro-batch's loss is its mean; SFT with TRL's vision collator and gradient
    checkpointing) and DPO (TRL's own one-process run, padded, of 4 pairs a
    step)."""
    run, want = launched[kind], trainer_reference(kind)
    calls = run["calls"]
    assert any(cut for _, cut in calls["rows"]), "some row of the group must be cut inside an image's tokens"
    assert calls["slices"] == [-(-tokens // 2) for tokens, _ in calls["rows"]] and len(calls["slices"]) >= 2
    assert len(run["losses"]) == len(want["losses"]) == 2
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], want["losses"]))
    margins = max((abs(a - b) for a, b in zip(run["margins"], want["margins"])), default=0.0)
    every, towers = gradient_difference(run["grads"], want["grads"])
    print(f"{kind} sp2: losses {loss:.1e} (relative), margins {margins:.1e}, gradients {every:.1e}, tower "
          f"{towers:.1e}")
    assert loss < LOSS and margins < LOSS and every < GRADIENT and towers < GRADIENT
    if kind == "dpo":
        assert len(run["margins"]) == 2 and run["packed"][-1] >= 2  # every policy call packed


def test_grpo_on_image_text_prompts_under_sequence_parallelism_equals_trls_run(launched):
    """GRPO on Qwen2.5-VL prompts with images, one SGD step on the 2 processes, against TRL's own run (padded) on the
    same per-rank batches: the same sampled completions (asserted), the loss and every gradient (the tower's too)."""
    run, want = launched["grpo"]["sp"], launched["grpo"]["padded"]
    assert run["completions"] == want["completions"] and run["completions"][0]
    calls = run["calls"]
    assert calls["slices"] == [-(-tokens // 2) for tokens, _ in calls["rows"]] and calls["slices"]
    assert run["packed"][-1] >= 1 and want["packed"] == [None]
    loss = max(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(run["losses"], want["losses"]))
    every, towers = gradient_difference(run["grads"], want["grads"])
    print(f"grpo sp2: loss {loss:.1e} (relative), gradients {every:.1e}, tower {towers:.1e}")
    assert len(run["losses"]) == 1 and loss < LOSS and every < GRADIENT and towers < GRADIENT


def test_an_image_text_row_is_joined_and_sliced_with_its_inputs_whole():
    """One process: two ranks' rows with mRoPE positions ``[4, 1, T]`` and media join along the token axis (the media
    in rank order); ``slice_row(..., whole=True)`` pads every input to the group's multiple (positions restarting,
    the pad token never a placeholder's) and cuts only the shifted labels."""
    from padfree_plugins.packing.sequence_parallel import join_rows, slice_row

    def row(tokens: int, images: int, offset: int) -> dict:
        return {"input_ids": torch.arange(tokens)[None] + offset, "labels": torch.arange(tokens)[None] + offset,
                "position_ids": torch.arange(tokens).expand(4, 1, tokens) + 0,
                "cu_seq_lens_q": torch.tensor([0, tokens], dtype=torch.int32), "max_length_q": tokens,
                "pixel_values": torch.full((4 * images, 3), float(offset)),
                "image_grid_thw": torch.tensor([[1, 2, 2]] * images)}

    joined = join_rows([row(5, 1, 100), row(4, 0, 200)])
    assert joined["position_ids"].shape == (4, 1, 9) and joined["pixel_values"].shape == (4, 3)
    assert joined["cu_seq_lens_q"].tolist() == [0, 5, 9] and joined["image_grid_thw"].tolist() == [[1, 2, 2]]
    for rank in (0, 1):
        local = slice_row(joined, rank, 2, pad_token_id=7, whole=True)
        assert local["input_ids"].shape == (1, 10) and int(local["input_ids"][0, -1]) == 7
        assert local["position_ids"].shape == (4, 1, 10) and local["position_ids"][:, 0, -1].tolist() == [0] * 4
        assert local["cu_seq_lens_q"].tolist() == [0, 5, 9, 10] and torch.equal(local["pixel_values"],
                                                                               joined["pixel_values"])
        want = torch.tensor([101, 102, 103, 104, 200, 201, 202, 203, -100, -100])  # shifted over the whole row
        assert torch.equal(local["labels"][0], want[5 * rank:5 * rank + 5])
        assert local["shift_labels"] is local["labels"]
    with pytest.raises(Exception, match=r"multimodal rotary positions \[R, 1, T\] only in an image-text row"):
        slice_row(joined, 0, 2)


# -- refusals (one process: the group of 2 faked; each comes before any collective, the model left unpatched) -------


@pytest.fixture
def fake_group(monkeypatch):
    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))


@pytest.mark.parametrize("family, options, match", [
    ("idefics3", {}, r"idefics3's image pixels \('pixel_values'\) are given with a batch axis.*"
                     r"sequence_parallel.size: 1"),
    ("llava_onevision", {}, r"padded to the micro-batch's largest image.*sequence_parallel.size: 1"),
    ("qwen3_5", {}, r"vision-language family with sequence mixers.*sequence_parallel.size: 1"),
    ("qwen2_5_vl", {"attention": "allgather"}, r"chose all-gather.*image-text rows do not take yet.*ulysses"),
])
def test_what_image_text_rows_under_sequence_parallelism_do_not_take_is_refused(fake_group, family, options, match):
    from tests.vision_trl import model

    net = model(family)
    implementation = net.config.get_text_config()._attn_implementation
    config = {"task": "causal_lm", "sequence_parallel": {"size": 2, **options}}
    with pytest.raises(ConfigError, match=f"sequence_parallel.size: 2.*{match}"):
        assemble(net, config)
    assert patch_of(net) is None and net.config.get_text_config()._attn_implementation == implementation
    assert not any(module._forward_pre_hooks for module in net.modules())


def test_image_text_prompts_are_not_shared_under_sequence_parallelism():
    """``prefix_sharing: on`` for image-text prompts under sequence parallelism is refused with the reason (each
    image-text row is split whole); ``auto`` does not share them."""
    import types

    from padfree_plugins import load_config
    from padfree_plugins.integrations.checks import shares_prefixes

    trainer = types.SimpleNamespace(_is_vision_dataset=True)
    for mode in ("on", "auto"):
        config = load_config({"task": "causal_lm", "prefix_sharing": mode, "sequence_parallel": {"size": 2}})
        assembly = types.SimpleNamespace(config=config, plan=None, model=None)
        if mode == "auto":
            assert not shares_prefixes(trainer, assembly, splits_shared_rows=True)
            continue
        with pytest.raises(ConfigError, match=r"prefix_sharing: on with SimpleNamespace: image-text prompts are not "
                                              r"shared under sequence parallelism yet.*prefix_sharing: auto"):
            shares_prefixes(trainer, assembly, splits_shared_rows=True)
