"""GLM-4.5 / 4.6 / 4.7 (and GLM-4.5-Air): GQA attention with partial rotary embeddings (``partial_rotary_factor``),
optional per-head q/k RMSNorm (``use_qk_norm``), dense first layers (``first_k_dense_replace``) and a
DeepSeek-V3-style mixture of experts routed per token (sigmoid scores, group-limited top-k, shared experts).
transformers computes no load-balancing loss for this family."""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("glm4_moe", model_types=("glm4_moe",), kind="decoder", features=window_features,
                         default_pooling="last", description="Z.ai GLM-4.5 / 4.6 / 4.7 MoE decoders")]
