"""Gemma 3 image-text padding-free: examples with 0, 1 or 3 images (and pan-and-scan crops) packed into one row give
each example's logits run alone within 1e-5 and the gradients within 1e-4 — each image's tokens attending to each
other both ways, causal otherwise, never across examples, on sliding-window layers too. Dropping the images'
bidirectional attention, or letting an image's block reach into the next example, is caught by the same comparison;
the kernels equal transformers' own Gemma 3 masks; ``attention: auto`` picks a backend that implements the blocks
and one that does not is refused; bad inputs are clear errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    and_masks,
    blockwise_overlay,
    causal_mask_function,
    or_masks,
    sliding_window_overlay,
)
from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

from padfree_plugins import BackendUnavailableError, BatchError, BoundaryError, assemble, hookimpl, plan
from padfree_plugins.builtin.architectures.gemma3_vl import ImageBlocks, image_blocks
from padfree_plugins.contract.declarations import FEATURES, AttentionBackend
from padfree_plugins.contract.host import PluginHost
from padfree_plugins.errors import UnsupportedArchitectureError
from padfree_plugins.modeling import attention
from padfree_plugins.modeling.attention import BLOCKS_FEATURE, BLOCKS_KWARG, PadfreeAttention, backends
from padfree_plugins.packing.batch import token_examples
from padfree_plugins.testing.vision import gemma3_example, gemma3_processor, synthetic_image, tiny_gemma3_model

pytest.importorskip("PIL")

CAUSAL_LM = {"task": "causal_lm"}
PAN_AND_SCAN = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=32)


@pytest.fixture(scope="module")
def processor():
    return gemma3_processor()


@pytest.fixture(scope="module")
def model(processor):
    return tiny_gemma3_model(processor)


def mixed_examples(processor) -> list[dict]:
    """0, 1 and 3 images per example (two of the same size), an image cropped by pan-and-scan (4 pixel rows), text
    around and between them; every example longer than the window (6) but one."""
    return [
        gemma3_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)]),
        gemma3_example(processor, "no image here at all, only words"),
        gemma3_example(processor, "three <image> images <image> here <image> ok",
                       [synthetic_image(40, 40, 1), synthetic_image(80, 50, 2), synthetic_image(40, 40, 3)]),
        gemma3_example(processor, "x"),
        gemma3_example(processor, "wide <image> crops", [synthetic_image(40, 130, 4)], **PAN_AND_SCAN),
        gemma3_example(processor, "<image>", [synthetic_image(60, 90, 5)]),
    ]


def as_inputs(example: dict) -> dict:
    return {key: torch.tensor([value]) if isinstance(value, list) else value for key, value in example.items()}


def run_alone(model, example: dict):
    """``example`` run alone by the unpatched model: its own pixels, its ``token_type_ids`` (transformers' own
    masks make its images bidirectional)."""
    return model(**as_inputs(example))


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed_and_alone(model, examples, config=None):
    """Logits and gradients of the packed batch (each token's logits · a fixed random weight, summed) and of each
    example alone (the same loss, summed over examples)."""
    reference, packed = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    assembly = assemble(packed, config or CAUSAL_LM)
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


def differences(logits, batch, alone) -> list[float]:
    """Each example's largest logit difference, packed vs alone."""
    cu = batch["cu_seq_lens_q"].tolist()
    return [float((logits[cu[i]:cu[i + 1]] - reference).abs().max()) for i, reference in enumerate(alone)]


def assert_examples_match(logits, batch, alone) -> None:
    cu = batch["cu_seq_lens_q"].tolist()
    for index, reference in enumerate(alone):
        torch.testing.assert_close(logits[cu[index]:cu[index + 1]], reference, atol=1e-5, rtol=1e-5,
                                   msg=f"example {index}")


def packed_logits(model, examples, config=None):
    """The packed logits without gradients, and each example's alone."""
    packed = copy.deepcopy(model)
    assembly = assemble(packed, config or CAUSAL_LM)
    batch = assembly.collator(examples)
    with torch.no_grad():
        logits = assembly.forward(packed, batch).logits[0]
        alone = [run_alone(model, example).logits[0] for example in examples]
    assembly.undo()
    return logits, batch, alone


def test_packed_image_text_equals_each_example_alone(processor, model):
    examples = mixed_examples(processor)
    logits, batch, alone, got, want = packed_and_alone(model, examples)
    assert batch["pixel_values"].shape == (1 + 3 + 4 + 1, 3, 56, 56)  # pan-and-scan: the image and its 3 crops
    assert batch["position_ids"].shape == batch["input_ids"].shape == batch["token_type_ids"].shape
    assert_examples_match(logits, batch, alone)
    assert got.keys() == want.keys() and any("vision_tower" in key for key in got)
    assert any("multi_modal_projector" in key for key in got)
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)
    image = batch["input_ids"] == model.config.image_token_id
    assert (batch["labels"][image] == -100).all()  # an image token predicts nothing


