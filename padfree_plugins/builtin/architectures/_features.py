"""Attention features read from decoder configs, shared by the architecture plugins of this package.

:func:`padfree_plugins.assembly.attention_features` already reads ``sliding_window`` and
``attn_logit_softcapping``; these helpers also catch the per-layer declarations (``layer_types``,
``use_sliding_window``) so that ``attention: auto`` never picks a backend that lacks a feature some layer uses.
Declaring a feature a model does not use only narrows the choice of backend; it never changes results.
"""

from __future__ import annotations

from typing import Any


def window_features(model_config: Any) -> frozenset[str]:
    """``sliding_window`` when any layer of the model attends through a window."""
    window = getattr(model_config, "sliding_window", None)
    if getattr(model_config, "use_sliding_window", True) is False:
        window = None  # Qwen2 family: the window is declared but switched off
    layer_types = getattr(model_config, "layer_types", None) or ()
    windowed_layers = any("sliding" in str(kind) for kind in layer_types)
    return frozenset({"sliding_window"}) if window and (windowed_layers or not layer_types) else frozenset()


def softcap_features(model_config: Any) -> frozenset[str]:
    """``softcap`` when attention scores are soft-capped (Gemma 2)."""
    return frozenset({"softcap"}) if getattr(model_config, "attn_logit_softcapping", None) else frozenset()
