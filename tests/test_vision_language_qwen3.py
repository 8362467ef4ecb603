"""The Qwen3 vision-language families padding-free (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE), beyond the
equivalence suite of ``tests/test_vision_language.py`` that runs for them too (every family of
:data:`~padfree_plugins.testing.vision.FAMILIES`): images and multi-frame videos in one example, each video frame
after its timestamp; the per-example mRoPE rows are the real model's ``get_rope_index`` on the example alone; the
deepstack features land on each example's own image and video tokens; the MoE load-balancing loss and its gradients
are those over the same tokens run alone; the gated DeltaNets of Qwen3.5 restart at every example (and without that
restart the packed row would be wrong); bad inputs are clear errors before the model runs."""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch

from padfree_plugins import BatchError, assemble
from padfree_plugins.errors import BackendUnavailableError, UnsupportedArchitectureError
from padfree_plugins.modeling.mixers import MixerPatch, PackedMixer, missing_packages
from padfree_plugins.testing.vision import (
    DEEPSTACK,
    HYBRID_TEXT,
    MOE,
    TIMESTAMPED_VIDEO,
    image_text_example,
    image_text_processor,
    synthetic_image,
    synthetic_video_example,
    tiny_vision_language_model,
)
from tests.test_vision_language import assert_examples_match, mixed_examples, packed_and_alone, run_alone, token_types

pytest.importorskip("PIL")

CAUSAL_LM = {"task": "causal_lm"}


@pytest.fixture(scope="module", params=TIMESTAMPED_VIDEO)
def family(request):
    processor = image_text_processor(request.param)
    return request.param, processor, tiny_vision_language_model(request.param, processor)


def make_family(name: str, **text_overrides):
    processor = image_text_processor(name)
    return name, processor, tiny_vision_language_model(name, processor, **text_overrides)


def video_examples(processor, model_config) -> list[dict]:
    """Videos of 2 and 3 temporal patches (different frame sizes), one with an image in the same example, beside an
    image-only and a text-only example."""
    three = synthetic_video_example(processor, model_config, "clip <image> then", frames=6, height=4, width=2, seed=1,
                                    seconds_per_patch=1.5)
    both = image_text_example(processor, "a picture <image> of words", [synthetic_image(60, 90, 5)])
    video = synthetic_video_example(processor, model_config, "and <image>", frames=4, height=2, width=4, seed=2)
    both = {**both, "input_ids": both["input_ids"] + video["input_ids"],
            **{key: value for key, value in video.items() if key != "input_ids"}}
    return [three, image_text_example(processor, "only words"), both,
            image_text_example(processor, "three <image> images <image> here <image> ok",
                               [synthetic_image(40, 40, 1), synthetic_image(80, 50, 2), synthetic_image(100, 40, 3)])]


def largest_difference(logits, batch, alone) -> float:
    cu = batch["cu_seq_lens_q"].tolist()
    return max(float((logits[cu[i]:cu[i + 1]] - ref).abs().max()) for i, ref in enumerate(alone))


def test_videos_frame_by_frame_and_images_in_one_example_equal_each_example_alone(family):
    """Logits within 1e-5 and gradients within 1e-4 of each example alone, the videos frame by frame (a timestamp
    before each frame) and an example holding an image and a video (the deepstack features of both merged)."""
    name, processor, model = family
    logits, batch, alone, got, want, assembly = packed_and_alone(model, video_examples(processor, model.config))
    assert batch["video_grid_thw"].tolist() == [[3, 4, 2], [2, 2, 4]] and "second_per_grid_ts" not in batch
    assert_examples_match(logits, batch, alone)
    assert largest_difference(logits, batch, alone) < 1e-5
    assert got.keys() == want.keys() and any("visual" in key for key in got)
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)
    assembly.undo()


def test_the_rotary_rows_are_the_models_own_get_rope_index_for_each_example(family):
    """The collator's rows 1-3 of ``position_ids`` are, example by example, what the model instance's own
    ``get_rope_index`` gives that example (the stand-in the collator calls it on holds only the config)."""
    name, processor, model = family
    examples = [*video_examples(processor, model.config), *mixed_examples(processor, model.config)]
    assembly = assemble(copy.deepcopy(model), CAUSAL_LM)
    batch = assembly.collator(examples)
    cu = batch["cu_seq_lens_q"].tolist()
    for index, example in enumerate(examples):
        ids = torch.tensor([example["input_ids"]])
        grids = {key: example.get(key) for key in ("image_grid_thw", "video_grid_thw")}
        want, _ = model.model.get_rope_index(ids, mm_token_type_ids=token_types(model, ids), **grids)
        assert torch.equal(batch["position_ids"][1:, 0, cu[index]:cu[index + 1]], want[:, 0]), f"example {index}"
    assembly.undo()


