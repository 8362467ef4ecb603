"""DeepSeek-V3 / R1, and Kimi-K2 (the same ``deepseek_v3`` model type): multi-head latent attention (MLA) with
interleaved rotary weights (``rope_interleave``), the first ``first_k_dense_replace`` layers dense, the rest a
mixture of experts routed per token through group-limited top-k with a score-correction bias.

Queries and keys have ``qk_nope_head_dim + qk_rope_head_dim`` dimensions (192), values ``v_head_dim`` (128): the
attention backend gets a value head dim different from the query's. The routing is auxiliary-loss-free:
transformers computes no load-balancing loss for this family. Multi-token-prediction layers are not part of the
transformers model.
"""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("deepseek_v3", model_types=("deepseek_v3",), kind="decoder", features=window_features,
                         default_pooling="last",
                         description="DeepSeek-V3 / R1 and Kimi-K2 decoders (MLA, value head dim != query head "
                                     "dim; MoE)")]
