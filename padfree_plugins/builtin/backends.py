"""Builtin attention backends: exact (any device), repad (accelerators, any dtype), torch varlen_attn (CUDA only,
torch >= 2.10), flash-attn (CUDA only, if installed). On a CPU only ``exact`` runs (``auto`` picks it there).

A backend's ``description`` completes the error for a backend that cannot run on a device (``assembly``): it says
what the kernel is and what it needs."""

from __future__ import annotations

from padfree_plugins.contract.declarations import FEATURES, AttentionBackend
from padfree_plugins.contract.hookspecs import hookimpl
from padfree_plugins.modeling.attention import BLOCKS_FEATURE, backends
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_FEATURE

#: What the exact kernels implement: every feature, attention sinks and bidirectional blocks (Gemma 3's images)
#: included. The varlen kernels take causal or not only: they implement no blocks, and ``auto`` never picks them for
#: a model that uses blocks.
EXACT_FEATURES = frozenset(FEATURES) | {"sinks", BLOCKS_FEATURE}
#: ``exact`` also takes shared prefixes (queries aligned to the end of their keys: its per-shape sdpa calls with an
#: explicit mask); so does ``flash_attn``, whose causal mask is aligned to the bottom right when a segment has more
#: keys than queries (flash-attn >= 2.1). ``repad`` aligns queries and keys at each example's start, and torch's
#: ``varlen_attn`` does not document its alignment: neither takes them.
SHARED_FEATURES = frozenset({SHARED_PREFIXES_FEATURE})


@hookimpl
def register_attention_backends():
    return [
        AttentionBackend(
            "exact",
            backends.exact_varlen,
            features=EXACT_FEATURES | SHARED_FEATURES,
            speed_rank=0,
            devices=("cpu", "cuda", "mps", "xpu"),
            description="one sdpa call per example length; exact everywhere, the CPU / CI path",
        ),
        AttentionBackend(
            "repad",
            backends.repad_varlen,
            features=EXACT_FEATURES,
            speed_rank=5,
            devices=("cuda", "xpu", "mps"),
            description="one masked sdpa call on a padded view of attention only; any dtype, no host sync: the "
            "GPU fallback for inputs the varlen kernels cannot take (fp32)",
        ),
        AttentionBackend(
            "varlen",
            backends.torch_varlen,
            available=backends.torch_varlen_unavailable,
            features=frozenset(FEATURES) - {"softcap", "dropout"},
            devices=("cuda",),
            dtypes=("float16", "bfloat16"),
            speed_rank=10,
            description="torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside torch), torch >= 2.10",
        ),
        AttentionBackend(
            "flash_attn",
            backends.flash_attn_varlen,
            available=backends.flash_attn_unavailable,
            features=frozenset(FEATURES) | SHARED_FEATURES,
            devices=("cuda",),
            dtypes=("float16", "bfloat16"),
            speed_rank=20,
            description="flash_attn.flash_attn_varlen_func from the flash-attn package: pip install flash-attn on "
            "a CUDA machine",
        ),
    ]
