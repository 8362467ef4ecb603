"""Every builtin decoder family trains padding-free exactly as padded (CPU fp32), and unknown decoders are probed.

For each family: the causal-LM loss of a packed batch equals the loss of the same examples padded (right padding,
attention mask, -100 labels on padding) within 1e-5, and every parameter's gradient within 1e-4. The tiny configs
switch on what makes each family special: sliding windows shorter than the examples, Gemma 2's soft-capping, MoE
routers with their load-balancing loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from padfree_plugins import ConfigError, PluginHost, UnsupportedArchitectureError, assemble, patch_of, plan
from padfree_plugins.modeling.probe import run_probe
from padfree_plugins.packing.padded import pad_examples
from tests.conftest import VOCAB, make_examples, tiny_config

MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
#: Multi-head latent attention (DeepSeek-V2/V3, Mistral 4, GLM-4.7-Flash): queries and keys of 16 + 8 dims, values of
#: 12 — the value head dim differs from the query's, as in the released models (192 vs 128).
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
#: DeepSeek-style MoE: layer 0 dense, layer 1 routed (4 experts, top 2) plus a shared expert. transformers computes no
#: auxiliary loss for these families (DeepSeek-V2/V3, GLM-4.5, Mistral 4), so output_router_logits stays off: on, it
#: only records the router logits, and TRL's fused forward then adds Mixtral's loss, reading ``config.num_experts``,
#: which they name ``n_routed_experts`` (TRL's padded run fails with an AttributeError).
DEEPSEEK_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                    first_k_dense_replace=1)
#: YaRN with Llama 4's query scaling (Ministral 3, Mistral 4) over an original context of 8 positions, so that the
#: scale grows inside the long examples (positions 8..19) and must restart with each packed example.
LLAMA4_SCALED_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=32.0, original_max_position_embeddings=8,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
DECODERS = {
    "llama": ("llama", dict(num_key_value_heads=2)),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=4)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, sliding_window=4, num_local_experts=4, **MOE)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2_moe": ("qwen2_moe", dict(num_key_value_heads=2, num_experts=4, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, **MOE)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
                                    **MOE)),
    "gemma": ("gemma", dict(num_key_value_heads=2, head_dim=16)),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=2.0,
                              final_logit_softcapping=5.0)),
    "gemma3": ("gemma3_text", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                   layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(num_key_value_heads=2)),
    "granite": ("granite", dict(num_key_value_heads=2, attention_multiplier=0.3)),
    "olmo2": ("olmo2", dict(num_key_value_heads=2)),
    "gpt_neox": ("gpt_neox", dict()),
    "starcoder2": ("starcoder2", dict(num_key_value_heads=2, sliding_window=4)),
    "smollm3": ("smollm3", dict(num_key_value_heads=2, no_rope_layers=[1, 0], use_sliding_window=True,
                                sliding_window=4)),
    "olmo": ("olmo", dict(num_key_value_heads=2, clip_qkv=0.5)),
    "olmo3": ("olmo3", dict(num_key_value_heads=2, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"])),
    "phi": ("phi", dict(num_key_value_heads=2, qk_layernorm=True)),
    "glm4": ("glm4", dict(num_key_value_heads=2, head_dim=16)),
    "granitemoe": ("granitemoe", dict(num_key_value_heads=2, num_local_experts=4, attention_multiplier=0.3, **MOE)),
    # -- 2025-26 families -------------------------------------------------------------------------------------------
    "deepseek_v2": ("deepseek_v2", dict(**{**MLA, "q_lora_rank": None}, **DEEPSEEK_MOE, n_group=2, topk_group=1,
                                        topk_method="group_limited_greedy")),
    "deepseek_v3": ("deepseek_v3", dict(**MLA, **DEEPSEEK_MOE, n_group=2, topk_group=1)),
    "mistral4": ("mistral4", dict(**MLA, **DEEPSEEK_MOE, rope_parameters=LLAMA4_SCALED_YARN)),
    "glm4_moe_lite": ("glm4_moe_lite", dict(**MLA, **DEEPSEEK_MOE)),
    "glm4_moe": ("glm4_moe", dict(num_key_value_heads=2, head_dim=16, use_qk_norm=True, **DEEPSEEK_MOE, n_group=2,
                                  topk_group=1)),
    "gemma3n": ("gemma3n_text", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                     num_kv_shared_layers=1, activation_sparsity_pattern=[0.95, 0.0, 0.0],
                                     hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, laurel_rank=8)),
    "gemma4": ("gemma4_text", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                                   attention_k_eq_v=True, sliding_window=4,
                                   layer_types=["full_attention", "sliding_attention", "full_attention"],
                                   num_kv_shared_layers=1, hidden_size_per_layer_input=8,
                                   vocab_size_per_layer_input=VOCAB, enable_moe_block=True, num_experts=4,
                                   top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0)),
    "ministral3": ("ministral3", dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                      rope_parameters=LLAMA4_SCALED_YARN)),
    "exaone4": ("exaone4", dict(num_key_value_heads=2, sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"])),
    "ernie4_5": ("ernie4_5", dict(num_key_value_heads=2, head_dim=16, use_bias=True)),
    "ernie4_5_moe": ("ernie4_5_moe", dict(num_key_value_heads=2, head_dim=16, moe_num_experts=4, moe_k=2,
                                          moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
                                          output_router_logits=True, router_aux_loss_coef=0.1)),
    "minimax_m2": ("minimax_m2", dict(num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=4, **MOE)),
    "olmoe": ("olmoe", dict(num_key_value_heads=2, num_experts=4, **MOE)),
    "flex_olmo": ("flex_olmo", dict(num_key_value_heads=2, num_experts=4, **MOE)),
    "seed_oss": ("seed_oss", dict(num_key_value_heads=2, head_dim=16, attention_bias=True, attention_out_bias=True,
                                  attention_dropout=0.0, residual_dropout=0.0)),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(num_key_value_heads=2, head_dim=16)),
    "apertus": ("apertus", dict(num_key_value_heads=2)),
    "gpt_oss": ("gpt_oss", dict(num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=4,
                                layer_types=["sliding_attention", "full_attention"], **MOE)),
    "lfm2": ("lfm2", dict(num_key_value_heads=2, layer_types=["conv", "full_attention"])),
}
LENGTHS = [1, 13, 6, 20, 2, 6]
#: Causal-LM classes that transformers 5.23 leaves out of ``AutoModelForCausalLM`` (it maps Mistral 4 for pretraining
#: and image-text-to-text only).
CAUSAL_LM_CLASSES = {"mistral4": "Mistral4ForCausalLM"}


def causal_lm(model_type: str, **overrides):
    """A tiny causal LM, fp32, seeded; eager attention where transformers refuses sdpa (Gemma 2 soft-capping,
    gpt-oss sinks).

    Gemma 2's query and key projections are scaled up so that attention scores reach the soft-cap (random
    initial weights give scores far below it, where capping changes nothing); gpt-oss's sinks start random, large
    enough to take a real share of every softmax."""
    torch.manual_seed(0)
    implementation = "eager" if model_type in ("gemma2", "gpt_oss") else "sdpa"
    config = tiny_config(model_type, **copy.deepcopy(overrides))  # some configs edit what they get (rope_parameters)
    if model_type in CAUSAL_LM_CLASSES:
        model = getattr(transformers, CAUSAL_LM_CLASSES[model_type])._from_config(
            config, attn_implementation=implementation)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    if model_type == "gemma2":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(6)
                layer.self_attn.k_proj.weight.mul_(6)
    if model_type == "gpt_oss":
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator) * 2)
    return model


def padded_batch(examples):
    return pad_examples(examples, ("input_ids", "labels"), pad_token_id=1)


def outputs_and_grads(model, inputs):
    """The loss (MoE auxiliary loss included), the logits and every parameter's gradient of one training step."""
    model.zero_grad(set_to_none=True)
    output = model(**inputs, use_cache=False)
    output.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), output.logits.detach(), grads


