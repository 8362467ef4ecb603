"""The encoder families of 2025–26 (ESM-2, ESM C, EmbeddingGemma 2 and Gemma-style bidirectional Gemma 3,
Jina-embeddings-v3, ModernBERT-decoder, RoCBert, BertGeneration, LayoutLM, X-MOD, the CLIP / SigLIP text towers):
packed hidden states and gradients equal every example run alone, each is resolved by its model type, and what is
special in each is proven — ESM-2's token dropout counted per example (the per-row scaling is caught), ESM C's chains
refused, X-MOD's languages routed per token, RoCBert's and LayoutLM's extra inputs carried, the text towers' rows
longer than their position tables, SigLIP's attention given the boundaries, the windows kept. The task tests
(seq_cls, reranker, embedding) take the same tiny configs from tests/tasks_common.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from padfree_plugins import BatchError, PadfreeError, assemble, plan
from padfree_plugins.builtin.architectures import esm, layoutlm, text_towers
from padfree_plugins.testing import assert_packed_matches_alone, tiny_model
from tests.conftest import make_examples, split_packed
from tests.tasks_common import (
    DECODERS_2025,
    EMBEDDING_ONLY,
    ENCODERS_2025,
    assert_grads_close,
    grads,
    model_for,
    model_type,
    padded,
)

HIDDEN = {"task": "hidden_states", "attention": "exact"}
MASK = 4  # the tiny ESM configs' <mask> id (example tokens start at 5)
#: Gemma 3 text with ``use_bidirectional_attention`` (EmbeddingGemma v1): the gemma3 plugin's, sliding layers of 4.
GEMMA3_BIDIRECTIONAL = dict(use_bidirectional_attention=True, sliding_window=4, head_dim=16, num_hidden_layers=3,
                            num_key_value_heads=2, layer_types=["sliding_attention", "sliding_attention",
                                                                "full_attention"])
#: More configs checked here only: ESM without token dropout, BertGeneration as a decoder.
EXTRA = {"esm/plain": dict(token_dropout=False, mask_token_id=MASK),
         "bert-generation/decoder": dict(is_decoder=True)}
FAMILIES = {**ENCODERS_2025, **DECODERS_2025, **EMBEDDING_ONLY, **EXTRA, "gemma3_text/bidirectional": {}}
PLUGINS = {"esm": "esm", "esmc": "esm", "jina_embeddings_v3": "jina_embeddings_v3", "roc_bert": "bert_variants",
           "bert-generation": "bert_variants", "layoutlm": "layoutlm", "xmod": "xmod",
           "modernbert-decoder": "modernbert_decoder", "embedding_gemma2": "embedding_gemma2",
           "embedding_gemma2_text": "embedding_gemma2", "clip_text_model": "text_towers",
           "siglip_text_model": "text_towers", "siglip2_text_model": "text_towers", "gemma3_text": "gemma3"}
LENGTHS = [1, 7, 7, 30, 1, 3]  # one-token examples first and inside the row, equal lengths, one long example


def family_model(name: str, head: str = "base", **overrides):
    if name == "gemma3_text/bidirectional":
        return tiny_model("gemma3_text", head, attn_implementation="sdpa", **{**GEMMA3_BIDIRECTIONAL, **overrides})
    if name in EXTRA:
        return tiny_model(model_type(name), head, attn_implementation="sdpa", **{**EXTRA[name], **overrides})
    return model_for(name, head, **overrides)


def with_masks(examples, mask: int = MASK):
    """ESM ``<mask>`` tokens in most examples, a different share in each (one-token examples keep their token)."""
    out = []
    for i, example in enumerate(examples):
        ids = list(example["input_ids"])
        step = 2 + i % 3
        for j in range(1, len(ids), step):
            ids[j] = mask
        out.append({**example, "input_ids": ids})
    return out


def packed_hidden(model, examples, **inputs):
    assembly = assemble(model, HIDDEN)
    try:
        batch = assembly.collator(examples)
        return model(**batch.model_inputs(), **inputs).last_hidden_state, batch
    finally:
        assembly.undo()


# -- every family: packed equals alone, and is declared ------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_states_and_gradients_equal_alone(name):
    """Hidden states within 1e-5, every parameter's gradient within 1e-4 (+ 1e-4 × its scale), fp32; ESM examples
    carry masks."""
    model = family_model(name, "causal_lm" if name == "bert-generation/decoder" else "base")
    examples = with_masks(make_examples(LENGTHS))
    report = assert_packed_matches_alone(model, HIDDEN, examples, plugin=PLUGINS[model_type(name)])
    assert report.max_output_diff < 1e-5 and report.parameters_compared > 10
    print(report)


@pytest.mark.parametrize("name", FAMILIES)
def test_resolved_by_model_type(name):
    """Declared (not probed), with the right kind, first position and attention features."""
    config = family_model(name).config
    resolved = plan(config, HIDDEN)
    assert resolved.architecture_plugin == PLUGINS[model_type(name)] and model_type(name) in \
        resolved.architecture.model_types
    causal = name in ("modernbert-decoder", "clip_text_model")
    assert resolved.architecture.kind == ("decoder" if causal or model_type(name) == "gemma3_text" else "encoder")
    if model_type(name) == "gemma3_text":  # a decoder plugin: bidirectional declared on top of its kind
        assert "bidirectional" in resolved.features
    else:
        assert ("causal" in resolved.features) == causal and ("bidirectional" in resolved.features) != causal
    assert resolved.position_start == (2 if name in ("esm/absolute", "esm/plain", "xmod") else 0)
    windowed = name.startswith(("embedding_gemma2", "modernbert-decoder", "gemma3_text"))
    assert ("sliding_window" in resolved.features) == windowed
    assert ("gqa" in resolved.features) == name.startswith(("embedding_gemma2", "gemma3_text"))


def test_padfree_plugins_list_shows_every_family():
    from typer.testing import CliRunner

    from padfree_plugins.cli import app

    result = CliRunner().invoke(app, ["list", "--json"])
    assert result.exit_code == 0, result.output
    plugins = {p["name"]: p for p in json.loads(result.output)["plugins"]}
    for plugin, architectures in {"esm": ["esm", "esmc"], "embedding_gemma2": ["embedding_gemma2"],
                                  "jina_embeddings_v3": ["jina_embeddings_v3"],
                                  "modernbert_decoder": ["modernbert-decoder"],
                                  "bert_variants": ["roc_bert", "bert-generation"], "layoutlm": ["layoutlm"],
                                  "xmod": ["xmod"], "text_towers": ["clip_text", "siglip_text"]}.items():
        assert plugins[plugin]["status"] == "ok" and plugins[plugin]["architectures"] == architectures
        assert plugins[plugin]["source"] == "builtin"


# -- ESM-2: token dropout per example ------------------------------------------------------------------------------

ESM_CONFIGS = ("esm", "esm/absolute")


@pytest.mark.parametrize("name", ESM_CONFIGS)
def test_esm_masked_lm_with_masks_equals_alone(name):
    """Masked-LM training (EsmForMaskedLM, masks in the batch): logits and gradients equal every example alone."""
    model = model_for(name, head=transformers.AutoModelForMaskedLM)
    report = assert_packed_matches_alone(model, HIDDEN, with_masks(make_examples(LENGTHS)), plugin="esm")
    assert report.output.startswith("logits")


@pytest.mark.parametrize("name", ESM_CONFIGS)
def test_esm_per_row_token_dropout_is_caught(name, monkeypatch):
    """The test fails on ESM's own per-row scaling (the embeddings patch not installed) and on a deliberately wrong
    per-row variant of the plugin's function: one example's masks rescale every other (measured: 0.1–0.55 in the
    hidden states of these tiny models)."""
    model = model_for(name)
    examples = with_masks(make_examples(LENGTHS))
    with monkeypatch.context() as patched:
        patched.setattr(esm.PerExampleTokenDropout, "install", lambda self: self)  # transformers' per-row count
        with pytest.raises(AssertionError, match=r"differ from the example run alone by (1|2|3|4|5)\.\d+e-01"):
            assert_packed_matches_alone(model, HIDDEN, examples, grad_atol=None)

    def per_row(module, input_ids, position_ids):
        embeddings = module.word_embeddings(input_ids).masked_fill((input_ids == MASK).unsqueeze(-1), 0.0)
        observed = (input_ids == MASK).sum(-1).float() / input_ids.shape[1]
        return embeddings * (1 - esm.MASK_RATIO_TRAIN) / (1 - observed)[:, None, None]

    monkeypatch.setattr(esm, "per_example_token_dropout", per_row)
    with pytest.raises(AssertionError, match="differ from the example run alone"):
        assert_packed_matches_alone(model, HIDDEN, examples, grad_atol=None)


@pytest.mark.parametrize("name", ESM_CONFIGS)
def test_esm_masks_of_one_example_change_no_other(name):
    model = model_for(name)
    examples = with_masks(make_examples([9, 1, 20, 12]))
    changed = [dict(ex) for ex in examples]
    changed[2] = {"input_ids": [MASK if j % 2 else t for j, t in enumerate(examples[2]["input_ids"])]}
    with torch.no_grad():
        before, batch = packed_hidden(model, examples)
        after, _ = packed_hidden(model, changed)
    for i, (a, b) in enumerate(zip(split_packed(before, batch), split_packed(after, batch))):
        if i == 2:
            assert (a - b).abs().max() > 1e-2
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("task", ["seq_cls", "embedding"])
@pytest.mark.parametrize("name", ESM_CONFIGS)
def test_esm_tasks_with_masks_equal_padded(name, task):
    """The padded model counts masks per row (attention_mask.sum), i.e. per example: seq_cls logits and mean
    embeddings with masks in the batch, and their gradients, equal padded."""
    examples = with_masks(make_examples([1, 13, 7, 30, 7]))
    model = model_for(name, head="seq_cls" if task == "seq_cls" else "base", num_labels=3)
    inputs = padded(examples)
    if task == "seq_cls":
        want = model(**inputs).logits
        rows = [{**ex, "label": i % 3} for i, ex in enumerate(examples)]
        config = {"task": "seq_cls", "attention": "exact"}
    else:
        hidden = model(**inputs).last_hidden_state * inputs["attention_mask"][..., None]
        want = hidden.sum(1) / inputs["attention_mask"].sum(1, keepdim=True)
        rows = [{"text_input_ids": ex["input_ids"]} for ex in examples]
        config = {"task": "embedding", "attention": "exact", "pooling": "mean"}
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (want * weight).sum().backward()
    want_grads = grads(model)
    assembly = assemble(model, config)
    try:
        out = assembly.forward(model, assembly.collator(rows))
        got = out.logits if task == "seq_cls" else out.embeddings
        (got * weight).sum().backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want_grads)


def test_esm_undo_gives_back_its_embeddings():
    model = model_for("esm")
    assembly = assemble(model, HIDDEN)
    assert "forward" in model.embeddings.__dict__
    assembly.undo()
    assert "forward" not in model.embeddings.__dict__


def test_esmc_chains_refused_packed_and_kept_padded():
    """ESM C's sequence_id masks chains from each other inside an input: refused on a packed row; a padded batch of
    two-chain inputs gives, patched, exactly what it gives unpatched (the chain mask is kept)."""
    model = model_for("esmc")
    ids = torch.tensor([make_examples([10])[0]["input_ids"], make_examples([10], seed=1)[0]["input_ids"]])
    chains = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [-1] * 3])  # two chains; one chain and padding (-1)
    with torch.no_grad():
        want = model(input_ids=ids, sequence_id=chains).last_hidden_state
        assert (want - model(input_ids=ids).last_hidden_state).abs().max() > 1e-2  # the chains matter
        assembly = assemble(model, HIDDEN)
        try:
            torch.testing.assert_close(model(input_ids=ids, sequence_id=chains).last_hidden_state, want,
                                       atol=1e-6, rtol=0)
            batch = assembly.collator(make_examples([5, 8]))
            with pytest.raises(PadfreeError, match="sequence_id"):
                model(**batch.model_inputs(), sequence_id=torch.zeros_like(batch["input_ids"]))
        finally:
            assembly.undo()


# -- X-MOD: languages per example ----------------------------------------------------------------------------------

LANGUAGES = [0, 1, 1, 0, 1, 0]  # en_XX, de_DE per example


def test_xmod_languages_routed_per_token_equal_alone():
    """Per-example lang_ids ([n]) and per-token ones ([1, T]) of a packed row give every example its own language's
    adapters, as each example alone with its lang_ids; the language changes the outputs."""
    model = model_for("xmod")
    examples = make_examples(LENGTHS)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([ex["input_ids"]]), lang_ids=torch.tensor([lang])).last_hidden_state[0]
                 for ex, lang in zip(examples, LANGUAGES)]
        per_example, batch = packed_hidden(model, examples, lang_ids=torch.tensor(LANGUAGES))
        tokens = torch.tensor(LANGUAGES).repeat_interleave(batch.lengths)[None]
        per_token, _ = packed_hidden(model, examples, lang_ids=tokens)
        default, _ = packed_hidden(model, examples)  # every example with default_language (de_DE)
    for got in (per_example, per_token):
        for i, (part, want) in enumerate(zip(split_packed(got, batch), alone)):
            torch.testing.assert_close(part, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"example {i}: {m}")
    english = [i for i, lang in enumerate(LANGUAGES) if lang == 0]
    assert max((per_example - default)[0, batch["cu_seq_lens_q"][i]].abs().max() for i in english) > 1e-3


def test_xmod_seq_cls_with_languages_equals_padded():
    """lang_ids in the batch reach the per-example heads: logits, loss and gradients equal the padded model's with
    one language per row."""
    model = model_for("xmod", head="seq_cls", num_labels=3)
    examples = [{**ex, "label": i % 3} for i, ex in enumerate(make_examples(LENGTHS))]
    labels = torch.tensor([ex["label"] for ex in examples])
    want = model(**padded(examples), lang_ids=torch.tensor(LANGUAGES), labels=labels)
    want.loss.backward()
    want_grads = grads(model)
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    try:
        batch = assembly.collator(examples)
        batch["lang_ids"] = torch.tensor(LANGUAGES)  # what a collator carrying lang_ids would add
        got = assembly.forward(model, batch)
        got.loss.backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want_grads)


def test_xmod_wrong_number_of_languages_is_an_error():
    model = model_for("xmod")
    with pytest.raises(BatchError, match="lang_ids has 2 values for a packed row of 3 examples"):
        packed_hidden(model, make_examples([3, 4, 5]), lang_ids=torch.tensor([0, 1]))


# -- RoCBert and LayoutLM: their extra per-token inputs ------------------------------------------------------------


def per_token(examples, key, values, fill=0):
    """``values(i, n)`` -> one example's ``key`` (a list of n values); sets it on each example."""
    return [{**ex, key: values(i, len(ex["input_ids"]))} for i, ex in enumerate(examples)]


