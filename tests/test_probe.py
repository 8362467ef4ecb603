"""The equivalence probe cannot be fooled (``architecture: probe`` on model types no plugin declares).

It refuses, without measuring, what small rows cannot clear — sequence mixers outside attention (LFM2's short
convolution), structure kept in a model's own mask or computed from the row's positions (Llama 4's chunks and
attention temperature, PhiMoE's window) — and it measures with rows longer than every declared length, with the
tokens a model treats specially, at a tolerance near fp32 noise, reading kind and positions from the model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from padfree_plugins import UnsupportedArchitectureError, assemble, patch_of
from padfree_plugins.modeling import probe
from padfree_plugins.testing import leak_across_boundaries
from tests.conftest import tiny_config

PROBE = {"task": "hidden_states", "architecture": "probe"}


def build(model_type: str, model_class=AutoModel, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return model_class.from_config(tiny_config(model_type, **overrides), attn_implementation="sdpa").eval()


def assert_refused(model, match: str, config=PROBE):
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedArchitectureError, match=match):
        assemble(model, config)
    assert patch_of(model) is None and model.config._attn_implementation == before


# -- refused without measuring ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("model_type,extra", [
    ("lfm2", dict(num_key_value_heads=2, layer_types=["conv", "full_attention"])),
    ("lfm2_moe", dict(num_key_value_heads=2, layer_types=["conv", "full_attention"], num_experts=4,
                      num_experts_per_tok=2, num_dense_layers=0, moe_intermediate_size=32)),
])
def test_lfm2_is_refused_at_every_seed(model_type, extra, seed):
    """LFM2's short causal conv runs over the whole packed row (its leak, ~1e-3 relative, sat under the old 1e-3
    tolerance for some seeds): the probe refuses it for the module itself, whatever the weights (the builtin
    ``lfm2`` plugin, which restarts the conv per example, is blocked here so that the probe is what decides)."""
    assert_refused(build(model_type, seed=seed, **extra), "mixes the sequence outside attention",
                   {**PROBE, "plugins": {"block": ["lfm2"]}})


def test_llama4_with_its_shipped_chunk_and_three_3000_token_examples():
    """Llama 4 text as shipped (attention_chunk_size 8192, attention temperature from positions past floor_scale
    8192): refused at every size — 3 x 3,000-token examples included, where the old probe's short rows saw
    nothing (and training was ~7e-3 off in gradients)."""
    model = build("llama4_text", AutoModelForCausalLM, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                  intermediate_size_mlp=128, attention_chunk_size=8192, floor_scale=8192,
                  max_position_embeddings=16384)
    assert_refused(model, "chunked attention.*temperature computed from positions", {"task": "causal_lm",
                                                                                      "architecture": "probe"})
    result = probe.run_probe(model, lengths=(3000, 3000, 3000))
    assert not result.ok and not result.measured


@pytest.mark.parametrize("window", [4, 64, 4096])
def test_phimoe_window_is_refused_at_every_size(window):
    """PhiMoE's window lives in its mask only: whatever its size, no attention call receives it."""
    model = build("phimoe", AutoModelForCausalLM, num_key_value_heads=2, num_local_experts=2, sliding_window=window)
    assert_refused(model, "sliding window that no attention call receives", {"task": "causal_lm",
                                                                             "architecture": "probe"})


# -- measured: rows, tokens, tolerance --------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [33, 40, 64, 100, 129, 257])
@pytest.mark.parametrize("seed", [0, 1])
def test_esm_with_token_dropout_is_refused_for_every_vocab_size(vocab, seed):
    """ESM's token_dropout rescales embeddings by the share of <mask> tokens in the *row*: packed, one example's
    masks change every other example. The probe's rows hold masks in a share that differs per example, so it is
    refused for every vocabulary size (the real 33-token one was refused only by luck before)."""
    model = build("esm", seed=seed, vocab_size=vocab, token_dropout=True, mask_token_id=vocab - 1, pad_token_id=1,
                  position_embedding_type="absolute")
    with pytest.raises(UnsupportedArchitectureError, match="differ from each example run alone"):
        assemble(model, {**PROBE, "plugins": {"block": ["esm"]}})
    assert patch_of(model) is None


def test_esm_without_token_dropout_passes_with_positions_after_the_padding_index():
    """The same ESM without token_dropout is exact packed: its positions start at padding_idx + 1, read from the
    model's position table (the old probe packed them from 0 and refused it)."""
    model = build("esm", vocab_size=40, token_dropout=False, mask_token_id=39, pad_token_id=1,
                  position_embedding_type="absolute")
    assembly = assemble(model, {**PROBE, "plugins": {"block": ["esm"]}})
    try:
        assert assembly.plan.position_start == 2 and assembly.plan.architecture.kind == "encoder"
    finally:
        assembly.undo()


@pytest.mark.parametrize("strength", [1e-4, 1e-5])
def test_a_tiny_leak_is_caught(strength):
    """The probe runs in float64 at a relative tolerance of 1e-6: a layer leaking 1e-5 of the previous token across
    each boundary is refused (the old fp32 probe, at an absolute-ish 1e-3, let 1e-4 through)."""
    model = build("helium", AutoModelForCausalLM, head_dim=16)
    accepted = assemble(model, {"task": "causal_lm", "architecture": "probe"})
    accepted.undo()
    with leak_across_boundaries(model, strength=strength):
        patched = patch_of(model)
        assert patched is None
        with pytest.raises(UnsupportedArchitectureError, match="differ from each example run alone"):
            assemble(model, {"task": "causal_lm", "architecture": "probe"})