def loss_and_grads(model, inputs):
    loss, _, grads = outputs_and_grads(model, inputs)
    return loss, grads


def assert_packed_logits_equal_padded(packed, padded, batch, atol=1e-5):
    """Each example's packed logits (cut at ``cu_seq_lens_q``) equal its row of the padded logits, real tokens only."""
    cu = batch["cu_seq_lens_q"].tolist()
    for i in range(len(cu) - 1):
        torch.testing.assert_close(packed[0, cu[i]:cu[i + 1]], padded[i, :cu[i + 1] - cu[i]], atol=atol, rtol=atol,
                                   msg=lambda m: f"example {i}: {m}")


@pytest.mark.parametrize("name", DECODERS)
def test_packed_loss_and_gradients_equal_padded(name):
    model_type, overrides = DECODERS[name]
    model = causal_lm(model_type, **overrides).train()  # dropout is 0 in these configs; MoE routers in train mode
    assert_packed_step_equals_padded(model, make_examples(LENGTHS, seed=1), name)


def assert_packed_step_equals_padded(model, examples, plugin, config=None, check=None):
    """One training step packed (through ``plugin``; ``check(model)`` runs while patched) equals a right-padded
    one: loss within 1e-5, every example's logits within 1e-5, every gradient within 1e-4."""
    want_loss, want_logits, want_grads = outputs_and_grads(model, padded_batch(examples))
    assembly = assemble(model, {"task": "causal_lm", **(config or {})})
    try:
        assert assembly.plan.architecture_plugin == plugin
        if check is not None:
            check(model)
        batch = assembly.collator(examples)
        got_loss, got_logits, got_grads = outputs_and_grads(model, assembly.forward.inputs(batch))
    finally:
        assembly.undo()
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert_packed_logits_equal_padded(got_logits, want_logits, batch)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) > 5
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def packed_logits(model, examples):
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        with torch.no_grad():
            return model(**assembly.collator(examples).model_inputs()).logits
    finally:
        assembly.undo()


