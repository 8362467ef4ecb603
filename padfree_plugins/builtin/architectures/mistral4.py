"""Mistral 4 (Mistral Small 4): DeepSeek-V3's multi-head latent attention (MLA) and mixture of experts, with
Llama 4's position-dependent query scaling (``llama_4_scaling_beta``), which is read from ``position_ids`` and so
restarts with every packed example. The query and value head dims (``qk_nope_head_dim + qk_rope_head_dim`` and
``v_head_dim``) are both 128 in the released model, but a config may make them differ. transformers computes no
load-balancing loss for this family, and ``AutoModelForCausalLM`` does not map it in transformers 5.23 (build
``Mistral4ForCausalLM`` directly)."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("mistral4", model_types=("mistral4",), kind="decoder", features=window_features,
                         default_pooling="last", description="Mistral Small 4 decoders (MLA; MoE)")]