def padded_key(examples, key, fill=0):
    longest = max(len(ex["input_ids"]) for ex in examples)
    rows = [torch.as_tensor(ex[key]) for ex in examples]
    out = torch.full((len(rows), longest, *rows[0].shape[1:]), fill, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def packed_key(examples, key):
    return torch.cat([torch.as_tensor(ex[key]) for ex in examples])[None]


@pytest.mark.parametrize(("name", "keys"), [("roc_bert", ("input_shape_ids", "input_pronunciation_ids")),
                                             ("layoutlm", ("bbox",))])
def test_extra_per_token_inputs_through_the_heads(name, keys):
    """RoCBert's shape / pronunciation ids and LayoutLM's boxes, carried per token in the batch, reach the base
    through the per-example heads: logits and gradients equal the padded model's with them, and they matter."""
    model = model_for(name, head="seq_cls", num_labels=3)
    generator = torch.Generator().manual_seed(5)
    examples = make_examples([1, 13, 7, 30, 7])
    for key in keys:
        if key == "bbox":
            examples = per_token(examples, key, lambda i, n: torch.sort(torch.randint(0, 1000, (n, 4),
                                                                                       generator=generator)).values)
        else:
            examples = per_token(examples, key, lambda i, n: torch.randint(5, 64, (n,), generator=generator))
    examples = [{**ex, "label": i % 3} for i, ex in enumerate(examples)]
    extra = {key: padded_key(examples, key) for key in keys}
    labels = torch.tensor([ex["label"] for ex in examples])
    want = model(**padded(examples), **extra, labels=labels)
    want.loss.backward()
    want_grads = grads(model)
    with torch.no_grad():
        without = model(**padded(examples)).logits
    assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
    try:
        batch = assembly.collator(examples)
        batch.update({key: packed_key(examples, key) for key in keys})
        got = assembly.forward(model, batch)
        got.loss.backward()
    finally:
        assembly.undo()
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), want_grads)
    assert (without - want.logits).abs().max() > 1e-3