def test_rows_straddle_every_declared_length():
    config = tiny_config("mistral", sliding_window=16, max_position_embeddings=256,
                         rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                          "rope_theta": 10000.0})
    lengths = probe.probe_lengths(config)
    assert {15, 19, 63, 67} <= set(lengths) and 1 in lengths and lengths.count(9) == 2
    assert probe.declared_lengths(config) == [16, 64]


def test_rows_hold_the_special_tokens_in_shares_that_differ_per_example():
    config = tiny_config("esm", vocab_size=40, mask_token_id=39, pad_token_id=1, cls_token_id=0, eos_token_id=2)
    examples = probe.probe_examples(config, 40, (1, 9, 9, 23, 4))
    long = [ex["input_ids"] for ex in examples if len(ex["input_ids"]) >= 3]
    assert all(ids[0] == 0 and ids[-1] == 2 for ids in long)
    shares = [ids.count(39) / len(ids) for ids in long]
    assert len(set(shares)) == len(shares) and max(shares) > 0
    assert any(0 in ids[1:-1] or 2 in ids[1:-1] for ids in long)  # ids next to the pad id (0 and 2) in the middle


def test_a_16_bit_model_is_probed_in_float64_and_restored():
    model = build("helium", AutoModelForCausalLM, head_dim=16).to(torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assembly = assemble(model, {"task": "causal_lm", "architecture": "probe"})
    try:
        assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
    finally:
        assembly.undo()


# -- read from the model ----------------------------------------------------------------------------------------


def test_kind_is_read_from_the_model_not_its_heads():
    """A bidirectional model without a masked-LM head (LayoutLM's attention modules even lack is_causal) is an
    encoder: read from the model, which looks both ways."""
    layoutlm = build("layoutlm")
    assert probe.reads_both_ways(layoutlm) and probe.probed_architecture(layoutlm.config, layoutlm).kind == "encoder"
    helium = build("helium", head_dim=16)
    assert not probe.reads_both_ways(helium)


def test_layoutlm_text_is_exact_once_its_kind_is_read():
    """LayoutLM's attention modules have no is_causal: attention takes the architecture's kind (an encoder)."""
    model = build("layoutlm")
    assembly = assemble(model, {**PROBE, "plugins": {"block": ["layoutlm"]}})
    assembly.undo()


def test_a_heterogeneous_config_is_read_per_layer():
    """EmbeddingGemma 2's text model declares per-layer key/value heads (reading them globally raises
    AmbiguousGlobalPerLayerAttributeError, which crashed the probe): read per layer, it is a bidirectional
    encoder with GQA and windows, and exact packed."""
    model = build("embedding_gemma2_text", num_hidden_layers=2, head_dim=16, sliding_window=8,
                  hidden_size_per_layer_input=16)
    assert model.config.is_heterogeneous
    assembly = assemble(model, {**PROBE, "plugins": {"block": ["embedding_gemma2"]}})
    try:
        assert assembly.plan.architecture.kind == "encoder"
        assert {"bidirectional", "gqa", "sliding_window"} <= assembly.plan.features
    finally:
        assembly.undo()


def test_names_alike_but_not_mixers_are_not_refused():
    """The sweep found the mixer pattern matching the 'ssM' of GptOssMLP (case-insensitive 'Ssm')."""
    for name in ("GptOssMLP", "SeedOssModel", "CohereCompassModel", "Conv1D"):
        assert not probe.SEQUENCE_MIXER_NAMES.search(name) or name == "Conv1D"
    for name in ("MambaMixer", "Lfm2ShortConv", "Qwen3NextGatedDeltaNet", "Zamba2MambaMixer", "RwkvSelfAttention"):
        assert probe.SEQUENCE_MIXER_NAMES.search(name), name


def test_an_attention_kind_the_probe_does_not_know_is_refused_with_that_reason():
    config = tiny_config("llama")
    config.layer_types = ["full_attention", "minimax_m3_sparse", "moe", "reference_sliding_attention", "conv"]
    assert probe.unknown_attention_kinds(config) == ["minimax_m3_sparse", "reference_sliding_attention"]
    assert probe.sequence_mixers(build("llama")) == []


@pytest.mark.parametrize("model_type,extra", [("granite", dict(num_key_value_heads=2))])
def test_fp32_parts_of_a_forward_stay_under_the_tolerance(model_type, extra):
    """Models that force parts of their forward to fp32 (eager softmax in fp32, MoE routers) differ packed vs alone
    by up to 2e-7 in the float64 probe (the sweep's largest): accepted at 1e-6."""
    assert probe.RELATIVE_TOLERANCE >= 1e-6 > 2e-7
    model = build(model_type, AutoModelForCausalLM, **extra)
    assemble(model, {"task": "causal_lm", "architecture": "probe", "plugins": {"block": [model_type]}}).undo()