def test_gemma2_softcapping_and_window_are_really_exercised():
    """Gemma 2's soft-capping and its window (4, shorter than the examples) both change the packed outputs."""
    examples = make_examples([20, 13, 9])
    _, overrides = DECODERS["gemma2"]
    reference = packed_logits(causal_lm("gemma2", **overrides).eval(), examples)
    uncapped = packed_logits(causal_lm("gemma2", **{**overrides, "attn_logit_softcapping": None}).eval(), examples)
    unwindowed = packed_logits(causal_lm("gemma2", **{**overrides, "sliding_window": 64}).eval(), examples)
    assert (reference - uncapped).abs().max() > 1e-3
    assert (reference - unwindowed).abs().max() > 1e-3
    features = plan(tiny_config("gemma2", **overrides), {"task": "causal_lm"}, device_type="cpu").features
    assert {"softcap", "sliding_window", "gqa", "causal"} <= features


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "ernie4_5_moe", "minimax_m2",
                                  "olmoe", "flex_olmo"])
def test_moe_router_loss_is_part_of_the_packed_loss(name):
    """The load-balancing loss is included (output_router_logits) and equals the padded one, real tokens only."""
    model_type, overrides = DECODERS[name]
    model = causal_lm(model_type, **overrides).eval()
    examples = make_examples(LENGTHS, seed=2)
    with torch.no_grad():
        padded = model(**padded_batch(examples), use_cache=False)
        assembly = assemble(model, {"task": "causal_lm"})
        try:
            packed = model(**assembly.forward.inputs(assembly.collator(examples)), use_cache=False)
        finally:
            assembly.undo()
    assert packed.aux_loss is not None and float(packed.aux_loss) > 0
    torch.testing.assert_close(packed.aux_loss, padded.aux_loss, atol=1e-5, rtol=1e-5)


def test_every_listed_decoder_is_its_own_plugin():
    architectures = PluginHost().architectures()
    for name, (model_type, _) in DECODERS.items():
        spec, plugin = architectures[model_type]
        assert (spec.name, plugin, spec.kind) == (name, name, "decoder")


# -- unknown decoders: the equivalence probe ---------------------------------------------------------------------


def test_unknown_decoder_is_refused_without_probe():
    model = causal_lm("helium", head_dim=16)
    with pytest.raises(UnsupportedArchitectureError, match="architecture: probe"):
        assemble(model, {"task": "causal_lm"})


def test_probe_accepts_a_safe_unknown_decoder_and_leaves_state_alone():
    model = causal_lm("helium", head_dim=16).train()
    rng = torch.random.get_rng_state()
    assembly = assemble(model, {"task": "causal_lm", "architecture": "probe"})
    try:
        assert assembly.plan.architecture_plugin == "probe" and assembly.plan.architecture.name == "probed:helium"
        assert model.training and torch.equal(torch.random.get_rng_state(), rng)
        examples = make_examples([3, 11])
        with torch.no_grad():
            logits = model(**assembly.collator(examples).model_inputs()).logits
            alone = model(input_ids=torch.tensor([examples[1]["input_ids"]])).logits
        torch.testing.assert_close(logits[0, 3:], alone[0], atol=1e-5, rtol=1e-5)
    finally:
        assembly.undo()


