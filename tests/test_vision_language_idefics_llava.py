"""Idefics3, SmolVLM and LLaVA-OneVision padding-free: image-text examples packed into one row — Idefics3 / SmolVLM's
sub-image tiles concatenated as ``[1, all tiles, 3, S, S]``, LLaVA-OneVision's any-resolution patches as
``[all patches, 3, S, S]`` beside each example's ``image_sizes`` and ``batch_num_images`` — give each example's
logits run alone (with its own images) within 1e-5 and the gradients within 1e-4, with 0, 1 and 3 images of
different sizes per example, a black image among them, and a text-only batch; a swap of two examples' images is
caught; the vision tower never sees the packed row's boundaries; bad inputs (placeholders and pixels that do not
match, pixels without placeholders, an all-zero tile the model would drop) are clear errors before the model runs."""

from __future__ import annotations

import copy

import pytest
import torch

from padfree_plugins import BatchError, assemble
from padfree_plugins.packing.batch import PackedBatch
from padfree_plugins.testing.vision import (
    ANY_RESOLUTION,
    TILED,
    image_text_example,
    image_text_processor,
    synthetic_image,
    tiny_vision_language_model,
)

pytest.importorskip("PIL")

#: Where each family's vision tower is, from the ``*ForConditionalGeneration``, and its first attention block.
TOWERS = {"idefics3": "model.vision_model", "smolvlm": "model.vision_model",
          "llava_onevision": "model.vision_tower"}


def black_image(height: int, width: int):
    from PIL import Image

    return Image.new("RGB", (width, height))


@pytest.fixture(scope="module", params=(*TILED, *ANY_RESOLUTION))
def family(request):
    processor = image_text_processor(request.param)
    return request.param, processor, tiny_vision_language_model(request.param, processor)


def flat_example(processor, text: str, images: list) -> dict:
    """A LLaVA-OneVision example whose images were given to the processor flat (``batch_num_images`` ``[1, 1, …]``:
    every image patched at any resolution, not as a multi-image example)."""
    output = processor(text=[text], images=images, return_tensors="pt")
    return {"input_ids": output["input_ids"][0].tolist(),
            **{key: output[key] for key in ("pixel_values", "image_sizes", "batch_num_images")}}


def mixed_examples(name, processor) -> list[dict]:
    """0, 1 and 3 images per example, of different sizes (the first and last example's of the same size), a black
    one; LLaVA-OneVision also an example of two images each patched (given flat)."""
    examples = [
        image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)]),
        image_text_example(processor, "no image here at all, only words"),
        image_text_example(processor, "three <image> images <image> here <image> ok",
                           [synthetic_image(40, 40, 1), synthetic_image(30, 100, 2), synthetic_image(90, 50, 3)]),
        image_text_example(processor, "x"),
        image_text_example(processor, "a black <image> one", [black_image(50, 70)]),
    ]
    if name in ANY_RESOLUTION:
        examples.append(flat_example(processor, "two <image> patched <image>",
                                     [synthetic_image(100, 40, 5), synthetic_image(56, 56, 6)]))
    examples.append(image_text_example(processor, "<image>", [synthetic_image(60, 90, 4)]))
    return examples


def run_alone(model, example: dict):
    """``example`` run alone by the unpatched model, with its own images as the processor made them."""
    media = {key: value for key, value in example.items() if key != "input_ids"}
    return model(input_ids=torch.tensor([example["input_ids"]]), **media)


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed_and_alone(model, examples):
    """Logits and gradients of the packed batch (sum of each example's logits · a fixed random weight) and of each
    example alone (the same loss, summed over examples)."""
    reference = copy.deepcopy(model).train()
    packed = copy.deepcopy(model).train()
    assembly = assemble(packed, {"task": "causal_lm"})
    batch = assembly.collator(examples)
    weight = torch.randn(packed.config.text_config.vocab_size, generator=torch.Generator().manual_seed(0))
    logits = assembly.forward(packed, batch).logits[0]
    (logits @ weight).sum().backward()
    alone = []
    for example in examples:
        out = run_alone(reference, example).logits[0]
        (out @ weight).sum().backward()
        alone.append(out.detach())
    assembly.undo()
    return logits.detach(), batch, alone, gradients(packed), gradients(reference)


def assert_examples_match(logits, batch, alone) -> None:
    cu = batch["cu_seq_lens_q"].tolist()
    for index, reference in enumerate(alone):
        torch.testing.assert_close(logits[cu[index]:cu[index + 1]], reference, atol=1e-5, rtol=1e-5,
                                   msg=lambda text, index=index: f"example {index}: {text}")