@pytest.mark.parametrize("name", DEEPSTACK)
def test_deepstack_features_land_on_each_examples_own_visual_tokens(name):
    """The deepstack features are added at exactly the packed row's image and video tokens, each example's rows
    equal to those it gets alone; and they matter (without them the logits differ), so the equivalence above
    covers them."""
    name, processor, model = make_family(name)
    examples = video_examples(processor, model.config)
    packed = copy.deepcopy(model)
    assembly = assemble(packed, CAUSAL_LM)
    batch = assembly.collator(examples)

    def recorder(language_model, seen):
        def record(hidden_states, visual_pos_masks, visual_embeds):
            seen.append((visual_pos_masks.clone(), visual_embeds.detach().clone()))
            return type(language_model)._deepstack_process(language_model, hidden_states, visual_pos_masks,
                                                           visual_embeds)
        return record

    packed_seen, alone_seen = [], []
    packed.model.language_model._deepstack_process = recorder(packed.model.language_model, packed_seen)
    reference = copy.deepcopy(model)
    reference.model.language_model._deepstack_process = recorder(reference.model.language_model, alone_seen)
    with torch.no_grad():
        logits = assembly.forward(packed, batch).logits[0]
        alone = [run_alone(reference, example).logits[0] for example in examples]
    layers = len(model.config.vision_config.deepstack_visual_indexes)
    assert len(packed_seen) == layers and len(alone_seen) == layers * sum(
        "pixel_values" in ex or "pixel_values_videos" in ex for ex in examples)
    ids = batch["input_ids"]
    visual = (ids == model.config.image_token_id) | (ids == model.config.video_token_id)
    with_media = iter(alone_seen[i::layers] for i in range(layers))
    for layer, (mask, embeds) in enumerate(packed_seen):
        assert torch.equal(mask, visual)
        torch.testing.assert_close(embeds, torch.cat([rows for _, rows in next(with_media)]), atol=1e-5, rtol=1e-5,
                                   msg=f"deepstack layer {layer}")
    assert_examples_match(logits, batch, alone)
    with torch.no_grad():
        for merger in packed.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        without = assembly.forward(packed, batch).logits[0]
    assert (without - logits)[visual[0]].abs().max() > 1e-3
    assembly.undo()


def router_logits_alone(model, examples) -> tuple[torch.Tensor, ...]:
    """Every layer's router logits of the examples run alone, concatenated in example order (the packed tokens)."""
    outputs = [run_alone(model, example).router_logits for example in examples]
    return tuple(torch.cat(layer) for layer in zip(*outputs))


@pytest.mark.parametrize("name", MOE)
def test_the_router_load_balancing_loss_is_over_the_same_tokens_as_alone(name):
    """``output_router_logits``: the packed aux loss (in the loss, × ``router_aux_loss_coef``) is transformers'
    ``load_balancing_loss_func`` over the router logits of the same tokens run alone (packed, there is no pad to
    mask), within 1e-6; its gradients within 1e-4."""
    name, processor, model = make_family(name, output_router_logits=True, router_aux_loss_coef=0.1)
    text = model.config.text_config
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    examples = mixed_examples(processor, model.config)
    packed, reference = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    assembly = assemble(packed, CAUSAL_LM)
    batch = assembly.collator(examples)
    outputs = assembly.forward(packed, batch)
    routers = router_logits_alone(reference, examples)
    want = balance(routers, text.num_experts, text.num_experts_per_tok, None)
    assert len(outputs.router_logits) == text.num_hidden_layers
    for got, alone in zip(outputs.router_logits, routers):
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs.aux_loss, want, atol=1e-6, rtol=1e-6)
    assert outputs.loss is not None and float(outputs.aux_loss.detach()) > 0
    outputs.aux_loss.backward()
    want.backward()
    grads = {key: p.grad for key, p in reference.named_parameters() if p.grad is not None}
    assert grads and any(".gate." in key for key in grads)
    for key, p in packed.named_parameters():
        if key in grads:
            torch.testing.assert_close(p.grad, grads[key], atol=1e-4, rtol=1e-4, msg=key)
    assembly.undo()


