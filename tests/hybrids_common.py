"""Tiny configs of every hybrid family (attention beside gated-DeltaNet, KDA, Mamba1 or Mamba2 layers), for the
hybrid tests: mixer heads small, scan chunks short (16) so that examples span several chunks, at least one layer
of each kind, MoE layers where the family has them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.conftest import tiny_config

GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4, head_dim=16, num_key_value_heads=2, num_hidden_layers=3,
                   layer_types=["linear_attention", "full_attention", "linear_attention"])
#: Routed experts with their load-balancing loss in the loss (Kimi-Linear and Nemotron-H compute none).
AUX_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)
SPARSE_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  **AUX_LOSS)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
              mamba_chunk_size=16, num_key_value_heads=2)

#: model type -> config overrides (on top of the tiny defaults).
HYBRIDS = {
    "qwen3_5_text": GATED_DELTA,
    "qwen3_5_moe_text": {**GATED_DELTA, **SPARSE_MOE},
    "qwen3_next": {**GATED_DELTA, **SPARSE_MOE},
    "olmo_hybrid": GATED_DELTA,
    "kimi_linear": dict(num_hidden_layers=3, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"], num_local_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2),
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "moe", "mamba"], num_hidden_layers=4,
                       num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                       ssm_state_size=8, conv_kernel=4, expand=1, chunk_size=16, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32),
    "granitemoehybrid": {**MAMBA2, "layer_types": ["mamba", "attention", "mamba"], "num_hidden_layers": 3,
                         "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32, **AUX_LOSS},
    "bamba": {**MAMBA2, "attn_layer_indices": [1], "num_hidden_layers": 3},
    "falcon_h1": {**MAMBA2, "mamba_d_ssm": 64, "num_hidden_layers": 2, "head_dim": 16},
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=1, num_key_value_heads=2, **AUX_LOSS),
    "mamba": dict(state_size=8, conv_kernel=4, expand=1, num_hidden_layers=2, use_mambapy=False),
    "falcon_mamba": dict(state_size=8, conv_kernel=4, expand=1, num_hidden_layers=2, use_mambapy=False),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, conv_kernel=4, expand=1, n_groups=2, chunk_size=16,
                   num_hidden_layers=2),
}
#: Families without attention layers.
ATTENTION_FREE = ("mamba", "falcon_mamba", "mamba2")
#: Lengths that a boundary can hurt: 1 token, shorter than the conv kernel (4) and the scan chunk (16, and the
#: gated delta rule's 64), equal to a chunk, several chunks, two examples of one length.
LENGTHS = [1, 3, 70, 2, 16, 150, 5, 33, 70]


def hybrid_model(model_type: str, seed: int = 0, **overrides):
    """The tiny causal LM of ``model_type``, fp32, eval mode."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **{**HYBRIDS[model_type], **overrides})
    attention = {} if model_type in ATTENTION_FREE else {"attn_implementation": "sdpa"}
    return AutoModelForCausalLM.from_config(config, **attention).float().eval()


def slow(model):
    """The model with slow decays: every ``A_log`` at log(0.01) and ``dt_bias`` at -4, so that a mixer's state
    lasts for hundreds of tokens."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.fill_(-4.6)
            elif name.endswith("dt_bias"):
                parameter.fill_(-4.0)
    return model
