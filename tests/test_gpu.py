"""GPU checks (skipped without CUDA): the fast backends on real models equal the per-example reference."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import assemble
from tests.conftest import make_examples, split_packed, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _compare(model_type, attention, dtype, atol, **overrides):
    model = tiny_model(model_type, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                       **overrides).to("cuda", dtype)
    examples = make_examples([1, 200, 37, 64, 5, 64])
    with torch.no_grad():
        reference = [model(input_ids=torch.tensor([ex["input_ids"]], device="cuda")).last_hidden_state[0]
                     for ex in examples]
        assembly = assemble(model, {"task": "hidden_states", "attention": attention})
        try:
            batch = assembly.collator(examples).to("cuda")
            packed = model(**batch.model_inputs()).last_hidden_state
        finally:
            assembly.undo()
    worst = max((got.float() - want.float()).abs().max().item()
                for got, want in zip(split_packed(packed, batch), reference))
    assert worst < atol, f"{model_type} {attention} {dtype}: max |diff| {worst}"
    return assembly


@pytest.mark.parametrize("model_type,overrides", [("llama", dict(num_key_value_heads=2)),
                                                   ("mistral", dict(num_key_value_heads=2, sliding_window=16)),
                                                   ("bert", {})])
def test_varlen_backend_on_real_models(model_type, overrides):
    if model_type == "bert":
        overrides = dict(overrides, attention_probs_dropout_prob=0.0)
    assembly = _compare(model_type, "varlen", torch.bfloat16, 6e-2, **overrides)
    assert assembly.plan.backend.name == "varlen"


def test_auto_picks_varlen_and_falls_back_to_repad_for_fp32():
    assembly = _compare("llama", "auto", torch.float32, 1e-4, num_key_value_heads=2)
    assert assembly.plan.backend.name in ("varlen", "flash_attn") and assembly.plan.fallback.name == "repad"


@pytest.mark.parametrize("model_type,overrides", [("mistral", dict(num_key_value_heads=2, sliding_window=16)),
                                                   ("bert", dict(attention_probs_dropout_prob=0.0))])
def test_repad_backend_in_fp32(model_type, overrides):
    _compare(model_type, "repad", torch.float32, 1e-4, **overrides)


def test_gpt_oss_sinks_on_the_gpu_pick_repad_and_equal_the_eager_reference():
    """gpt-oss's attention sinks: auto picks repad (varlen / flash_attn take no sinks), exact in fp32 on CUDA."""
    from transformers import AutoModel

    from tests.conftest import tiny_config
    from tests.test_gpt_oss import GPT_OSS

    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config("gpt_oss", **GPT_OSS), attn_implementation="eager").to("cuda")
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.normal_(std=2.0)
    examples = make_examples([1, 20, 7, 7, 3])
    with torch.no_grad():
        reference = [model(input_ids=torch.tensor([ex["input_ids"]], device="cuda")).last_hidden_state[0]
                     for ex in examples]
        assembly = assemble(model, {"task": "hidden_states"})
        try:
            assert assembly.plan.backend.name == "repad" or assembly.plan.fallback.name == "repad"
            batch = assembly.collator(examples).to("cuda")
            packed = model(**batch.model_inputs()).last_hidden_state
        finally:
            assembly.undo()
    worst = max((got - want).abs().max().item() for got, want in zip(split_packed(packed, batch), reference))
    assert worst < 1e-4, f"gpt-oss sinks on CUDA: max |diff| {worst}"


@pytest.mark.parametrize("attention", ["varlen", "flash_attn"])
def test_mla_with_a_narrower_value_head_on_the_flash_kernels(attention):
    """DeepSeek-V3's MLA (value head dim < query's) through the one-head-dim FlashAttention kernels (values padded,
    output cropped: backends.one_head_dim), in bf16, against each example alone."""
    from padfree_plugins.modeling.attention.backends import flash_attn_unavailable
    from tests.test_decoders import DECODERS, causal_lm

    if attention == "flash_attn" and flash_attn_unavailable():
        pytest.skip(flash_attn_unavailable())
    model_type, overrides = DECODERS["deepseek_v3"]
    model = causal_lm(model_type, **overrides).to("cuda", torch.bfloat16).eval()
    examples = make_examples([1, 40, 9, 9, 3])
    with torch.no_grad():
        reference = [model(input_ids=torch.tensor([ex["input_ids"]], device="cuda")).logits[0] for ex in examples]
        assembly = assemble(model, {"task": "causal_lm", "attention": attention})
        try:
            batch = assembly.collator(examples).to("cuda")
            packed = model(**batch.model_inputs()).logits
        finally:
            assembly.undo()
    worst = max((got.float() - want.float()).abs().max().item()
                for got, want in zip(split_packed(packed, batch), reference))
    assert worst < 6e-2, f"MLA {attention}: max |diff| {worst}"


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid",
                                        "nemotron_h", "falcon_h1", "mamba2"])