def test_layoutlm_attention_is_bidirectional_and_its_modules_untouched():
    """LayoutLM's self-attention has no is_causal: packed attention takes the architecture's kind (an encoder), so
    every packed call is bidirectional, and the modules are left as they are."""
    from padfree_plugins.modeling.attention import record_attention_calls

    model = model_for("layoutlm")
    modules = [m for m in model.modules() if type(m).__name__ == "LayoutLMSelfAttention"]
    assert modules and not any(hasattr(m, "is_causal") for m in modules)
    assembly = assemble(model, HIDDEN)
    try:
        with torch.no_grad(), record_attention_calls() as calls:
            model(**assembly.collator(make_examples([3, 5])).model_inputs())
    finally:
        assembly.undo()
    assert calls and not any(call.causal for call in calls)
    assert not any(hasattr(m, "is_causal") for m in modules)
    assert layoutlm.LAYOUTLM.kind == "encoder"


# -- the text towers -----------------------------------------------------------------------------------------------

TOWERS = ("clip_text_model", "siglip_text_model", "siglip2_text_model")


@pytest.mark.parametrize("name", TOWERS)
def test_text_tower_rows_longer_than_the_position_table(name, monkeypatch):
    """A packed row of 49 tokens through a tower whose position table has 32: equal to each example alone; the
    tower's own embeddings would refuse the row."""
    model = model_for(name)
    examples = make_examples([30, 1, 18])
    assert_packed_matches_alone(model, HIDDEN, examples, plugin="text_towers")
    monkeypatch.setattr(text_towers.PerExamplePositions, "embed",
                        lambda self, module, **inputs: type(module).forward(module, **inputs))
    with pytest.raises(ValueError, match="Sequence length must be less than max_position_embeddings"):
        packed_hidden(model, examples)