def test_a_text_only_batch_equals_each_example_alone(processor, model):
    examples = [gemma3_example(processor, text) for text in ("one two", "a longer text of words than the window", "x")]
    logits, batch, alone, got, want = packed_and_alone(model, examples)
    assert "pixel_values" not in batch
    assert_examples_match(logits, batch, alone)
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)


def attention_kwargs(model, assembly, batch) -> list[set[str]]:
    """The keyword names every text attention module of ``model`` receives on ``batch``."""
    seen = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)
             for layer in model.model.language_model.layers]
    try:
        with torch.no_grad():
            assembly.forward(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_the_blocks_reach_attention_only_with_images(processor, model):
    """Image tokens make blocks in every text layer's call; a text-only row (on the host) none: plain causal."""
    packed = copy.deepcopy(model)
    assembly = assemble(packed, CAUSAL_LM)
    with_images = attention_kwargs(packed, assembly, assembly.collator(mixed_examples(processor)[:3]))
    text_only = attention_kwargs(packed, assembly, assembly.collator([gemma3_example(processor, "only words")]))
    assembly.undo()
    assert len(with_images) == 2 and all(BLOCKS_KWARG in kwargs for kwargs in with_images)
    assert len(text_only) == 2 and not any(BLOCKS_KWARG in kwargs for kwargs in text_only)


def test_blocks_follow_token_type_ids_or_else_the_placeholders(processor, model):
    """Without ``token_type_ids`` the images are found from their placeholders — the same blocks as with the
    processor's ``token_type_ids``, so the same logits."""
    examples = mixed_examples(processor)[:3]
    logits, batch, alone = packed_logits(model, examples)
    bare = [{key: value for key, value in example.items() if key != "token_type_ids"} for example in examples]
    without, bare_batch, _ = packed_logits(model, bare)
    assert "token_type_ids" not in bare_batch
    torch.testing.assert_close(without, logits, atol=1e-6, rtol=1e-6)
    cu = batch["cu_seq_lens_q"]
    by_types = image_blocks(batch["token_type_ids"] == 1, cu)
    torch.testing.assert_close(image_blocks(batch["input_ids"] == model.config.image_token_id, cu), by_types)
    assert int(by_types.max()) + 1 == 4  # four images, each its own block


def test_dropping_the_images_bidirectional_attention_is_caught(processor, model, monkeypatch):
    """With the blocks left out (plain causal attention over the packed row) every example with an image differs
    from alone by far more than the tolerance, and the text-only ones still match: the comparison above proves the
    images' bidirectional attention."""
    examples = mixed_examples(processor)
    monkeypatch.setattr(ImageBlocks, "__call__", lambda self, module, args, kwargs: None)
    logits, batch, alone = packed_logits(model, examples)
    gaps = differences(logits, batch, alone)
    with_images = [index for index, example in enumerate(examples) if "pixel_values" in example]
    assert min(gaps[index] for index in with_images) > 1e-2, gaps
    assert max(gap for index, gap in enumerate(gaps) if index not in with_images) < 1e-5, gaps


def adjacent_images(processor) -> list[dict]:
    """Two examples whose images touch across the boundary in the packed row: the first ends with an image's tokens,
    the second starts with one's (the processor's text around them cut off)."""
    first = gemma3_example(processor, "words then <image>", [synthetic_image(60, 90, 0)])
    second = gemma3_example(processor, "<image> then words", [synthetic_image(40, 40, 1)])
    last = max(i for i, kind in enumerate(first["token_type_ids"]) if kind)
    start = second["token_type_ids"].index(1)
    return [{**first, **{key: first[key][:last + 1] for key in ("input_ids", "token_type_ids")}},
            {**second, **{key: second[key][start:] for key in ("input_ids", "token_type_ids")}}]


def leaky_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, *, causal, scale=None,
                 window=None, softcap=None, dropout=0.0, blocks=None, sinks=None):
    """A broken backend: the packed row as one sequence, text kept inside its example but the blocks numbered over
    the row as transformers numbers them for one sequence — a run of image tokens continues into the next example."""
    examples = token_examples(cu_seq_lens_q, query.shape[0])
    row_blocks = get_block_sequence_ids_for_mask((blocks >= 0).long()[None])
    same_block = (row_blocks[0, :, None] == row_blocks[0, None, :]) & (row_blocks[0, :, None] >= 0)
    mask = backends.block_mask(row_blocks, causal, window) & ((examples[:, None] == examples[None, :]) | same_block)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    out = backends.attend(q, k, v, causal=False, scale=scale, softcap=softcap, mask=mask)
    return out[0].transpose(0, 1)


