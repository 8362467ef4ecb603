"""Vision-language models padding-free (Qwen2-VL, Qwen2.5-VL): image-text examples packed into one row — each
example's image tokens with its own pixels, its mRoPE positions computed as if it ran alone — give each example's
logits run alone (with its own images) within 1e-5 and the gradients within 1e-4; a swap of two examples' images or
positions is caught; bad inputs are clear errors before the model runs; the vision tower never sees the packed
row's boundaries."""

from __future__ import annotations

import copy

import pytest
import torch

from padfree_plugins import BatchError, assemble
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.testing.vision import (
    FAMILIES,
    image_text_example,
    image_text_processor,
    synthetic_image,
    synthetic_video_example,
    tiny_vision_language_model,
)

pytest.importorskip("PIL")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    processor = image_text_processor(request.param)
    return request.param, processor, tiny_vision_language_model(request.param, processor)


def mixed_examples(processor, model_config) -> list[dict]:
    """0, 1 and 3 images per example, images of different sizes (two of the same size), and a video."""
    return [
        image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)]),
        image_text_example(processor, "no image here at all, only words"),
        image_text_example(processor, "three <image> images <image> here <image> ok",
                           [synthetic_image(40, 40, 1), synthetic_image(80, 50, 2), synthetic_image(40, 40, 3)]),
        image_text_example(processor, "x"),
        synthetic_video_example(processor, model_config, "a video <image> and its words"),
        image_text_example(processor, "<image>", [synthetic_image(60, 90, 4)]),
    ]


def token_types(model, input_ids: torch.Tensor) -> torch.Tensor:
    types = torch.zeros_like(input_ids)
    types[input_ids == model.config.image_token_id] = 1
    types[input_ids == model.config.video_token_id] = 2
    return types


def run_alone(model, example: dict):
    """``example`` run alone by the unpatched model, with its own images, its positions the model's own."""
    ids = torch.tensor([example["input_ids"]])
    media = {key: value for key, value in example.items() if key != "input_ids"}
    return model(input_ids=ids, mm_token_type_ids=token_types(model, ids), **media)


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed_and_alone(model, examples, config=None):
    """Logits and gradients of the packed batch (sum of each example's logits · a fixed random weight) and of each
    example alone (the same loss, summed over examples)."""
    reference = copy.deepcopy(model).train()
    packed = copy.deepcopy(model).train()
    assembly = assemble(packed, config or {"task": "causal_lm"})
    batch = assembly.collator(examples)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(packed.config.text_config.vocab_size, generator=generator)
    logits = assembly.forward(packed, batch).logits[0]
    (logits @ weight).sum().backward()
    alone = []
    for example in examples:
        out = run_alone(reference, example).logits[0]
        (out @ weight).sum().backward()
        alone.append(out.detach())
    return logits.detach(), batch, alone, gradients(packed), gradients(reference), assembly


def test_packed_image_text_equals_each_example_alone(family):
    name, processor, model = family
    examples = mixed_examples(processor, model.config)
    logits, batch, alone, got, want, assembly = packed_and_alone(model, examples)
    assert batch["position_ids"].shape == (4, 1, logits.shape[0])
    cu = batch["cu_seq_lens_q"].tolist()
    for index, reference in enumerate(alone):
        torch.testing.assert_close(logits[cu[index]:cu[index + 1]], reference, atol=1e-5, rtol=1e-5,
                                   msg=f"example {index}")
    assert got.keys() == want.keys() and any("visual" in key for key in got)
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)
    assembly.undo()


def test_a_text_only_batch_equals_each_example_alone(family):
    name, processor, model = family
    examples = [image_text_example(processor, text) for text in ("one two", "a longer text of words", "x")]
    logits, batch, alone, *_ = packed_and_alone(model, examples)
    assert "pixel_values" not in batch
    cu = batch["cu_seq_lens_q"].tolist()
    for index, reference in enumerate(alone):
        torch.testing.assert_close(logits[cu[index]:cu[index + 1]], reference, atol=1e-5, rtol=1e-5)