def test_packed_image_text_equals_each_example_alone(family):
    name, processor, model = family
    examples = mixed_examples(name, processor)
    logits, batch, alone, got, want = packed_and_alone(model, examples)
    if name in TILED:
        tiles = sum(example["pixel_values"].shape[1] for example in examples if "pixel_values" in example)
        assert batch["pixel_values"].shape == (1, tiles, 3, 56, 56)
        assert batch["pixel_attention_mask"].shape == (1, tiles, 56, 56)
    else:
        assert batch["pixel_values"].ndim == 4 and batch["image_sizes"].shape == (8, 2)
        assert batch["batch_num_images"].tolist() == [1, 3, 1, 1, 1, 1]  # the multi-image example unpatched
    assert_examples_match(logits, batch, alone)
    tower = TOWERS[name].split(".")[-1]
    assert got.keys() == want.keys() and any(tower in key for key in got)
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)


def test_a_text_only_batch_equals_each_example_alone(family):
    name, processor, model = family
    examples = [image_text_example(processor, text) for text in ("one two", "a longer text of words", "x")]
    logits, batch, alone, *_ = packed_and_alone(model, examples)
    assert "pixel_values" not in batch
    assert_examples_match(logits, batch, alone)


def test_swapped_images_are_caught(family):
    """The comparison above fails when the first and last examples' images (of the same size, so the same number of
    tiles or patches) trade places in the packed pixels: it would catch a misaligned pack."""
    name, processor, model = family
    examples = mixed_examples(name, processor)
    packed = copy.deepcopy(model)
    assembly = assemble(packed, {"task": "causal_lm"})
    batch = assembly.collator(examples)
    with torch.no_grad():
        alone = [run_alone(model, example).logits[0] for example in examples]
        assert_examples_match(assembly.forward(packed, batch).logits[0], batch, alone)
        pixels = batch["pixel_values"].clone()
        rows = examples[0]["pixel_values"].shape[1]  # the 60 x 90 image's tiles, or its patches (one image)
        view = pixels[0] if name in TILED else pixels
        first, last = slice(0, rows), slice(view.shape[0] - rows, view.shape[0])
        view[first], view[last] = view[last].clone(), view[first].clone()
        swapped = PackedBatch(batch)
        swapped.model_keys = batch.model_keys
        swapped["pixel_values"] = pixels
        with pytest.raises(AssertionError):
            assert_examples_match(assembly.forward(packed, swapped).logits[0], swapped, alone)
    assembly.undo()


def test_the_vision_tower_keeps_its_own_attention_and_never_sees_the_boundaries(family):
    name, processor, model = family
    packed = copy.deepcopy(model)
    assembly = assemble(packed, {"task": "causal_lm"})
    tower = packed.get_submodule(TOWERS[name])
    assert tower.config._attn_implementation == "sdpa"
    assert packed.config.text_config._attn_implementation == assembly.patch.implementation != "sdpa"
    seen = []
    hooks = [module.register_forward_pre_hook(lambda module, args, kwargs: seen.append(sorted(kwargs)),
                                              with_kwargs=True) for module in (tower, tower.encoder.layers[0])]
    with torch.no_grad():
        assembly.forward(packed, assembly.collator(mixed_examples(name, processor)[:3]))
    for hook in hooks:
        hook.remove()
    assert seen and not any(key.startswith(("cu_seq_lens", "max_length", "seq_idx")) for keys in seen for key in keys)
    assembly.undo()
    assert packed.config.text_config._attn_implementation == "sdpa" and not tower._forward_pre_hooks


def test_labels_from_input_ids_leave_image_tokens_unlabelled(family):
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    batch = assembly.collator(mixed_examples(name, processor)[:3])
    image = batch["input_ids"] == model.config.image_token_id
    assert image.any() and (batch["labels"][image] == -100).all()
    text = ~image
    text[0, batch["cu_seq_lens_q"][:-1].long()] = False  # each example's first label is -100 anyway
    assert (batch["labels"][text] == batch["input_ids"][text]).all()
    assembly.undo()


def test_bad_multimodal_inputs_are_clear_errors(family):
    name, processor, model = family
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    good = image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)])
    image = model.config.image_token_id
    ids = good["input_ids"]
    short = {**good, "input_ids": [token for i, token in enumerate(ids) if not (token == image and i % 2)]}
    with pytest.raises(BatchError, match="example 1 has .* image tokens but .* make"):
        assembly.collator([good, short])
    no_tokens = {**good, "input_ids": [token for token in good["input_ids"] if token != image]}
    with pytest.raises(BatchError, match="example 0 has 0 image tokens but"):
        assembly.collator([no_tokens])
    with pytest.raises(BatchError, match="image tokens but no 'pixel_values'"):
        assembly.collator([{"input_ids": good["input_ids"]}])
    with pytest.raises(BatchError, match="truncating it would cut placeholders from their pixels"):
        truncating = assemble(copy.deepcopy(model), {"task": "causal_lm", "max_length": 8, "on_overlong": "truncate"})
        truncating.collator([good])
    truncating.undo()
    assembly.undo()


