"""Image-text rows under sequence parallelism (``sequence_parallel: {size: 2}``) on 2 CPU processes (gloo; the worker
is tests/sequence_parallel_vision_run.py, every case in one torchrun launch with a timeout).

Each rank loads its own image-text micro-batch; the group joins them into one row (the media with them, in rank
order) and the model embeds the whole row on every rank; each rank's vision tower encodes only its own micro-batch's
images (asserted; the idle image on a rank without any) and the features are all-gathered in rank order
(``TowerShare``), merged into the whole row; its language model then takes this rank's half (``SliceRow``). In every
case the group's row is cut inside an image's tokens (asserted), and every result equals one process on the same
examples: losses to 1e-5 (relative), gradients — the vision tower's included — to 1e-4:

* ``assembly.forward`` + backward on Qwen2.5-VL (mRoPE ``[4, 1, T]`` positions; also with one rank's micro-batch
  without images, which sends no pixels, and with all-gather attention), Qwen3-VL with images on one rank and a video
  on the other, Qwen2-VL, Gemma 3 (the cut image's tokens
  attend to each other both ways across the two slices), Qwen3-VL (also all-gather) and Qwen3-VL-MoE (deepstack
  features per visual token), Qwen3.5 and Qwen3.5-MoE (hybrid language models: the gated delta rule split, rank 1's
  piece of the cut example starting from rank 0's state; Qwen3.5 also gathered, ``mixers: gather``);
* HF ``Trainer`` on Qwen2.5-VL processor rows and TRL ``SFTTrainer`` on conversational rows with images (TRL's
  vision collator, gradient checkpointing), 2 SGD steps each (logged losses, first step's gradients after DDP);
* TRL ``DPOTrainer`` on Qwen2.5-VL image-text pairs (the fused log-probability path), 2 SGD steps, against TRL's own
  one-process run (padded) of the same global batches (losses, reward margins, first step's gradients);
* TRL ``GRPOTrainer`` on Qwen2.5-VL prompts with images, one SGD step, against TRL's own run on the same 2 processes
  (the same sampled completions), its prompts unshared and shared; ``RLOOTrainer`` (shared) and ``KTOTrainer`` (its
  KL term) the same.

Shared image-text prompts (``prefix_sharing: on``): each rank's fused call holds each prompt once, its images once;
the group joins the rows, their prompt structure (segment parents offset) and their media into one shared row, the
model embeds it whole on every rank (each rank's tower encodes its own prompts' images once) and the language model
takes this rank's slice; attention applies the joined row's structure after Ulysses' all-to-all. GRPO (Qwen2.5-VL: a
completion on rank 1 whose prompt starts on rank 0, the cut inside that prompt's first image, the tower given a
quarter of the unshared call's pixel rows) and DPO (Qwen2.5-VL: the cut inside an image; Gemma 3: its images'
bidirectional blocks inside the prompts) equal TRL's runs, every fused call shared (the plugin's counters).

The deliberate faults ``image_features_sliced_off_by_one`` (a later rank's merged embeddings cut one token early),
``parent_keys_not_exchanged`` (shared GRPO: the keys and values of a completion's prompt on the other rank left out)
``mixer_scans_only_its_slice`` (Qwen3.5: rank 1's mixers start from zeros) and ``tower_gradients_not_summed`` (the
gathered features' gradient not summed over the group: the tower's gradients) are far off. What image-text rows
under sequence parallelism do not take is refused in one process (the group faked), before anything changes.
"""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import ConfigError, assemble, patch_of
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from tests.distributed_common import OUT, launch_shared

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

LOSS = 1e-5
GRADIENT = 1e-4
FORWARDS = ("qwen2_5_vl", "qwen2_vl", "gemma3", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
            "qwen3_5-gather", "qwen2_5_vl-text-rank",
            "qwen2_5_vl-allgather", "qwen3_vl-allgather")
