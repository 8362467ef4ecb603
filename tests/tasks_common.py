"""Shared by the task tests: the tiny encoder / decoder configs, padded reference batches, gradient checks."""

from __future__ import annotations

import torch

from padfree_plugins.packing.padded import pad_examples
from tests.conftest import make_examples, tiny_model

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
#: Models transformers builds without sdpa (MPNet and DeBERTa-v2 compute attention themselves).
EAGER = ("mpnet", "deberta-v2")
TINY = {**ENCODERS, **MORE_ENCODERS}
ARCHITECTURES = {**TINY, **DECODERS}
PAD = 1  # tiny configs' pad_token_id; example token ids start at 5


def model_type(name: str) -> str:
    """A case's model type: ``deberta-v2/absolute`` is a second tiny config of ``deberta-v2``."""
    return name.split("/")[0]


def model_for(name: str, head: str = "base", **overrides):
    attn_implementation = "eager" if model_type(name) in EAGER else "sdpa"
    return tiny_model(model_type(name), head=head, attn_implementation=attn_implementation,
                      **{**ARCHITECTURES[name], **overrides})


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