def test_probe_refuses_stablelm_and_restores_the_model():
    """StableLM's decoder layers do not pass **kwargs on to attention: the boundaries never arrive."""
    model = causal_lm("stablelm", num_key_value_heads=2)
    with pytest.raises(UnsupportedArchitectureError) as info:
        assemble(model, {"task": "causal_lm", "architecture": "probe"})
    message = str(info.value)
    assert "'stablelm' failed the padding-free equivalence probe" in message and "writing-a-plugin" in message
    assert patch_of(model) is None and model.config._attn_implementation == "sdpa"


def test_probe_measures_a_decoder_that_runs_packed_but_wrong(monkeypatch):
    """GPT-2 (undeclared, absolute learned positions) passes the probe; made to number positions across the whole
    row instead of per example, it runs packed without error but wrong, and the probe measures it."""
    model = causal_lm("gpt2", n_embd=64, n_layer=2, n_head=4)
    assembly = assemble(model, {"task": "causal_lm", "architecture": "probe"})
    try:
        result = run_probe(assembly.model)
        assert result.ok and result.error < 1e-5
    finally:
        assembly.undo()
    table = model.transformer.wpe
    original = table.forward
    monkeypatch.setattr(table, "forward", lambda ids: original(torch.arange(ids.shape[-1])[None]))
    with pytest.raises(UnsupportedArchitectureError, match=r"differ from each example run alone by \d"):
        assemble(model, {"task": "causal_lm", "architecture": "probe"})
    assert patch_of(model) is None


MASK_ONLY_STRUCTURE = {  # attention structure these models put only in the mask they build, never in attention's kwargs
    "llama4_text": dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, intermediate_size_mlp=128,
                        attention_chunk_size=8),  # chunked attention
    "phimoe": dict(num_key_value_heads=2, num_local_experts=4, sliding_window=4),  # the window is in the mask only
}


@pytest.mark.parametrize("model_type", MASK_ONLY_STRUCTURE)
def test_probe_refuses_structure_that_only_the_models_own_mask_carries(model_type):
    """The patched attention never sees a structure that lives only in the model's own mask, so packed and alone
    through the patched model agree, both without it (the probe used to accept both, and training was silently
    wrong by ~2e-3). It is now refused before anything is measured: Llama 4's config declares chunked attention,
    and PhiMoE's window reaches no attention call (tests/test_probe.py covers every size)."""
    model = causal_lm(model_type, **MASK_ONLY_STRUCTURE[model_type])
    reason = {"llama4_text": "chunked attention", "phimoe": "sliding window that no attention call receives"}
    with pytest.raises(UnsupportedArchitectureError, match=reason[model_type]):
        assemble(model, {"task": "causal_lm", "architecture": "probe"})
    assert patch_of(model) is None and model.config._attn_implementation == "sdpa"


def test_probe_keeps_declared_architectures():
    model = causal_lm("qwen2", num_key_value_heads=2)
    assembly = assemble(model, {"task": "causal_lm", "architecture": "probe"})
    try:
        assert assembly.plan.architecture_plugin == "qwen2"
    finally:
        assembly.undo()


def test_a_forced_architecture_must_match_a_declared_model_type():
    """architecture: bert on a RoBERTa model would start positions at 0 instead of 2: refused, naming the right one."""
    with pytest.raises(ConfigError, match="'roberta', which 'roberta' declares"):
        plan(tiny_config("roberta"), {"task": "hidden_states", "architecture": "bert"})
    assert plan(tiny_config("llama"), {"architecture": "llama"}).architecture_plugin == "llama"


def test_a_forced_architecture_on_an_undeclared_model_type_is_probed():
    model = causal_lm("helium", head_dim=16)
    assembly = assemble(model, {"task": "causal_lm", "architecture": "llama"})
    try:
        assert assembly.plan.architecture.name == "llama" and assembly.plan.architecture_plugin == "probe"
    finally:
        assembly.undo()
    gpt2 = causal_lm("gpt2", n_embd=64, n_layer=2, n_head=4)
    with pytest.raises(UnsupportedArchitectureError, match="equivalence probe"):
        assemble(gpt2, {"task": "causal_lm", "architecture": "roberta"})  # positions from 2: measured wrong
    assert patch_of(gpt2) is None
