"""Shared by the task tests: the tiny encoder / decoder / hybrid configs, padded reference batches, gradient checks."""

from __future__ import annotations

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from padfree_plugins.packing.padded import pad_examples
from padfree_plugins.testing import TINY_DEFAULTS
from tests.conftest import make_examples, tiny_config, tiny_model
from tests.hybrids_common import ATTENTION_FREE, HYBRIDS

#: Encoder architecture plugins and the overrides their tiny configs need.
ENCODERS = {
    "bert": {},
    "roberta": {},
    "xlm-roberta": {},
    "distilbert": dict(hidden_dim=128),
    "electra": dict(embedding_size=32),
    "modernbert": dict(local_attention=4, global_attn_every_n_layers=2, num_hidden_layers=3, cls_token_id=0,
                       sep_token_id=2),
}
#: Decoder architecture plugins (GQA) used as embedders, classifiers and rerankers.
DECODERS = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
}
#: Encoders added later, in every task test too (tests/test_encoders.py checks their hidden states in depth).
MORE_ENCODERS = {
    "camembert": {},
    "xlm-roberta-xl": {},
    "ernie": dict(use_task_id=True, task_type_vocab_size=3),
    "albert": dict(embedding_size=32),
    "nomic_bert": {},
    "gte": {},
    "eurobert": dict(num_key_value_heads=2),
    "mpnet": {},
    # v3 (deberta-v3-*, mxbai-rerank-v1, nli-deberta-v3): relative attention only, log buckets (8, so the 30-token
    # examples reach past them), keys shared with the relative embeddings, no token types
    "deberta-v2": dict(position_biased_input=False, relative_attention=True, pos_att_type=["p2c", "c2p"],
                       position_buckets=8, max_relative_positions=-1, share_att_key=True, norm_rel_ebd="layer_norm",
                       type_vocab_size=0),
    # v2 xlarge-style: absolute positions too, token types, the encoder's convolution, separate position projections,
    # relative distances clamped at 12 without buckets
    "deberta-v2/absolute": dict(position_biased_input=True, type_vocab_size=2, relative_attention=True,
                                pos_att_type="p2c|c2p", share_att_key=False, position_buckets=-1,
                                max_relative_positions=12, conv_kernel_size=3, conv_act="gelu"),
}
#: The 2025–26 encoder families that have a sequence-classification class: in every task test too
#: (tests/test_encoders_2025.py checks their hidden states, gradients and what is special in each).
ENCODERS_2025 = {
    # ESM-2's own setting: rotary positions (from 0), token dropout (mask id 4), no embedding layer norm
    "esm": dict(token_dropout=True, mask_token_id=4, position_embedding_type="rotary", emb_layer_norm_before=False),
    # ESM-1b style: absolute positions from pad_token_id + 1, token dropout, the embedding layer norm
    "esm/absolute": dict(token_dropout=True, mask_token_id=4, emb_layer_norm_before=True),
    "esmc": {},
    "jina_embeddings_v3": {},
    "roc_bert": dict(shape_vocab_size=64, shape_embed_dim=16, pronunciation_vocab_size=64, pronunciation_embed_dim=16),
    "layoutlm": {},
    "xmod": dict(languages=["en_XX", "de_DE"], default_language="de_DE"),
}
#: The 2025–26 decoder-shaped encoder sibling: ModernBERT-decoder (local layers of 2 tokens back, a global one).
DECODERS_2025 = {"modernbert-decoder": dict(local_attention=4, global_attn_every_n_layers=2, num_hidden_layers=3)}
#: EmbeddingGemma 2's text backbone: sliding layers (radius 3) and a global one with its own head size and one
#: key / value head (GQA).
EMBEDDING_GEMMA2_TEXT = dict(head_dim=16, sliding_window=3, hidden_size_per_layer_input=8, embedding_dim=32,
                             num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"],
                             global_head_dim=32, num_global_key_value_heads=1, num_key_value_heads=2)
