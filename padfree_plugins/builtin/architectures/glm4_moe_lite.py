"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's multi-head latent attention (MLA: compressed KV latent,
query head dim ``qk_nope_head_dim + qk_rope_head_dim``, value head dim ``v_head_dim``: both 256 in the released
model, but a config may make them differ) with GLM's mixture of experts; dense or sparse MLP per layer
(``mlp_layer_types``). transformers computes no load-balancing loss."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("glm4_moe_lite", model_types=("glm4_moe_lite",), kind="decoder", features=window_features,
                         default_pooling="last", description="Z.ai GLM-4.7-Flash decoders (MLA; MoE)")]
