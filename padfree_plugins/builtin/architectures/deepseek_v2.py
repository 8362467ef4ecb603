"""DeepSeek-V2 (and V2-Lite): multi-head latent attention (MLA) with a mixture of experts (shared + routed).

MLA compresses keys and values into a latent (``kv_lora_rank``) and expands them per head; queries and keys have
``qk_nope_head_dim + qk_rope_head_dim`` dimensions, values ``v_head_dim`` (128 vs 192 in the released models):
the attention backend gets a value head dim different from the query's. Routing is per token (greedy or
group-limited greedy); transformers computes no auxiliary loss for this family (``output_router_logits`` only
records the router logits).
"""

from padfree_plugins.builtin.architectures._features import window_features
from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("deepseek_v2", model_types=("deepseek_v2",), kind="decoder", features=window_features,
                         default_pooling="last",
                         description="DeepSeek-V2 / V2-Lite decoders (MLA, value head dim != query head dim; MoE)")]
