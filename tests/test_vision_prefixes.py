"""Shared image-text prompts (``prefix_sharing``) in TRL's fused calls, for every vision-language family: the rows of a
DPO pair (or a GRPO / RLOO group) whose prompts are equal in their tokens and in their images hold the prompt once,
its images once — the vision tower encodes each distinct prompt's images once — and every completion continues it
(its positions, Qwen's mRoPE rows too, those of its whole row; Gemma 3's bidirectional image blocks inside the prompt).

* One shared DPO call (4 pairs: prompts with 0, 1, 2 and 1 images) per family gives TRL's padded log-probabilities
  and entropy (1e-5) and gradients, the vision tower's included (1e-4); the tower encodes half the pixel rows of the
  unshared packed call (each pair's images once, not twice).
* Two pairs whose prompts have the same text and placeholders but other images are not shared together.
* With one group's image features given to another (:func:`~padfree_plugins.testing.faults.
  image_features_to_another_group`), the comparison fails.
* GRPO on Qwen2.5-VL and Gemma 3, DPO on Qwen3-VL, 20 steps: TRL's padded run within 1e-4 of each logged value's
  scale, every fused forward packed and sharing its prompts.
"""

from __future__ import annotations

import contextlib

import datasets
import pytest
import torch

from padfree_plugins import ConfigError, accelerate, patch_of
from padfree_plugins.modeling.attention import record_attention_calls
from padfree_plugins.testing.faults import image_features_to_another_group
from padfree_plugins.testing.vision import synthetic_image
from tests import vision_trl
from tests.test_trl_vision_families import CALL_PAIRS, FAMILIES, trainer_for
from tests.vision_trl import fused_call

pytest.importorskip("PIL")
trl = pytest.importorskip("trl")

#: The vision tower of each family's model, by its attribute name.
TOWERS = ("visual", "vision_tower", "vision_model")


def tower_of(model) -> torch.nn.Module:
    """The model's vision tower (the shortest-named module called one of :data:`TOWERS`)."""
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in TOWERS]
    return min(found, key=lambda item: len(item[0]))[1]


@contextlib.contextmanager
def tower_rows(model):
    """The pixel rows (patches, images or tiles) the vision tower is given, per call."""
    rows: list[int] = []

    def count(module, args, kwargs):
        value = args[0] if args else next(v for k, v in kwargs.items() if k in ("pixel_values", "hidden_states"))
        rows.append(int(value.shape[0]))

    handle = tower_of(model).register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def shared_fused_call(trainer, batch, sharing: str = "on", fault=None):
    """``batch``'s fused call through the accelerated trainer: its outputs, gradients, the tower's pixel rows, the
    prompts its packed row shares (per attention call) and the fused calls' counts."""
    acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": sharing})
    head = acceleration.trainer_patch.heads[0]
    faulty = fault(head.collator) if fault is not None else contextlib.nullcontext()
    try:
        with tower_rows(trainer.model) as rows, record_attention_calls() as attention, faulty as swapped:
            got, grads = fused_call(trainer, batch)
    finally:
        acceleration.undo()
    return got, grads, rows, [call.shared_prompts for call in attention], acceleration.trainer_patch.calls, swapped


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_call_with_images_gives_trls_padded_one(family):
    """4 pairs, prompts with 0, 1, 2 and 1 images: one packed call whose row holds each prompt once gives TRL's
    padded log-probabilities and entropy (1e-5) and gradients, the vision tower's too (1e-4); the tower encodes each
    pair's images once (half the pixel rows of the unshared packed call)."""
    trainer = trainer_for(family, datasets.Dataset.from_list([vision_trl.pair(i, p) for i, p in enumerate(CALL_PAIRS)]))
    trainer.aux_loss_enabled = False  # MoE families: the router aux loss, which a shared prompt would change, is off
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])
    want, want_grads = fused_call(trainer, batch)
    whole = shared_fused_call(trainer, batch, "off")
    got, grads, rows, prompts, calls, _ = shared_fused_call(trainer, batch)
    assert (calls.packed, calls.shared, calls.padded) == (1, 1, {}), calls.describe()
    assert prompts and all(count == len(CALL_PAIRS) for count in prompts), prompts
    assert whole[4].shared == 0 and sum(whole[2]) == 2 * sum(rows) > 0, (whole[2], rows)
    print("largest differences:", {key: float((got[key] - want[key]).abs().max()) for key in want},
          "gradients:", max(float((grads[name] - want_grads[name]).abs().max()) for name in want_grads))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
    assert grads.keys() == want_grads.keys() and any(part in name for name in grads for part in TOWERS)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], atol=1e-4, rtol=0, msg=name)