#: Families without a sequence-classification class in transformers: the embedding task (and hidden states) only.
#: The text towers' position tables (32) are shorter than a packed row.
EMBEDDING_ONLY = {
    "embedding_gemma2_text": EMBEDDING_GEMMA2_TEXT,
    "embedding_gemma2": dict(text_config={**TINY_DEFAULTS, **EMBEDDING_GEMMA2_TEXT}),
    "bert-generation": {},
    "clip_text_model": dict(max_position_embeddings=32, eos_token_id=3),
    "siglip_text_model": dict(max_position_embeddings=32),
    "siglip2_text_model": dict(max_position_embeddings=32),
}
#: Gradient tolerances (absolute, per element) where fp32 rounding exceeds 1e-4: EmbeddingGemma 2's embedding-row
#: gradients (scale ~200–750 in the tiny config: the sqrt(hidden) embedding scale, the per-layer inputs) differ by up
#: to ~2e-3 between transformers' own padded batch and the examples run alone, and packed by as much; in float64
#: packed equals alone to 1e-9 (tests/test_encoders_2025.py::test_gemma_style_gradients_are_exact_in_float64).
GRAD_ATOL = {"embedding_gemma2_text": 2e-3, "embedding_gemma2": 2e-3}
#: Models transformers builds without sdpa (MPNet and DeBERTa-v2 compute attention themselves).
EAGER = ("mpnet", "deberta-v2")
#: Model types transformers' auto classes do not build (SigLIP's text towers): their class in transformers.
MODEL_CLASSES = {"siglip_text_model": "SiglipTextModel", "siglip2_text_model": "Siglip2TextModel"}
#: The hybrid families (attention beside gated-DeltaNet, KDA, Mamba1 / Mamba2 layers; tests/hybrids_common.py) that
#: transformers gives a sequence-classification class — Qwen3.5 (dense text), Qwen3-Next and Jamba in transformers
#: 5.x: seq_cls and reranker too. Every hybrid family is an embedder (AutoModel, last-token pooling), and the
#: generative yes / no reranker runs on all of them (their causal LMs).
HYBRID_CLASSIFIERS = {name: overrides for name, overrides in HYBRIDS.items()
                      if name in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}
TINY = {**ENCODERS, **MORE_ENCODERS, **ENCODERS_2025}
ARCHITECTURES = {**TINY, **DECODERS, **DECODERS_2025, **HYBRID_CLASSIFIERS}
#: Every architecture the embedding task is tested on.
EMBEDDERS = {**ARCHITECTURES, **EMBEDDING_ONLY, **HYBRIDS}
PAD = 1  # tiny configs' pad_token_id; example token ids start at 5


def model_type(name: str) -> str:
    """A case's model type: ``deberta-v2/absolute`` is a second tiny config of ``deberta-v2``."""
    return name.split("/")[0]


#: The example a hybrid family adds to a task test's lengths: longer than a chunk of the gated delta rule and of KDA
#: (64) and several of the tiny Mamba2 configs' scan (16), so that every task pools and back-propagates through
#: chunked scans too (the causal-LM tests check every boundary length of tests/hybrids_common.LENGTHS).
HYBRID_LONG_EXAMPLE = 70


def lengths_for(name: str, lengths: list[int]) -> list[int]:
    """A task test's example ``lengths`` for architecture ``name``: a hybrid family's one longer."""
    return [*lengths, HYBRID_LONG_EXAMPLE] if model_type(name) in HYBRIDS else list(lengths)


def model_for(name: str, head: str = "base", **overrides):
    # attention-free families (Mamba) are built without an attention implementation
    attn_implementation = (None if model_type(name) in ATTENTION_FREE else
                           "eager" if model_type(name) in EAGER else "sdpa")
    settings = {**EMBEDDERS[name], **overrides}
    if model_type(name) in MODEL_CLASSES:  # built as tiny_model builds the others: seeded, fp32, eval mode
        import transformers

        config = tiny_config(model_type(name), **settings)
        config._attn_implementation = attn_implementation
        torch.manual_seed(0)
        model = getattr(transformers, MODEL_CLASSES[model_type(name)])._from_config(
            config, attn_implementation=attn_implementation)
        return model.float().eval()
    return tiny_model(model_type(name), head=head, attn_implementation=attn_implementation, **settings)


def padded(examples, keys=("input_ids",), pad=PAD):
    """Right-padded ``[n, L_max]`` tensors of ``keys`` plus the attention mask (the reference batch)."""
    return pad_examples(examples, keys, pad_token_id=pad)


def grads(model) -> dict[str, torch.Tensor]:
    """The parameters' gradients (cloned), then cleared."""
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


def assert_grads_close(got: dict, want: dict, atol: float = 1e-4) -> None:
    assert want, "the reference produced no gradients"
    assert got.keys() == want.keys(), f"different parameters got gradients: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def pair_examples(lengths, seed: int = 0):
    """Examples with token types: the first third of each is segment 0, the rest segment 1 (a sentence pair)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, 128, (n,), generator=generator).tolist()
        first = max(1, n // 3) if n > 1 else 0
        out.append({"input_ids": ids, "token_type_ids": [0] * first + [1] * (n - first)})
    return out


def per_example_case(task: str, lengths: list[int]) -> tuple[dict, list[dict]]:
    """A config and labelled rows for a per-example task: ``seq_cls`` (labels 0 / 1) or ``embedding``
    (anchor / positive rows, MultipleNegativesRankingLoss, mean pooling)."""
    config = {"task": task, "attention": "exact"}
    if task == "embedding":
        config.update(pooling="mean", task_options={"loss": "MultipleNegativesRankingLoss"})
        return config, [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"]}
                        for a, b in zip(make_examples(lengths), make_examples([5, 2, 9], seed=1))]
    return config, [{**example, "label": i % 2} for i, example in enumerate(make_examples(lengths))]