TOWERS = ("visual", "vision_tower", "multi_modal_projector")


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """Every case of the worker, in one 2-process launch (once per session)."""
    from tests.sequence_parallel_vision_run import CASES

    return launch_shared(request, tmp_path_factory, "sequence_parallel_vision_run.py", OUT, *CASES, timeout=240)


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
    assert run["attention"] == ("AllGatherAttention" if family.endswith("allgather") else "UlyssesAttention")
    assert run["cut"], "the group's row must be cut inside an image's tokens"
    # the gated delta rule split (its state handed on), or run on the whole row (mixers: gather)
    assert (run["split"] > 0) == (family.startswith("qwen3_5") and not family.endswith("gather"))
    assert (run["whole"] > 0) == (family == "qwen3_5-gather")
    assert run["seen"] == [run["slice"]] and run["slice"] * 2 >= run["row"]  # the language model got a half
    # each rank's tower encoded its own micro-batch's pixel rows (Gemma 3: images) once, a rank without images the
    # idle image (Qwen: one merged cell of 4 pixel rows)
    idle = 1 if family == "gemma3" else 4
    assert run["tower"] == [[own or idle] for own in run["own"]] and run["own"][0] > 0, (run["tower"], run["own"])
    assert run["pixels_kept"] == [True, True]  # the other rank's pixels are never sent, only the features
    every, towers = gradient_difference(run["grads"], run["reference_grads"])
    loss = abs(run["loss"] - run["reference_loss"]) / abs(run["reference_loss"])
    print(f"{family} sp2: loss {loss:.1e} (relative), gradients {every:.1e}, tower {towers:.1e}")
    assert loss < LOSS and every < GRADIENT and towers < GRADIENT


def test_images_on_one_rank_and_a_video_on_the_other_equal_one_process(launched):
    """Qwen3-VL (deepstack features), rank 0's micro-batch with images and no video, rank 1's with a video and no image:
    each rank's tower encodes its own media and the idle image for the kind it lacks (rank 0: its images' 36 pixel
    rows, then 4 for the video call; rank 1: 4, then its video's 16), the video's features gathered through
    ``get_video_features`` (which calls ``get_image_features`` itself). Loss and gradients, the tower's too, equal one
    process."""
    run = launched["forward-qwen3_vl-video"]
    assert run["tower"] == [[36, 4], [4, 16]] and run["own"] == [36, 0] and run["pixels_kept"] == [True, True]
    every, towers = gradient_difference(run["grads"], run["reference_grads"])
    loss = abs(run["loss"] - run["reference_loss"]) / abs(run["reference_loss"])
    print(f"qwen3_vl video sp2: loss {loss:.1e} (relative), gradients {every:.1e}, tower {towers:.1e}")
    assert loss < LOSS and every < GRADIENT and towers < GRADIENT


def test_image_features_sliced_off_by_one_are_far_off(launched):
    """The fault: the later rank's slice of the merged embeddings one token early (its positions right)."""
    run = launched["forward-qwen2_5_vl-fault"]
    every, towers = gradient_difference(run["grads"], run["reference_grads"])
    loss = abs(run["loss"] - run["reference_loss"]) / abs(run["reference_loss"])
    assert loss > 100 * LOSS and every > 100 * GRADIENT and towers > 100 * GRADIENT


def test_image_features_whose_gradient_is_not_summed_over_the_group_are_far_off(launched):
    """The fault ``tower_gradients_not_summed``: the backward of the gathered image features hands each rank's tower
    only its own slice's gradient of its images' features. The forward is right; the tower's gradients are far off
    (an image whose tokens the other rank's slice holds, or that the cut splits, loses that rank's part)."""
    run = launched["forward-qwen2_5_vl-unsummed"]
    every, towers = gradient_difference(run["grads"], run["reference_grads"])
    loss = abs(run["loss"] - run["reference_loss"]) / abs(run["reference_loss"])
    assert loss < LOSS and towers > 100 * GRADIENT


def test_a_hybrid_image_text_row_whose_mixers_start_from_zeros_after_the_cut_is_far_off(launched):
    """The fault ``mixer_scans_only_its_slice`` on Qwen3.5: rank 1's piece of the example cut inside its image starts
    its gated delta rule and short convolution from zeros, not from rank 0's state: the gradients leave one
    process's by far more than the tolerance."""
    run = launched["forward-qwen3_5-zero-state"]
    assert run["cut"] and run["split"] > 0
    every, _ = gradient_difference(run["grads"], run["reference_grads"])
    assert every > 10 * GRADIENT


def trainer_reference(kind: str) -> dict:
    from tests.sequence_parallel_vision_run import dpo_trainer, hf_trainer, sft_trainer, trainer_result

    builders = {"hf": lambda: hf_trainer({"task": "causal_lm"}, ranks=2),
                "sft": lambda: sft_trainer({"task": "causal_lm"}, ranks=2),
                "dpo": lambda: dpo_trainer(None, batch_size=4),
                "dpo-shared": lambda: dpo_trainer(None, batch_size=4),
                "dpo-shared-gemma3": lambda: dpo_trainer(None, batch_size=4, family="gemma3"),
                "dpo-shared-qwen3_5": lambda: dpo_trainer(None, batch_size=4, family="qwen3_5")}
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