#: Two pairs of one prompt text with images of one size and other pixels, then a pair of the first's images again.
SAME_TEXT = [(0, [synthetic_image(56, 56, seed=1)]), (0, [synthetic_image(56, 56, seed=2)]),
             (0, [synthetic_image(56, 56, seed=1)])]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_prompts_of_one_text_with_other_images_are_not_shared_together(family):
    """Three pairs of one prompt text and placeholders: the first and third with the same image, the second with
    another. The row holds two prompts (not one), the tower encodes two images, and the call gives TRL's padded
    log-probabilities."""
    pairs = [{**vision_trl.pair(index, pictures), "chosen": vision_trl.pair(k, [])["chosen"]}
             for k, (index, pictures) in enumerate(SAME_TEXT)]
    trainer = trainer_for(family, datasets.Dataset.from_list(pairs))
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(pairs))])
    want, _ = fused_call(trainer, batch)
    whole = shared_fused_call(trainer, batch, "off")
    got, _, rows, prompts, calls, _ = shared_fused_call(trainer, batch)
    assert calls.shared == 1 and prompts and all(count == 2 for count in prompts), prompts
    assert sum(whole[2]) == 3 * sum(rows) > 0, (whole[2], rows)  # 6 rows' images, 2 distinct
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_image_features_given_to_another_group_fail_the_comparison(family):
    """With one shared prompt's image features in another group's prompt (same shapes, other pixels), the call still
    packs and shares, and its log-probabilities leave TRL's padded ones by far more than the tolerance."""
    trainer = trainer_for(family, datasets.Dataset.from_list([vision_trl.pair(i, p) for i, p in enumerate(CALL_PAIRS)]))
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])
    want, _ = fused_call(trainer, batch)
    got, _, _, _, calls, swapped = shared_fused_call(trainer, batch, fault=image_features_to_another_group)
    assert swapped == [1] and calls.shared == 1
    assert float((got["log_probs"] - want["log_probs"]).abs().max()) > 1e-3


def test_a_family_that_cannot_share_image_prompts_is_refused_with_its_reason(monkeypatch, caplog):
    """A family whose collator says why its image-text prompts cannot be shared: ``prefix_sharing: on`` is a
    ConfigError at accelerate() naming it, the trainer untouched; ``auto`` packs every row whole and logs why."""
    from padfree_plugins.packing.multimodal import MultimodalPacking

    reason = "its tower mixes a row's images"
    wrap = MultimodalPacking.__call__

    def declaring(self, collator, model_config):
        collator = wrap(self, collator, model_config)
        collator.why_prompts_not_shared = reason
        return collator

    monkeypatch.setattr(MultimodalPacking, "__call__", declaring)
    trainer = trainer_for("qwen2_5_vl", datasets.Dataset.from_list([vision_trl.pair(i, p)
                                                                    for i, p in enumerate(CALL_PAIRS)]))
    forward = vars(trainer.model)["forward"]
    with pytest.raises(ConfigError, match=f"prefix_sharing: on with DPOTrainer: .*qwen2_5_vl.*{reason}"):
        accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
    assert vars(trainer.model)["forward"] == forward and patch_of(trainer.model) is None
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])
    with caplog.at_level("INFO", logger="padfree_plugins"):
        *_, calls, _ = shared_fused_call(trainer, batch, "auto")
    assert (calls.packed, calls.shared) == (1, 0)
    assert any("prompts are not shared for DPOTrainer: image-text prompts of qwen2_5_vl are not shared: " + reason
               in record.getMessage() for record in caplog.records), [r.getMessage() for r in caplog.records]