def test_an_image_never_sees_another_example(processor, model):
    """Two examples' images adjacent in the packed row are two blocks (cut at the boundary) and each example equals
    itself alone; a backend that lets the first image's block run into the second example is caught."""
    examples = adjacent_images(processor)
    logits, batch, alone = packed_logits(model, examples)
    assert_examples_match(logits, batch, alone)
    boundary = int(batch["cu_seq_lens_q"][1])
    blocks = image_blocks(batch["token_type_ids"] == 1, batch["cu_seq_lens_q"])[0]
    assert blocks[boundary - 1] == 0 and blocks[boundary] == 1  # adjacent, yet two blocks
    assert int(get_block_sequence_ids_for_mask(batch["token_type_ids"]).max()) == 0  # one run over the row

    packed = copy.deepcopy(model)
    assembly = assemble(packed, CAUSAL_LM)
    patch = assembly.patch
    leaky = dataclasses.replace(patch.backend, varlen=leaky_varlen)
    AttentionInterface.register(patch.implementation, PadfreeAttention(leaky, None, patch.attention_dropout))
    try:
        with torch.no_grad():
            leaked = assembly.forward(packed, batch).logits[0]
    finally:
        attention.register(patch.backend, patch.fallback, patch.attention_dropout)
        assembly.undo()
    gaps = differences(leaked, batch, alone)
    assert gaps[0] > 1e-2 and gaps[1] > 1e-2, gaps  # the first image sees the second's tokens, and back


@pytest.mark.parametrize("window", [3, 5])
def test_sliding_windows_shorter_than_an_image_and_an_example(processor, window):
    """Both text layers sliding, the window shorter than the examples (3: shorter than an image's 4 tokens, whose
    later tokens a token still sees): packed equals alone, logits and gradients."""
    windowed = tiny_gemma3_model(processor, seed=1, sliding_window=window,
                                 layer_types=["sliding_attention", "sliding_attention"])
    examples = mixed_examples(processor)[:3]
    logits, batch, alone, got, want = packed_and_alone(windowed, examples)
    assert_examples_match(logits, batch, alone)
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)
    with attention.record_attention_calls() as calls:
        packed_logits(windowed, examples)
    assert [call.window for call in calls] == [window, window]