@pytest.mark.parametrize("name", ["siglip_text_model", "siglip2_text_model"])
def test_siglip_attention_is_given_the_boundaries(name, monkeypatch):
    """SigLIP's attention does not pass its kwargs on: without the patch's forward the guard refuses the row."""
    from padfree_plugins import BoundaryError

    monkeypatch.setattr(text_towers, "attend_with_boundaries",
                        lambda module, hidden_states, attention_mask=None, **kwargs: type(module).forward(
                            module, hidden_states, attention_mask, **kwargs))
    with pytest.raises(BoundaryError, match="without the example boundaries"):
        packed_hidden(model_for(name), make_examples([3, 5]))


def test_clip_last_token_pooling_is_its_eos_pooling():
    """Texts ending with EOS (id 3 here): the embedding task's last-token vectors are CLIP's pooler_output, and
    text_projection of them its text_embeds."""
    model = model_for("clip_text_model")
    projected = transformers.CLIPTextModelWithProjection(model.config).eval()
    projected.text_model.load_state_dict(model.state_dict())
    texts = [{"input_ids": ex["input_ids"] + [3]} for ex in make_examples([1, 7, 30, 4])]
    assembly = assemble(projected, {"task": "embedding", "attention": "exact", "pooling": "last"})
    try:
        with torch.no_grad():
            got = assembly.forward(projected, assembly.collator([{"text_input_ids": t["input_ids"]} for t in texts]))
    finally:
        assembly.undo()
    with torch.no_grad():
        alone = [projected(input_ids=torch.tensor([t["input_ids"]])) for t in texts]
        pooled = torch.cat([model(input_ids=torch.tensor([t["input_ids"]])).pooler_output for t in texts])
        torch.testing.assert_close(got.embeddings, pooled, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(projected.text_projection(got.embeddings),
                                   torch.cat([out.text_embeds for out in alone]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["siglip_text_model", "siglip2_text_model"])
def test_siglip_last_token_and_texts_padded_to_max_length(name):
    """SigLIP pools the last token: head(last-token vectors) is its pooler_output per text. Texts padded to the
    table's length with pads as content (SigLIP's training, no mask) pack exactly as SigLIP runs them batched."""
    model = model_for(name)
    texts = make_examples([1, 9, 30])
    assembly = assemble(model, {"task": "embedding", "attention": "exact", "pooling": "last"})
    try:
        with torch.no_grad():
            got = assembly.forward(model, assembly.collator([{"text_input_ids": t["input_ids"]} for t in texts]))
    finally:
        assembly.undo()
    with torch.no_grad():
        want = torch.cat([model(input_ids=torch.tensor([t["input_ids"]])).pooler_output for t in texts])
        torch.testing.assert_close(model.head(got.embeddings), want, atol=1e-5, rtol=1e-5)
        full = [{"input_ids": t["input_ids"] + [1] * (32 - len(t["input_ids"]))} for t in texts]
        batched = model(input_ids=torch.tensor([t["input_ids"] for t in full])).last_hidden_state
        packed, batch = packed_hidden(model, full)
    for i, part in enumerate(split_packed(packed, batch)):
        torch.testing.assert_close(part, batched[i], atol=1e-5, rtol=1e-5)


# -- windows: EmbeddingGemma 2, ModernBERT-decoder, bidirectional Gemma 3 ------------------------------------------

WINDOWED = {"embedding_gemma2_text": "sliding_window", "modernbert-decoder": "local_attention",
            "gemma3_text/bidirectional": "sliding_window"}


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_windows_are_kept(name):
    """Packed equals alone with a window shorter than the examples (the test above), and differs from the same
    weights with a window wider than any example: the window reaches attention, per example."""
    examples = make_examples([30, 9, 20])
    with torch.no_grad():
        narrow, _ = packed_hidden(family_model(name), examples)
        wide, _ = packed_hidden(family_model(name, **{WINDOWED[name]: 200}), examples)
    assert (narrow - wide).abs().max() > 1e-3


def test_gemma3_bidirectional_is_not_causal():
    """EmbeddingGemma v1 (gemma3_text, use_bidirectional_attention): every layer's is_causal is False and the packed
    row differs from the causal model's (same weights), each equal to its examples alone."""
    examples = make_examples([12, 1, 7])
    bidirectional = family_model("gemma3_text/bidirectional")
    causal = family_model("gemma3_text/bidirectional", use_bidirectional_attention=False)
    assert not any(getattr(m, "is_causal", False) for m in bidirectional.modules())
    with torch.no_grad():
        a, _ = packed_hidden(bidirectional, examples)
        b, _ = packed_hidden(causal, examples)
    assert (a - b).abs().max() > 1e-3


def test_embedding_gemma2_global_layers_have_their_own_heads():
    """The tiny config's global layer has head size 32 and one key / value head (GQA), the sliding ones 16 and 2:
    declared per layer, never read as a global value (which transformers refuses for this config)."""
    model = model_for("embedding_gemma2_text")
    heads = [(layer.self_attn.head_dim, layer.self_attn.k_proj.out_features // layer.self_attn.head_dim)
             for layer in model.layers]
    assert heads == [(16, 2), (16, 2), (32, 1)]
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        model.config.num_key_value_heads  # noqa: B018 - the read that raises
    assert {"gqa", "sliding_window", "bidirectional"} <= plan(model.config, HIDDEN).features


@pytest.mark.parametrize("name", ["embedding_gemma2_text", "gemma3_text/bidirectional"])
def test_gemma_style_gradients_are_exact_in_float64(name, monkeypatch):
    """The fp32 gradients of the Gemma-style encoders differ from the examples alone by up to ~5e-3 on embedding
    rows of scale ~750 (transformers' own padded batch differs by ~2e-3 there), which the task tests allow
    (tasks_common.GRAD_ATOL). It is rounding: in float64 — the RMS norms' float32 upcast removed, the one part that
    would stay float32 — packed equals alone to 1e-9 in every gradient."""
    from transformers.models.embedding_gemma2 import modeling_embedding_gemma2
    from transformers.models.gemma3 import modeling_gemma3

    def norm(self, x):
        out = self._norm(x)
        return out * self.weight if self.with_scale else out

    monkeypatch.setattr(modeling_embedding_gemma2.EmbeddingGemma2RMSNorm, "forward", norm)
    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", lambda self, x: self._norm(x) * (1.0 + self.weight))
    model = family_model(name).double()
    report = assert_packed_matches_alone(model, HIDDEN, make_examples(LENGTHS), atol=1e-12, grad_atol=1e-9,
                                         grad_rtol=1e-9)
    assert report.max_grad_diff < 1e-9


def test_modernbert_decoder_classifier_reads_the_last_token():
    """ModernBERT-decoder's seq_cls head per example: the last token that is not the pad id, through head, drop,
    classifier (the padded model runs them on every token and reads that one) — with a pad-id token ending one
    example, passed over as transformers does."""
    model = model_for("modernbert-decoder", head="seq_cls", num_labels=2)
    examples = make_examples([1, 6, 12])
    examples[1]["input_ids"][-1] = 1  # the pad id
    with torch.no_grad():
        want = torch.cat([model(input_ids=torch.tensor([ex["input_ids"]])).logits for ex in examples])
        assembly = assemble(model, {"task": "seq_cls", "attention": "exact"})
        try:
            got = assembly.forward(model, assembly.collator(examples)).logits
        finally:
            assembly.undo()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert F.softmax(got, -1).shape == (3, 2)