@pytest.mark.parametrize("name", TILED)
def test_tiles_of_a_batched_call_black_tiles_and_stacked_examples(name):
    """An example taken from a batched processor call (zero tiles with a zero mask after its own: padding) packs as
    the example alone; a real all-zero tile — a black image without normalisation, which the model would drop as
    padding — is refused, as are two examples' tiles in one example and tiles of another size than the tower's."""
    processor = image_text_processor(name)
    model = tiny_vision_language_model(name, processor)
    good = image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)])
    padded = {**good, "pixel_values": torch.cat([good["pixel_values"], torch.zeros(1, 3, 3, 56, 56)], dim=1),
              "pixel_attention_mask": torch.cat([good["pixel_attention_mask"],
                                                 torch.zeros(1, 3, 56, 56, dtype=torch.long)], dim=1)}
    other = image_text_example(processor, "<image>", [synthetic_image(30, 100, 1)])
    logits, batch, alone, *_ = packed_and_alone(model, [padded, other])
    assert batch["pixel_values"].shape[1] == good["pixel_values"].shape[1] + other["pixel_values"].shape[1]
    assert_examples_match(logits, batch, [run_alone(model, good).logits[0], alone[1]])
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    raw = copy.deepcopy(processor)
    raw.image_processor.do_normalize = False
    black = image_text_example(raw, "a black <image> one", [black_image(50, 70)])
    with pytest.raises(BatchError, match=r"example 1: tile\(s\) \[0, 1, 2, 3, 4\] of its 'pixel_values' are all zero"):
        assembly.collator([good, black])
    unmasked = {key: value for key, value in black.items() if key != "pixel_attention_mask"}
    with pytest.raises(BatchError, match="are all zeros: the model drops every all-zero tile"):
        assembly.collator([unmasked])
    with pytest.raises((ValueError, RuntimeError)):  # the model alone: Idefics3 drops every tile and fails
        run_alone(model, black)  # reshaping none, SmolVLM keeps one and its features do not match the tokens
    stacked = {**good, "pixel_values": good["pixel_values"].expand(2, -1, -1, -1, -1)}
    with pytest.raises(BatchError, match="holds 2 rows of tiles"):
        assembly.collator([stacked])
    with pytest.raises(BatchError, match=r"its tiles are \(28, 28\) pixels, but the vision tower's image_size is 56"):
        assembly.collator([{**good, "pixel_values": good["pixel_values"][..., :28, :28],
                            "pixel_attention_mask": good["pixel_attention_mask"][..., :28, :28]}])
    assembly.undo()


def test_any_resolution_images_are_checked_per_image():
    """LLaVA-OneVision: each image's tokens counted by its size (the processor's formula) and in the order of its
    pixels; pixels without sizes, sizes that do not fit the pixels, or ``batch_num_images`` that do not count the
    images are refused — the model itself checks only the packed total; so are videos (not packed)."""
    processor = image_text_processor("llava_onevision")
    model = tiny_vision_language_model("llava_onevision", processor)
    assembly = assemble(copy.deepcopy(model), {"task": "causal_lm"})
    two = flat_example(processor, "a <image> b <image> c", [synthetic_image(60, 90, 0), synthetic_image(100, 30, 1)])
    assembly.collator([two])
    with pytest.raises(BatchError, match="has 'pixel_values' but no 'image_sizes'"):
        assembly.collator([{key: value for key, value in two.items() if key != "image_sizes"}])
    reordered = {**two, "pixel_values": two["pixel_values"].flip(0), "image_sizes": two["image_sizes"].flip(0)}
    with pytest.raises(BatchError, match=r"its image tokens run \[\d+, \d+\] but its images make .* in that order"):
        assembly.collator([reordered])
    with pytest.raises(BatchError, match="image tokens but its 2 image\\(s\\) make"):
        assembly.collator([{**two, "image_sizes": torch.tensor([[90, 60], [100, 30]])}])
    with pytest.raises(BatchError, match="batch_num_images \\[3\\] count 3 images but its image_sizes 2"):
        assembly.collator([{**two, "batch_num_images": torch.tensor([3])}])
    with pytest.raises(BatchError, match="have 1 patches in 'pixel_values' but their sizes make"):
        assembly.collator([{**two, "pixel_values": two["pixel_values"][:, :1]}])
    with pytest.raises(BatchError, match="image tokens but its 2 image\\(s\\) make \\d+ \\(\\[5, 5\\]"):
        assembly.collator([{**two, "batch_num_images": torch.tensor([2])}])  # unpatched: 5 tokens each
    with pytest.raises(BatchError, match="'pixel_values_videos': the llava_onevision plugin packs images only"):
        assembly.collator([{**two, "pixel_values_videos": torch.zeros(1, 2, 3, 28, 28)}])
    assembly.undo()