def reference_attention(query, key, value, cu_seq_lens, blocks, window, scale):
    """Each example alone through sdpa with transformers' own Gemma 3 mask: ``(causal | blockwise) & window``."""
    pieces = []
    bounds = cu_seq_lens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        mask = or_masks(causal_mask_function, blockwise_overlay(blocks[None, start:end]))
        if window is not None:
            mask = and_masks(mask, sliding_window_overlay(window))
        index = torch.arange(end - start)
        allowed = mask(0, 0, index[:, None], index[None, :])
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                               enable_gqa=True)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("varlen", [backends.exact_varlen, backends.repad_varlen, backends.row_masked_varlen],
                         ids=["exact", "repad", "row_masked"])
def test_the_kernels_equal_transformers_gemma3_masks(varlen, window):
    """exact (the CPU pick) and repad (the GPU pick, run here on the CPU) with blocks equal each example through
    transformers' own mask functions — examples of equal length stacked together, an image at an example's end
    next to one at the next example's start, GQA — outputs and gradients."""
    lengths = [9, 12, 9, 1, 12, 7]
    images = torch.zeros(sum(lengths), dtype=torch.bool)
    for start, length in [(2, 4), (6, 3), (9, 3), (21, 4), (31, 5), (43, 4), (50, 3)]:
        images[start:start + length] = True  # 6-8 ends example 0, 9-11 starts example 1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    blocks = image_blocks(images, cu)[0]
    assert blocks[8] != blocks[9]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(sum(lengths), 4, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(sum(lengths), 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    got = varlen(query, key, value, cu, cu, max(lengths), max(lengths), causal=True, scale=0.3, window=window,
                 blocks=blocks)
    grads = torch.autograd.grad(got.square().sum(), (query, key, value))
    want = reference_attention(query, key, value, cu, blocks, window, 0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for mine, theirs in zip(grads, torch.autograd.grad(want.square().sum(), (query, key, value))):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    plain = varlen(query, key, value, cu, cu, max(lengths), max(lengths), causal=True, scale=0.3, window=window)
    assert float((plain - got).detach().abs().max()) > 1e-2  # the blocks change the result


def test_auto_picks_a_backend_that_implements_the_blocks(model, monkeypatch):
    """On a CPU auto picks exact; on a CUDA machine (simulated: varlen and flash_attn said to be available) repad,
    since varlen and flash_attn run causal or not only — named explicitly, they are refused for that."""
    assert BLOCKS_FEATURE in plan(model.config, CAUSAL_LM, device_type="cpu").features
    assert plan(model.config, CAUSAL_LM, device_type="cpu").backend.name == "exact"
    with pytest.raises(BackendUnavailableError, match="'flash_attn' was requested but cannot be used on cpu"):
        plan(model.config, {**CAUSAL_LM, "attention": "flash_attn"}, device_type="cpu")
    monkeypatch.setattr(backends, "torch_varlen_unavailable", lambda: None)
    monkeypatch.setattr(backends, "flash_attn_unavailable", lambda: None)
    cuda = plan(model.config, CAUSAL_LM, host=PluginHost(), device_type="cuda")
    assert cuda.backend.name == "repad" and cuda.fallback is None
    for name in ("varlen", "flash_attn"):
        with pytest.raises(BackendUnavailableError, match=f"'{name}' was requested but cannot be used on cuda: does "
                                                          "not implement bidirectional_blocks.* picks repad"):
            plan(model.config, {**CAUSAL_LM, "attention": name}, host=PluginHost(), device_type="cuda")


def test_a_backend_without_blocks_is_refused_at_assembly_and_in_attention(processor, model):
    """A backend that runs here but implements no blocks is refused by name at assembly (auto would pick exact),
    and in attention if blocks reach it anyway."""
    class CausalOnly:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackend("causal_only", backends.exact_varlen, features=frozenset(FEATURES),
                                     devices=("cpu",))]

    host = PluginHost({"causal_only": CausalOnly()})
    with pytest.raises(BackendUnavailableError, match="'causal_only' was requested but cannot be used on cpu: does "
                                                      "not implement bidirectional_blocks. On cpu use attention: auto "
                                                      r"\(it picks exact here\)"):
        assemble(copy.deepcopy(model), {**CAUSAL_LM, "attention": "causal_only"}, host=host)
    backend = host.backends()["causal_only"][0]
    q = torch.randn(1, 4, 6, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="bidirectional blocks .* 'causal_only' attention backend does not"):
        PadfreeAttention(backend)(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, max_length_q=6,
                                  **{BLOCKS_KWARG: torch.tensor([[-1, 0, 0, 0, -1, -1]])})


def test_bad_gemma3_inputs_are_clear_errors(processor, model):
    assembly = assemble(copy.deepcopy(model), CAUSAL_LM)
    good = gemma3_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 0)])
    image = model.config.image_token_id
    first = good["input_ids"].index(image)
    short = {key: good[key][:first] + good[key][first + 1:] for key in ("input_ids", "token_type_ids")}
    with pytest.raises(BatchError, match=r"example 1 has 3 image tokens but 1 rows of 'pixel_values' at 4 tokens each "
                                         "make 4"):
        assembly.collator([good, {**good, **short}])
    text = gemma3_example(processor, "only words")
    with pytest.raises(BatchError, match="example 0 has 0 image tokens but 1 rows of 'pixel_values'"):
        assembly.collator([{**text, "pixel_values": good["pixel_values"]}])
    with pytest.raises(BatchError, match="example 0 has 4 image tokens but no 'pixel_values'"):
        assembly.collator([{key: good[key] for key in ("input_ids", "token_type_ids")}])
    split = {key: good[key][:first + 1] + good[key][:1] + good[key][first + 1:] for key in ("input_ids",
                                                                                            "token_type_ids")}
    with pytest.raises(BatchError, match=r"its image tokens run \[1, 3\] but its images make \[4\]"):
        assembly.collator([{**good, **split}])
    batch = assembly.collator([good, text])
    embeds = assembly.model.get_input_embeddings()(batch["input_ids"])
    inputs = {key: batch[key] for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                          "max_length_k")}
    with pytest.raises(BoundaryError, match="given as inputs_embeds needs its token_type_ids"):
        assembly.model(inputs_embeds=embeds, **inputs)
    assembly.undo()
    truncating = assemble(copy.deepcopy(model), {**CAUSAL_LM, "max_length": 8, "on_overlong": "truncate"})
    with pytest.raises(BatchError, match="truncating it would cut placeholders from their pixels"):
        truncating.collator([good])
    truncating.undo()
    bidirectional = tiny_gemma3_model(processor, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention"):
        assemble(bidirectional, CAUSAL_LM)


def test_the_vision_tower_keeps_its_attention_and_unpacked_calls_are_unchanged(processor, model):
    """The SigLIP tower keeps sdpa and never sees the boundaries or the blocks; a padded call of the patched model
    (its masks transformers' own, token_type_ids included) equals the unpatched model; undo removes every hook."""
    packed = copy.deepcopy(model)
    assembly = assemble(packed, CAUSAL_LM)
    tower = packed.model.vision_tower
    assert tower.config._attn_implementation == "sdpa"
    assert packed.config.text_config._attn_implementation == assembly.patch.implementation
    seen = []
    hook = tower.encoder.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    with torch.no_grad():
        assembly.forward(packed, assembly.collator(mixed_examples(processor)[:3]))
    hook.remove()
    assert seen and not any(key.startswith(("cu_seq_lens", "max_length", "seq_idx", BLOCKS_KWARG))
                            for keys in seen for key in keys)
    example = as_inputs(mixed_examples(processor)[2])
    with torch.no_grad():
        torch.testing.assert_close(packed(**example).logits, model(**example).logits, atol=1e-6, rtol=1e-6)
    assembly.undo()
    assert packed.config.text_config._attn_implementation == "sdpa"
    assert not packed.model._forward_pre_hooks and not tower._forward_pre_hooks