def shared_calls_differ(run: dict, want: dict) -> tuple[float, float, float, float]:
    """Largest loss (relative), DPO reward margin, gradient and tower-gradient differences of two trainer runs."""
    loss = max(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(run["losses"], want["losses"]))
    margins = max((abs(a - b) for a, b in zip(run["margins"], want["margins"])), default=0.0)
    return loss, margins, *gradient_difference(run["grads"], want["grads"])


def assert_every_call_shared(run: dict, prompts: int, children: int) -> None:
    """Every fused call of the run packed and shared (the plugin's counters), and every packed row this rank's model
    got one shared row of ``prompts`` prompts (both ranks' own) of ``children`` completions each, a completion's last
    token in another rank's slice than its prompt's first, its language model given half of it."""
    calls = run["calls"]
    assert run["packed"][-1] >= 2 and run["shared"] == run["packed"], (run["packed"], run["shared"])
    assert calls["shared"] and len(calls["shared"]) == len(calls["rows"]) == len(calls["slices"])
    for held, crossing, parents, _ in calls["shared"]:
        assert held == prompts and crossing
        assert sorted(parents.count(parent) for parent in set(parents) if parent >= 0) == [children] * prompts
    assert calls["slices"] == [-(-tokens // 2) for tokens, _ in calls["rows"]]


@pytest.mark.parametrize("mode", ["shared", "allgather"])
def test_grpo_with_shared_image_text_prompts_under_sequence_parallelism_equals_trls_run(launched, mode):
    """GRPO on Qwen2.5-VL prompts with images, ``prefix_sharing: on``, one SGD step on the 2 processes, against TRL's
    run (padded) on the same per-rank batches: the same completions, the loss and every gradient (the tower's too).
    Each rank's 4 completions share its prompt, and the joined row holds both prompts once: rank 1's prompt starts
    in rank 0's slice and the cut falls inside its first image, its completions in rank 1's; the tower encodes each
    prompt's images once (a quarter of the unshared row's pixel rows), the row is under half the unshared one's.
    Ulysses attention (``shared``) or all-gather (``allgather``: each rank's queries against their segments' keys of
    the gathered row)."""
    run, unshared, want = (launched["grpo"][name] for name in (mode, "sp", "padded"))
    assert run["attention"] == ("AllGatherAttention" if mode == "allgather" else "UlyssesAttention")
    assert run["completions"] == want["completions"] and run["completions"][0]
    assert_every_call_shared(run, prompts=2, children=4)
    calls = run["calls"]
    assert all(cut for _, cut in calls["rows"]), "the cut must fall inside an image's tokens"
    bounds, cut = calls["shared"][0][3], calls["rows"][0][0] // 2
    assert calls["shared"][0][2][5] == -1 and bounds[5] < cut < bounds[6]  # inside rank 1's prompt (segment 5)
    assert [4 * rows for rows in calls["tower"]] == unshared["calls"]["tower"] and calls["tower"][0] > 0
    assert 2 * calls["rows"][0][0] < unshared["calls"]["rows"][0][0]
    loss, _, every, towers = shared_calls_differ(run, want)
    print(f"grpo sp2 {mode}: loss {loss:.1e} (relative), gradients {every:.1e}, tower {towers:.1e}")
    assert len(run["losses"]) == 1 and loss < LOSS and every < GRADIENT and towers < GRADIENT


@pytest.mark.parametrize("kind", ["rloo", "kto"])
def test_rloo_and_kto_on_images_under_sequence_parallelism_equal_trls_run(launched, kind):
    """RLOO (GRPO's prompts, ``prefix_sharing: on``: every call shared, the cut inside rank 1's prompt's image) and KTO
    with its KL term (``prefix_sharing: on``, which its rows, each prompt once, give nothing to share: every call
    packed and split, none shared), one SGD step on the 2 processes, against TRL's own run on them: the loss and
    every gradient, the tower's too."""
    run, want = launched[kind]["shared"], launched[kind]["padded"]
    calls = run["calls"]
    assert calls["slices"] == [-(-tokens // 2) for tokens, _ in calls["rows"]] and len(calls["slices"]) >= 2
    if kind == "rloo":
        assert run["completions"] == want["completions"] and run["completions"][0]
        assert_every_call_shared(run, prompts=2, children=4)
        assert all(cut for _, cut in calls["rows"]), "the cut must fall inside an image's tokens"
    else:
        assert run["packed"][-1] >= 2 and run["shared"] == [0] and want["packed"] == [None]
    loss, _, every, towers = shared_calls_differ(run, want)
    print(f"{kind} sp2: loss {loss:.1e} (relative), gradients {every:.1e}, tower {towers:.1e}")
    assert len(run["losses"]) == 1 and loss < LOSS and every < GRADIENT and towers < GRADIENT


def test_shared_image_text_prompt_keys_not_exchanged_are_far_off(launched):
    """The fault: rank 1's completions do not see their prompt's keys and values that lie in rank 0's slice (the
    shared structure applied to each slice alone). The run still shares, and its gradients are far off."""
    run, want = launched["grpo"]["no-exchange"], launched["grpo"]["padded"]
    assert_every_call_shared(run, prompts=2, children=4)
    _, _, every, towers = shared_calls_differ(run, want)
    assert every > 100 * GRADIENT and towers > 100 * GRADIENT


@pytest.mark.parametrize("kind", ["dpo-shared", "dpo-shared-gemma3", "dpo-shared-qwen3_5"])
def test_dpo_with_shared_image_text_prompts_under_sequence_parallelism_equals_one_process(launched, kind):
    """DPO with ``prefix_sharing: on`` (2 pairs a rank, each pair's prompt and image held once) against TRL's own
    one-process run (padded, 4 pairs a step): losses, reward margins, first step's gradients (the tower's too); every
    fused call shared, a completion across the cut from its prompt. Qwen2.5-VL: the cut inside an image, and the tower
    given half the unshared run's pixel rows; Gemma 3: each prompt's image a bidirectional block, attended after
    Ulysses' all-to-all on the whole row (each rank's tower given its own 2 pairs' images once each); Qwen3.5 (a hybrid
    language model): the cut inside an image, its gated delta rule split across the ranks, each completion starting
    from its prompt's state, handed on from the rank where the prompt ended."""
    run, want = launched[kind], trainer_reference(kind)
    assert_every_call_shared(run, prompts=4, children=2)
    calls = run["calls"]
    assert (run["split"] > 0) == kind.endswith("qwen3_5")  # Qwen3.5's gated delta rule split across the ranks
    if kind == "dpo-shared-gemma3":
        assert calls["tower"] == [2, 2]  # one image a pair, held once; rank 0's own pairs only
    else:
        assert all(cut for _, cut in calls["rows"]), "the cut must fall inside an image's tokens"
    if kind == "dpo-shared":
        assert [2 * rows for rows in calls["tower"]] == launched["dpo"]["calls"]["tower"] and calls["tower"][0] > 0
    assert len(run["losses"]) == len(want["losses"]) == 2 and len(run["margins"]) == 2
    loss, margins, every, towers = shared_calls_differ(run, want)
    print(f"{kind} sp2: losses {loss:.1e} (relative), margins {margins:.1e}, gradients {every:.1e}, tower "
          f"{towers:.1e}")
    assert loss < LOSS and margins < LOSS and every < GRADIENT and towers < GRADIENT


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


def test_shared_image_text_rows_join_into_one_shared_row():
    """One process: two ranks' shared image-text rows (a prompt with images, then two completions whose positions, the
    mRoPE rows ``[4, 1, T]`` too, continue it) join as text shared rows do: the second row's segment parents offset by
    the first's segments, the rotary rows along their token axis, each rank's media once, in rank order. Every slice
    (``whole=True``) carries the joined row's structure — that of :class:`SharedPrefixes` built over the joined
    segments, the padding segment a root: parents, ``key_index``, ``cu_seq_lens_k`` — with its inputs whole and only
    its shifted labels cut."""
    from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, SharedPrefixes
    from padfree_plugins.packing.sequence_parallel import SEGMENT_PARENTS_KEY, join_rows, segment_parents, slice_row

    def row(sizes: list[int], offset: int, images: int) -> dict:
        positions = torch.cat([torch.arange(sizes[0]), *(torch.arange(sizes[0], sizes[0] + n) for n in sizes[1:])])
        bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
        tokens = sum(sizes)
        built = {"input_ids": torch.arange(tokens)[None] + offset, "labels": torch.arange(tokens)[None] + offset,
                 "position_ids": positions.expand(4, 1, tokens) + torch.tensor([0, 0, 1, 2])[:, None, None],
                 "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(sizes),
                 "max_length_k": max(sizes), "pixel_values": torch.full((4 * images, 3), float(offset)),
                 "image_grid_thw": torch.tensor([[1, 2, 2]] * images),
                 SHARED_PREFIXES_KEY: SharedPrefixes.build(sizes, [-1, 0, 0])}
        built[SEGMENT_PARENTS_KEY] = segment_parents(built)
        del built[SHARED_PREFIXES_KEY]
        return built

    first, second = row([6, 3, 2], 100, 1), row([5, 2, 3], 200, 2)
    joined = join_rows([first, second])
    assert joined[SEGMENT_PARENTS_KEY].tolist() == [-1, 0, 0, -1, 3, 3]
    assert joined["position_ids"].shape == (4, 1, 21) and joined["image_grid_thw"].tolist() == [[1, 2, 2]] * 3
    assert joined["pixel_values"][:4].eq(100).all() and joined["pixel_values"][4:].eq(200).all()
    want = SharedPrefixes.build([6, 3, 2, 5, 2, 3, 1], [-1, 0, 0, -1, 3, 3, -1])
    shifted = torch.cat([joined["labels"][0, 1:], torch.tensor([-100, -100])])
    for rank in (0, 1):
        local = slice_row(joined, rank, 2, pad_token_id=7, whole=True)
        got = local[SHARED_PREFIXES_KEY]
        assert SEGMENT_PARENTS_KEY not in local and got.parents == want.parents
        assert torch.equal(got.key_index, want.key_index) and torch.equal(got.cu_seq_lens_k, want.cu_seq_lens_k)
        assert torch.equal(local["position_ids"][..., :21], joined["position_ids"])
        assert local["position_ids"][:, 0, 21].tolist() == [0, 0, 1, 2]  # the padding segment: the row's first
        assert torch.equal(local["input_ids"][0, :21], joined["input_ids"][0])
        assert torch.equal(local["pixel_values"], joined["pixel_values"])
        assert torch.equal(local["labels"][0], shifted[11 * rank:11 * rank + 11])


# -- refusals (one process: the group of 2 faked; each comes before any collective, the model left unpatched) -------


@pytest.fixture
def fake_group(monkeypatch):
    monkeypatch.setattr("padfree_plugins.assembly.sequence_group", lambda size: SequenceGroup(None, 0, size))


@pytest.mark.parametrize("family, options, match", [
    ("idefics3", {}, r"idefics3's image pixels \('pixel_values'\) are given with a batch axis.*"
                     r"sequence_parallel.size: 1"),
    ("llava_onevision", {}, r"padded to the micro-batch's largest image.*sequence_parallel.size: 1"),
    ("gemma3", {"attention": "allgather"}, r"chose all-gather.*bidirectional image blocks.*ulysses"),
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


def test_each_rank_runs_the_tower_on_its_own_media_or_says_why_not(fake_group, monkeypatch):
    """One process (the group of 2 faked): under sequence parallelism the base model's ``get_image_features`` and
    ``get_video_features`` become :class:`TowerShare` s (each rank's own media, the features gathered), which
    ``generate()`` still reads the inputs of (their signature is the original's), and come off with the patch. A
    family that cannot (here: no idle image for a rank without images) keeps the whole tower on every rank, with a
    warning that says why."""
    import inspect

    from padfree_plugins.modeling import tower_share
    from tests.vision_trl import model

    net = model("qwen2_5_vl")
    base = net.base_model
    want = inspect.signature(base.get_image_features)
    assemble(net, {"task": "causal_lm", "sequence_parallel": {"size": 2}})
    for name in tower_share.FEATURE_METHODS:
        assert isinstance(base.__dict__[name], tower_share.TowerShare)
    assert inspect.signature(base.get_image_features) == want
    patch_of(net).undo()
    assert not any(name in base.__dict__ for name in tower_share.FEATURE_METHODS)

    monkeypatch.setattr(tower_share, "idle_image_of", lambda handles: None)
    with pytest.warns(UserWarning, match=r"every rank runs the vision tower on all the images of its group's row.*"
                                         r"no idle image"):
        assemble(net, {"task": "causal_lm", "sequence_parallel": {"size": 2}})
    assert not any(name in base.__dict__ for name in tower_share.FEATURE_METHODS)
    assert patch_of(net) is not None