@pytest.mark.parametrize("mixers", ["exact", "kernels"])
def test_hybrid_mixers_on_the_gpu_equal_each_example_alone(model_type, mixers):
    """The kernels route (flash-linear-attention, causal-conv1d, mamba-ssm with the boundaries) and the exact route
    on CUDA, fp32: packed logits equal each example alone. Skipped where the kernels' packages are missing."""
    from padfree_plugins.modeling import hybrids
    from padfree_plugins.modeling.mixers import missing_packages
    from tests.hybrids_common import LENGTHS, hybrid_model

    kernels = hybrids.MAMBA2_KERNELS if model_type in ("bamba", "granitemoehybrid", "nemotron_h", "falcon_h1",
                                                       "mamba2") else hybrids.GATED_DELTA_KERNELS
    if mixers == "kernels" and missing_packages(kernels):
        pytest.skip(f"needs {', '.join(missing_packages(kernels))}")
    model = hybrid_model(model_type).to("cuda")
    examples = make_examples(LENGTHS, seed=3)
    with torch.no_grad():
        reference = [model(input_ids=torch.tensor([ex["input_ids"]], device="cuda")).logits[0] for ex in examples]
        assembly = assemble(model, {"task": "causal_lm", "mixers": mixers,
                                    "task_options": {"labelled_logits_only": False}})
        try:
            batch = assembly.collator(examples).to("cuda")
            packed = model(**batch.model_inputs()).logits
        finally:
            assembly.undo()
    worst = max((got - want).abs().max().item() for got, want in zip(split_packed(packed, batch), reference))
    assert worst < 1e-3, f"{model_type} mixers={mixers}: max |diff| {worst}"


@pytest.mark.parametrize("window", [None, 5])
def test_flash_attn_over_shared_prompts_equals_exact(window):
    """Shared prefixes on flash-attn (bf16): a segment's queries over ``[prompt keys ; own keys]``, the causal mask
    aligned to the bottom right, equal the exact backend's (which tests/test_prefix_sharing.py checks against each
    row whole) within bf16 rounding; the gradients of the one prompt copy too."""
    pytest.importorskip("flash_attn")
    from padfree_plugins.builtin.backends import EXACT_FEATURES, SHARED_FEATURES
    from padfree_plugins.contract.declarations import FEATURES, AttentionBackend
    from padfree_plugins.modeling.attention import PadfreeAttention
    from padfree_plugins.modeling.attention.backends import exact_varlen, flash_attn_varlen
    from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, SharedPrefixes

    class Attention(torch.nn.Module):
        is_causal = True

    lengths, parents = [40, 7, 90, 1, 33, 12, 12], [-1, 0, 0, 0, -1, 4, 4]
    structure = SharedPrefixes.build(lengths, parents, "cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (8, 2, 2))
    outputs = []
    for backend in (AttentionBackend("flash_attn", flash_attn_varlen, features=frozenset(FEATURES) | SHARED_FEATURES),
                    AttentionBackend("exact", exact_varlen, features=EXACT_FEATURES | SHARED_FEATURES)):
        out, _ = PadfreeAttention(backend)(Attention(), q, k, v, None, sliding_window=window, cu_seq_lens_q=cu,
                                           max_length_q=max(lengths), **{SHARED_PREFIXES_KEY: structure})
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        outputs.append((out.float(), [g.float() for g in grads]))
    (flash, flash_grads), (exact, exact_grads) = outputs
    assert (flash - exact).abs().max().item() < 2e-2
    for mine, theirs in zip(flash_grads, exact_grads):
        assert (mine - theirs).abs().max().item() < 5e-2 * max(theirs.abs().max().item(), 1.0)


@pytest.mark.parametrize("attention", ["varlen", "repad"])
def test_a_compiled_training_step_waits_for_the_device_nowhere(attention):
    """Compiled on a GPU: the compiled patched model (bf16, ``varlen`` / ``repad``) trains steps on rows of changing
    length with ``torch.cuda.set_sync_debug_mode("error")``: any host sync in the forward or backward raises. The
    first steps compile (dynamo may sync then); the steps after it are the ones checked."""
    model = tiny_model("llama", "causal_lm", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=512).to("cuda", torch.bfloat16 if attention == "varlen" else torch.float32)
    model.train()
    assembly = assemble(model, {"task": "causal_lm", "attention": attention})
    compiled = torch.compile(model, fullgraph=True)
    batches = [assembly.collator([dict(ex, labels=ex["input_ids"]) for ex in make_examples(lengths, seed=i)])
               .to("cuda") for i, lengths in enumerate([[40, 7], [200, 3, 64], [9, 9, 9, 30], [120], [5, 77, 2]])]
    for batch in batches[:2]:
        assembly.forward(compiled, batch).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[2:]:
            assembly.forward(compiled, batch).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