@pytest.mark.parametrize("name", HYBRID_TEXT)
def test_qwen3_5_runs_both_patches_and_needs_the_mixer_restart(name):
    """Qwen3.5 multimodal: the gated DeltaNets run through the mixer patch (a ``PackedMixer`` each, restarted at
    every example), beside the vision-language patch; ``undo()`` removes both. Without the mixer patch transformers'
    torch gated delta rule refuses the packed row (it cannot keep examples apart): the restart is what runs it."""
    name, processor, model = make_family(name)
    examples = mixed_examples(processor, model.config)
    packed = copy.deepcopy(model)
    assembly = assemble(packed, CAUSAL_LM)
    assert assembly.patch.architecture.name == "qwen3_5_vl"
    mixers = [module for module in packed.modules() if type(module).__name__.endswith("GatedDeltaNet")]
    assert len(mixers) == 1 and all(isinstance(module.forward, PackedMixer) for module in mixers)
    batch = assembly.collator(examples)
    with torch.no_grad():
        alone = [run_alone(model, example).logits[0] for example in examples]
        assert_examples_match(assembly.forward(packed, batch).logits[0], batch, alone)
        restart = next(handle for handle in assembly.patch.handles if isinstance(handle, MixerPatch))
        restart.remove()
        assert not any(isinstance(module.forward, PackedMixer) for module in mixers)
        if not missing_packages(("fla",)):
            pytest.skip("flash-linear-attention is installed: transformers would take the boundaries itself")
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            assembly.forward(packed, batch)
    assembly.undo()
    assert packed.config.text_config._attn_implementation == "sdpa" and not packed.model.visual._forward_pre_hooks


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_with_activation_checkpointing_each_example_equals_alone(name):
    """Checkpointed decoder layers and vision blocks recompute in the backward pass — Qwen3.5's gated DeltaNets
    still restarted at every example there: gradients within 1e-4 of each example alone."""
    name, processor, model = make_family(name)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    logits, batch, alone, got, want, assembly = packed_and_alone(model, mixed_examples(processor, model.config))
    assert_examples_match(logits, batch, alone)
    assert got.keys() == want.keys()
    for key, grad in want.items():
        torch.testing.assert_close(got[key], grad, atol=1e-4, rtol=1e-4, msg=key)
    assembly.undo()


@pytest.mark.parametrize("name", HYBRID_TEXT)
def test_qwen3_5_mixer_kernels_on_a_cpu_are_refused_before_patching(name):
    name, processor, model = make_family(name)
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        assemble(model, {**CAUSAL_LM, "mixers": "kernels"})
    assert model.config.text_config._attn_implementation == "sdpa"
    assert not any(isinstance(module.forward, PackedMixer) for module in model.modules()
                   if type(module).__name__.endswith("GatedDeltaNet"))


def test_a_video_in_one_run_of_tokens_is_refused(family):
    """A video written as Qwen2-VL writes one (all its frames one run, no timestamps) cannot take Qwen3's frame by
    frame positions: refused before the model runs, naming the layout its processor makes."""
    name, processor, model = family
    video = synthetic_video_example(processor, model.config, "a video <image> and its words")
    ids = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|video_pad|>", "<|vision_end|>"])
    one_run = [ids[0], *[ids[1]] * (int(video["video_grid_thw"].prod()) // 4), ids[2]]
    assembly = assemble(copy.deepcopy(model), CAUSAL_LM)
    with pytest.raises(BatchError, match="frame by frame"):
        assembly.collator([image_text_example(processor, "x"), {**video, "input_ids": [5, *one_run, 6]}])
    assembly.undo()


def test_a_qwen3_5_model_without_the_known_mixers_is_refused_unpatched():
    """A transformers version that renamed Qwen3.5's gated DeltaNet is refused before either patch is applied."""
    from padfree_plugins.builtin.architectures.qwen3_5_vl import QWEN3_5_VL
    from padfree_plugins.config.schema import PadfreeConfig

    name, processor, model = make_family("qwen3_5")
    towers, mixers = QWEN3_5_VL.traits
    renamed_mixers = dataclasses.replace(mixers, mixers=("RenamedGatedDeltaNet",))
    renamed = dataclasses.replace(QWEN3_5_VL, traits=(towers, renamed_mixers))
    _, patch_model = renamed.hooks()
    with pytest.raises(UnsupportedArchitectureError, match="RenamedGatedDeltaNet"):
        patch_model(model, renamed.architecture, None, None, PadfreeConfig())
    assert model.config.text_config._attn_implementation == "sdpa" and not model.model.visual._forward_pre_hooks