# -- training runs against TRL's padded ones ------------------------------------------------------------------------

STEPS = 20


def test_grpo_with_shared_image_prompts_trains_the_padded_run_qwen2_5_vl(media_calls):
    grpo_run("qwen2_5_vl", media_calls)


def test_grpo_with_shared_image_prompts_trains_the_padded_run_gemma3(media_calls):
    grpo_run("gemma3", media_calls)


def grpo_run(family: str, media_calls) -> None:
    """``STEPS`` steps of GRPO (4 generations of prompts with 1 or 2 images): the same completions, every logged value
    within 1e-4 of its scale of TRL's padded run, every fused forward packed and sharing its group's prompts."""
    from tests.test_trl_rl import beyond_tolerance, differences
    from tests.test_trl_vision_rl import padded, train

    options = dict(loss_type="grpo", max_steps=STEPS)
    want = padded("grpo", family, **options)
    got = train("grpo", family, True, media_calls, sharing="on", **options)
    assert want.fused_calls > 0 and len(got.packed) == want.fused_calls and all(got.packed), got.packed
    assert got.calls.shared == got.calls.packed == want.fused_calls and not got.calls.padded, got.calls.describe()
    assert got.completions == want.completions, "completions diverged between the padded and the shared run"
    worst = differences(got.history, want.history, count=STEPS)
    print("largest differences (difference, tolerance):", {key: f"{d:.1e}/{t:.1e}" for key, (d, t) in worst.items()})
    assert beyond_tolerance(got, want, count=STEPS) == {}


def test_dpo_with_shared_image_prompts_trains_the_padded_run_qwen3_vl(media_calls, monkeypatch):
    """``STEPS`` steps of sigmoid DPO with a reference model on Qwen3-VL pairs with 0, 1 or 2 images: every logged
    value within 1e-4 of its scale of TRL's padded run, every fused forward (policy and reference) sharing."""
    from tests import test_trl_preference
    from tests.test_trl_preference import differences, trained_reference
    from tests.test_trl_vision_families import preferences

    monkeypatch.setattr(test_trl_preference, "STEPS", STEPS)

    want = trained_reference(trainer_for("qwen3_vl", preferences(), max_steps=STEPS))
    trainer = trainer_for("qwen3_vl", preferences(), max_steps=STEPS)
    acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
    media_calls.clear()
    trainer.train()
    acceleration.undo()
    calls = acceleration.trainer_patch.calls
    assert len(media_calls) == 2 * STEPS and all(media_calls), "a fused forward ran padded"
    assert calls.shared == calls.packed == 2 * STEPS and not calls.padded, calls.describe()
    assert trainer.state.log_history[-2]["padfree/shared_calls"] == 2 * STEPS
    got = trainer.state.log_history
    worst = differences(got, want)
    print("largest relative differences:", {key: f"{value:.1e}" for key, value in worst.items()})
    assert {"loss", "grad_norm"} <= worst.keys() and max(worst.values()) <= 1e-4, worst
    # the accuracies (discontinuous): equal but where rounding could flip a near-tie (all pairs tie at step 1)
    for key, shares in want.flips.items():
        for step, share in enumerate(shares):
            assert abs(got[step][key] - want[step][key]) <= share + 1e-6, (key, step)
    curve = [entry["loss"] for entry in want[:-1]]
    assert max(curve) - min(curve) > 1e-2 * max(map(abs, curve)), "the run did not train: the comparison proves little"


