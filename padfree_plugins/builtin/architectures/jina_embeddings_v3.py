"""Jina-embeddings-v3 (``jina_embeddings_v3``, native in transformers since the ``-hf`` checkpoints): XLM-RoBERTa's
tokenizer and embeddings without absolute positions, rotary attention (positions restart at 0) through the
attention interface, post-norm layers; its classifier is XLM-RoBERTa's head (first token). The native model has no
task LoRA adapters: the remote-code model's per-example adapter routing (``adapter_mask``) is not part of it (a LoRA
adapter loaded with peft trains packed, one adapter for the whole batch)."""

from padfree_plugins.contract.declarations import Architecture
from padfree_plugins.contract.hookspecs import hookimpl


@hookimpl
def register_architectures():
    return [Architecture("jina_embeddings_v3", model_types=("jina_embeddings_v3",), kind="encoder",
                         default_pooling="mean", description="Jina-embeddings-v3 encoders (RoPE, native "
                         "transformers model)")]