def test_a_placeholder_of_an_absent_media_typed_text_is_text(family):
    """Video placeholders in examples without video (one with an image, one text only), typed text by the examples' own
    ``mm_token_type_ids`` — tokens a model generated in a completion: packed as text, each example equal to the model
    run on it alone with those types; without the types, refused as placeholders without their video."""
    name, processor, model = family
    video = model.config.video_token_id
    examples = []
    for base in (image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)]),
                 image_text_example(processor, "no image here, only words")):
        ids = torch.tensor([*base["input_ids"], video, int(base["input_ids"][-1]), video])
        types = token_types(model, ids).masked_fill(ids == video, 0)
        examples.append({**base, "input_ids": ids.tolist(), "mm_token_type_ids": types.tolist()})
    reference, packed = copy.deepcopy(model), copy.deepcopy(model)
    assembly = assemble(packed, {"task": "causal_lm"})
    batch = assembly.collator(examples)
    logits = assembly.forward(packed, batch).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    for index, example in enumerate(examples):
        media = {key: value for key, value in example.items() if key not in ("input_ids", "mm_token_type_ids")}
        alone = reference(input_ids=torch.tensor([example["input_ids"]]),
                          mm_token_type_ids=torch.tensor([example["mm_token_type_ids"]]), **media).logits[0]
        torch.testing.assert_close(logits[cu[index]:cu[index + 1]], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(BatchError, match="video tokens but no"):
        assembly.collator([{key: value for key, value in examples[0].items() if key != "mm_token_type_ids"}])
    assembly.undo()


def assert_examples_match(logits, batch, alone) -> None:
    cu = batch["cu_seq_lens_q"].tolist()
    for index, reference in enumerate(alone):
        torch.testing.assert_close(logits[cu[index]:cu[index + 1]], reference, atol=1e-5, rtol=1e-5)


def test_swapped_images_or_positions_are_caught(family):
    """The comparison above fails when two examples' images (of the same size) trade places in the packed pixels,
    and when the image tokens get the text positions (one row for all three rotary axes, the packing bug of peers)
    instead of their grid's: it would catch a misaligned pack. (Rotary rows that run on across examples by a constant
    are no bug: attention stays inside each example, where a uniform shift cancels out.)"""
    name, processor, model = family
    examples = mixed_examples(processor, model.config)
    packed = copy.deepcopy(model)
    assembly = assemble(packed, {"task": "causal_lm"})
    batch = assembly.collator(examples)
    with torch.no_grad():
        alone = [run_alone(model, example).logits[0] for example in examples]
        assert_examples_match(assembly.forward(packed, batch).logits[0], batch, alone)
        rows = [int(grid.prod()) for grid in batch["image_grid_thw"]]  # images: 60x90, 40x40, 80x50, 40x40, 60x90
        starts = [sum(rows[:i]) for i in range(len(rows))]
        swapped = PackedBatch(batch)
        swapped.model_keys = batch.model_keys
        pixels = batch["pixel_values"].clone()
        first, last = slice(starts[0], starts[0] + rows[0]), slice(starts[4], starts[4] + rows[4])
        pixels[first], pixels[last] = batch["pixel_values"][last], batch["pixel_values"][first]
        swapped["pixel_values"] = pixels
        with pytest.raises(AssertionError):
            assert_examples_match(assembly.forward(packed, swapped).logits[0], swapped, alone)
        flat = PackedBatch(batch)
        flat.model_keys = batch.model_keys
        flat["position_ids"] = batch["position_ids"][:1].expand(4, 1, -1).clone()
        with pytest.raises(AssertionError):
            assert_examples_match(assembly.forward(packed, flat).logits[0], flat, alone)
    assembly.undo()


def test_the_vision_tower_keeps_its_own_attention_and_never_sees_the_boundaries(family):
    name, processor, model = family
    packed = copy.deepcopy(model)
    assembly = assemble(packed, {"task": "causal_lm"})
    assert packed.model.visual.config._attn_implementation == "sdpa"
    assert packed.config.text_config._attn_implementation == assembly.patch.implementation
    seen = []
    hook = packed.model.visual.blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    with torch.no_grad():
        assembly.forward(packed, assembly.collator(mixed_examples(processor, model.config)[:3]))
    hook.remove()
    assert seen and not any(key.startswith(("cu_seq_lens", "max_length", "seq_idx")) for keys in seen for key in keys)
    assembly.undo()
    assert packed.config.text_config._attn_implementation == "sdpa" and not packed.model.visual._forward_pre_hooks


def test_labels_from_input_ids_leave_image_tokens_unlabelled(family):
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    batch = assembly.collator(mixed_examples(processor, model.config)[:3])
    image = batch["input_ids"] == model.config.image_token_id
    assert image.any() and (batch["labels"][image] == -100).all()
    text = ~image
    text[0, batch["cu_seq_lens_q"][:-1].long()] = False  # each example's first label is -100 anyway
    assert (batch["labels"][text] == batch["input_ids"][text]).all()
    assembly.undo()


def test_media_batch_is_the_collators_media_without_the_text(family):
    """``media_batch`` (a shared row's prompts' media) gives the media keys the collator packs for the same examples,
    checked as the collator checks them."""
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    examples = mixed_examples(processor, model.config)
    media, batch = assembly.collator.media_batch(examples), assembly.collator(examples)
    assert set(media) == {key for key in assembly.collator.media_keys if key in batch} and media
    for key, value in media.items():
        assert torch.equal(value, batch[key]), key
    good = examples[0]
    with pytest.raises(BatchError, match="rows but its image_grid_thw"):
        assembly.collator.media_batch([{**good, "pixel_values": good["pixel_values"][:-4]}])
    assembly.undo()


def test_bad_multimodal_inputs_are_clear_errors(family):
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    good = image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)])
    short = {**good, "input_ids": [token for i, token in enumerate(good["input_ids"])
                                   if not (token == model.config.image_token_id and i % 2)]}
    with pytest.raises(BatchError, match="example 1 has .* image tokens but its 1 image.* make"):
        assembly.collator([good, short])
    with pytest.raises(BatchError, match="example 0 has 'pixel_values' but no 'image_grid_thw'"):
        assembly.collator([{key: value for key, value in good.items() if key != "image_grid_thw"}])
    with pytest.raises(BatchError, match="image tokens but no 'pixel_values'"):
        assembly.collator([{"input_ids": good["input_ids"]}])
    with pytest.raises(BatchError, match="rows but its image_grid_thw"):
        assembly.collator([{**good, "pixel_values": good["pixel_values"][:-4]}])
    assembly.undo()


