"""Cohere (Command-R): a Llama-shaped decoder (causal, RoPE, GQA). Positions start at 0.

Cohere's attention layers call transformers' ``AttentionInterface`` and forward the batch's ``**kwargs``
(``cu_seq_lens_q`` …) to it, so declaring the architecture is enough: the builtin ``patch_model`` switches the
model to padfree-plugins' attention, and ``tests/test_cohere.py`` proves that a packed forward equals every
example run alone.
"""

from padfree_plugins import Architecture, hookimpl


@hookimpl
def register_architectures():
    return [
        Architecture(
            "cohere",
            model_types=("cohere",),
            kind="decoder",
            default_pooling="last",
            description="Cohere Command-R / Command-R+ (example third-party plugin)",
        )
    ]