@pytest.fixture
def media_calls(monkeypatch):
    from padfree_plugins.integrations import trl_fused
    from tests.conftest import counted_packings

    return counted_packings(monkeypatch, trl_fused, "pack_media_call")


# -- bidirectional blocks (Gemma 3's images) in a shared row ---------------------------------------------------------


class Attention(torch.nn.Module):
    is_causal = True


def blocks_attention(block_columns: slice):
    """A prompt of 5 tokens, completions of 3 and 2: the shared row's attention (exact backend) with a bidirectional
    block at ``block_columns`` of the shared row, and what each whole row (prompt + completion, the block in every
    row) gives at the shared row's tokens."""
    from padfree_plugins.builtin.backends import EXACT_FEATURES, SHARED_FEATURES
    from padfree_plugins.contract.declarations import AttentionBackend
    from padfree_plugins.modeling.attention import PadfreeAttention
    from padfree_plugins.modeling.attention.backends import exact_varlen
    from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, SharedPrefixes

    exact = AttentionBackend("exact", exact_varlen, features=EXACT_FEATURES | SHARED_FEATURES)
    torch.manual_seed(0)
    lengths, heads, dim = [5, 3, 2], 2, 8
    q, k, v = (torch.randn(1, heads, sum(lengths), dim, dtype=torch.float64) for _ in range(3))
    blocks = torch.full((1, sum(lengths)), -1)
    blocks[0, block_columns] = 0
    cu = torch.tensor([0, 5, 8, 10], dtype=torch.int32)
    got, _ = PadfreeAttention(exact)(Attention(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=5,
                                     block_sequence_ids=blocks,
                                     **{SHARED_PREFIXES_KEY: SharedPrefixes.build(lengths, [-1, 0, 0])})
    whole = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 8, 9])  # prompt + first, prompt + second
    whole_blocks = blocks[0, whole].clone()
    whole_blocks[8:][whole_blocks[8:] >= 0] = 1  # the second row's block numbered apart
    qw, kw, vw = (t[0].transpose(0, 1).index_select(0, whole) for t in (q, k, v))
    want = exact_varlen(qw, kw, vw, torch.tensor([0, 8, 15], dtype=torch.int32),
                        torch.tensor([0, 8, 15], dtype=torch.int32), 8, 8, causal=True, blocks=whole_blocks)
    return got[0], want.index_select(0, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 13, 14]))


def test_bidirectional_blocks_inside_a_prompt_are_shared_exactly():
    """An image block inside the prompt: each token of the shared row gets what it gets in its whole row."""
    got, want = blocks_attention(slice(1, 4))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_a_bidirectional_block_in_a_completion_is_refused():
    """A block in a completion of a shared row (an image after the prompt) is a BoundaryError that says so."""
    from padfree_plugins import BoundaryError

    with pytest.raises(BoundaryError, match="a completion of a shared row holds a bidirectional block"):
        blocks_attention(slice(6, 8))


def test_roots_and_children_split_a_shared_row():
    """Two prompts (one kept whole between them): the roots are the segments without a parent, each child's keys its
    prompt's tokens then its own, and ``order`` puts the two parts back in packed order."""
    from padfree_plugins.packing.prefixes import SharedPrefixes

    split = SharedPrefixes.build([3, 2, 1, 4, 2, 2], [-1, 0, 0, -1, -1, 4]).roots
    assert split.roots.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11] and split.roots_cu.tolist() == [0, 3, 7, 9]
    assert split.children.tolist() == [3, 4, 5, 12, 13] and split.children_cu_q.tolist() == [0, 2, 3, 5]
    assert split.children_keys.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 10, 11, 12, 13]
    assert split.children_cu_k.tolist() == [0, 5, 9, 13] and (split.children_max_q, split.children_max_k) == (2, 5)
    assert torch.cat([split.roots, split.children]).index_select(0, split.order).tolist() == list(range(14))