def test_a_truncated_image_example_is_refused(family):
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm", "max_length": 8, "on_overlong": "truncate"})
    with pytest.raises(BatchError, match="truncating it would cut placeholders from their pixels"):
        assembly.collator([image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90)])])
    assembly.undo()


def test_images_for_a_text_only_family_are_refused():
    from tests.conftest import tiny_model

    assembly = assemble(tiny_model("llama", "causal_lm"), {"task": "causal_lm"})
    with pytest.raises(BatchError, match="'pixel_values', 'image_grid_thw' \\(images or video\\), but this model's "
                                         "plugin packs text only"):
        assembly.collator([{"input_ids": [5, 6, 7], "pixel_values": torch.zeros(4, 8),
                            "image_grid_thw": torch.tensor([[1, 2, 2]])}])
    assembly.undo()


def test_image_tokens_split_or_out_of_order_are_refused(family):
    """Every image's tokens one run of its own length, in the order of its pixels: a run split by a text token, or
    two images whose grids come in the other order than their tokens, is an error (the model would fill the
    placeholders with the wrong pixels)."""
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    two = image_text_example(processor, "a <image> b <image> c",
                             [synthetic_image(28, 56, 0), synthetic_image(84, 84, 1)])
    ids = list(two["input_ids"])
    first = ids.index(model.config.image_token_id)
    split = {**two, "input_ids": ids[:first + 1] + [ids[0]] + ids[first + 1:]}
    with pytest.raises(BatchError, match=r"its image tokens run \[1, \d+, \d+\] but its images make"):
        assembly.collator([split])
    grids = two["image_grid_thw"]
    rows = int(grids[0].prod())
    reordered = {**two, "image_grid_thw": grids.flip(0),
                 "pixel_values": torch.cat([two["pixel_values"][rows:], two["pixel_values"][:rows]])}
    with pytest.raises(BatchError, match="in the order of its pixels"):
        assembly.collator([reordered])
    assembly.undo()
