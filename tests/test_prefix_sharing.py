"""Shared prefixes: each prompt once in the packed row, its completions after it (padfree_plugins.packing.prefixes).

Exact against the rows run whole — attention alone (windows, sinks, GQA; gradients into the one prompt copy), the
model's body on a padded call, TRL's DPO and GRPO trainers (tests/test_trl_preference.py and tests/test_trl_rl.py
run every loss type shared, the default) — and each comparison fails on the two ways sharing goes wrong: a
completion that sees a token of its sibling, a completion whose positions restart at 0.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch

from padfree_plugins import AttentionBackend, BoundaryError, ConfigError, PluginHost, accelerate, assemble, \
    hookimpl, patch_of
from padfree_plugins.builtin.backends import EXACT_FEATURES, SHARED_FEATURES
from padfree_plugins.contract.declarations import FEATURES
from padfree_plugins.modeling import unpad
from padfree_plugins.modeling.attention import PadfreeAttention, record_attention_calls
from padfree_plugins.modeling.attention.backends import attend, exact_varlen, row_masked_varlen
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, Segment, SharedPrefixes, shared_layout, \
    tokens_saved
from padfree_plugins.testing.faults import completion_positions_restart, completions_see_a_sibling
from tests.conftest import tiny_model

EXACT = AttentionBackend("exact", exact_varlen, features=EXACT_FEATURES | SHARED_FEATURES)


# -- the layout ---------------------------------------------------------------------------------------------------


def test_rows_of_one_prompt_share_it_and_every_other_row_stays_whole():
    """Rows 0, 2 and 3 share a 3-token prompt; row 1's prompt is its own (a prompt with a single completion is not
    shared); row 4 is empty (left out); row 5 has nothing shareable; rows 6 and 7 share a 1-token prompt."""
    lengths = [5, 4, 7, 4, 0, 2, 3, 2]
    prompt = (3, "p")
    prefixes = [prompt, (2, "q"), prompt, prompt, None, None, (1, "r"), (1, "r")]
    assert shared_layout(lengths, prefixes) == [
        Segment(0, 0, 3), Segment(0, 3, 2, 0), Segment(2, 3, 4, 0), Segment(3, 3, 1, 0),
        Segment(1, 0, 4), Segment(5, 0, 2), Segment(6, 0, 1), Segment(6, 1, 2, 6), Segment(7, 1, 1, 6)]
    assert tokens_saved(shared_layout(lengths, prefixes)) == 3 * 2 + 1
    assert not any(s.parent >= 0 for s in shared_layout([3, 3], [(1, "a"), (1, "b")]))  # no two prompts alike
    with pytest.raises(ValueError, match="shared prefix of 3 tokens in a row of 3"):
        shared_layout([3], [(3, "a")])  # every completion keeps a token


def test_each_segment_attends_to_its_parent_and_itself():
    structure = SharedPrefixes.build([3, 2, 1, 2], [-1, 0, 0, -1])
    assert structure.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert structure.cu_seq_lens_k.tolist() == [0, 3, 8, 12, 14] and structure.max_length_k == 5
    tree = SharedPrefixes.build([2, 1, 1, 2], [-1, 0, 1, 0])  # two levels: segment 2 continues 1, which continues 0
    assert tree.key_index.tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 1, 4, 5]
    assert tree.cu_seq_lens_k.tolist() == [0, 2, 5, 9, 13] and tree.max_length_k == 4
    with pytest.raises(ValueError, match="not an earlier segment"):
        SharedPrefixes.build([2, 1, 1], [-1, 2, 0])
    with pytest.raises(ValueError, match="at least one"):
        SharedPrefixes.build([2, 0], [-1, 0])


# -- attention ----------------------------------------------------------------------------------------------------


class Attention(torch.nn.Module):
    is_causal = True


def shared_attention(rows, prompt, window=None, sinks=None, backend=EXACT):
    """Queries / keys / values of rows ``prompt + completion`` (``rows``: their full lengths), attended through a
    shared row and whole; both outputs at the tokens the shared row holds, and the gradients of q / k / v."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    total = sum(rows)
    q, k, v = (torch.randn(total, h, dim, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    starts = [sum(rows[:i]) for i in range(len(rows))]
    # the whole rows' prompts are equal: every row reads the first row's prompt tokens
    index = torch.cat([torch.cat([torch.arange(prompt), torch.arange(start + prompt, start + length)])
                       for start, length in zip(starts, rows)])
    qw, kw, vw = (t.index_select(0, index) for t in (q, k, v))
    whole, bounds = [], [0]
    for length in rows:
        piece = slice(bounds[-1], bounds[-1] + length)
        out = attend(*(t[piece].transpose(0, 1)[None] for t in (qw, kw, vw)), causal=True, window=window,
                     sinks=sinks)
        whole.append(out[0].transpose(0, 1))
        bounds.append(bounds[-1] + length)
    whole = torch.cat(whole)
    held = torch.cat([torch.arange(rows[0])] + [torch.arange(start + prompt, start + length)
                                                  for start, length in zip(bounds[1:-1], rows[1:])])
    lengths = [prompt] + [length - prompt for length in rows]
    shared_index = torch.cat([torch.arange(prompt)] + [torch.arange(start + prompt, start + length)
                                                       for start, length in zip(starts, rows)])
    structure = SharedPrefixes.build(lengths, [-1] + [0] * len(rows))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qs, ks, vs = (t.index_select(0, shared_index)[None].transpose(1, 2) for t in (q, k, v))
    extra = {"s_aux": sinks} if sinks is not None else {}
    out, _ = PadfreeAttention(backend)(Attention(), qs, ks, vs, None, sliding_window=window, cu_seq_lens_q=cu,
                                       max_length_q=max(lengths), **{SHARED_PREFIXES_KEY: structure}, **extra)
    got, want = out[0], whole.index_select(0, held)
    weights = torch.randn_like(want)
    grads = [torch.autograd.grad((x * weights).sum(), (q, k, v)) for x in (got, want)]
    return got, want, grads


#: ``exact``'s compiled path (one masked call over the row, queries aligned to the end of their keys).
ROW_MASKED = AttentionBackend("row_masked", row_masked_varlen, features=EXACT_FEATURES | SHARED_FEATURES)


@pytest.mark.parametrize("backend", [EXACT, ROW_MASKED], ids=["exact", "row_masked"])
@pytest.mark.parametrize("window,sinks", [(None, None), (3, None), (None, torch.randn(4, dtype=torch.float64))],
                         ids=["causal", "window", "sinks"])
def test_a_shared_prompt_gives_each_completion_what_its_whole_row_gives(window, sinks, backend):
    """Three completions of one 4-token prompt (GQA), attention through the shared row equals each row whole, and
    the gradients of the one prompt copy are the sum of the rows' (float64: 1e-12)."""
    got, want, (grad_got, grad_want) = shared_attention([7, 5, 9], 4, window, sinks, backend)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for mine, theirs in zip(grad_got, grad_want):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=0)


def test_completions_of_one_shape_attend_together_as_each_row_whole():
    """Three completions of one length (one ``(L_q, L_k)`` group, one call) and one of another: each gives what its
    whole row gives, and the prompt's gradients sum the rows' (float64: 1e-12)."""
    got, want, (grad_got, grad_want) = shared_attention([7, 7, 5, 7], 4)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for mine, theirs in zip(grad_got, grad_want):
        torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=0)


def test_queries_without_keys_attend_to_nothing():
    """An example with queries and no keys gets zeros (and no gradient); the next one attends to its own keys,
    queries aligned to their end."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, dtype=torch.float64, requires_grad=True) for n in (5, 4, 4))
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 0, 4], dtype=torch.int32)
    out = exact_varlen(q, k, v, cu_q, cu_k, 3, 4, causal=True)
    want = attend(*(t.transpose(0, 1)[None] for t in (q[3:], k, v)), causal=True)[0].transpose(0, 1)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    torch.testing.assert_close(out[3:], want, atol=1e-12, rtol=0)
    out.sum().backward()
    assert torch.equal(q.grad[:3], torch.zeros_like(q.grad[:3])) and q.grad[3:].abs().sum() > 0


def test_a_completion_that_sees_its_sibling_is_caught():
    got, want, _ = shared_attention([7, 5, 9], 4)
    with completions_see_a_sibling():
        leaked, _, _ = shared_attention([7, 5, 9], 4)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert (leaked - want).abs().max() > 1e-2


def test_a_backend_without_shared_prefixes_refuses_them():
    plain = AttentionBackend("plain", exact_varlen, features=frozenset(FEATURES))
    with pytest.raises(NotImplementedError, match="'plain' attention backend does not implement"):
        shared_attention([3, 3], 2, backend=plain)


# -- the model's body on a padded call ----------------------------------------------------------------------------


def padded_call():
    """Four right-padded rows: two completions of prompt A, one of prompt B, one more of A; labels on the
    completions."""
    prompt_a, prompt_b = [11, 12, 13, 14], [21, 22]
    completions = [[31, 32], [41, 42, 43], [51, 52, 53], [61]]
    rows = [prompt_a + completions[0], prompt_a + completions[1], prompt_b + completions[2], prompt_a + completions[3]]
    width = max(map(len, rows)) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, (tokens, completion) in enumerate(zip(rows, completions)):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
        labels[row, len(tokens) - len(completion):len(tokens)] = torch.tensor(completion)
    return ids, mask, labels


def body_outputs(model, fault=None):
    """The body's hidden states padded and through the shared row (at the tokens the shared row holds), and their
    parameter gradients."""
    ids, mask, labels = padded_call()
    packed, unpadded = unpad.pack_padded_call({"input_ids": ids}, mask, labels, False, True)
    assert packed[SHARED_PREFIXES_KEY].parents == (-1, 0, 0, 0, -1)
    held = unpadded.scatter(torch.ones(1, unpadded.index.numel())).bool()  # [rows, width]
    outputs = []
    for inputs in ({"input_ids": ids, "attention_mask": mask}, packed):
        model.zero_grad()
        hidden = model.model(**inputs).last_hidden_state
        hidden = unpadded.scatter(hidden) if inputs is packed else hidden
        torch.manual_seed(1)
        (hidden[held] * torch.randn_like(hidden[held])).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outputs.append((hidden[held].detach(), grads))
    return outputs


@pytest.fixture
def llama():
    model = tiny_model("llama", "causal_lm", num_key_value_heads=2)
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})  # padded calls: the model's own code
    yield model
    assembly.undo()


def assert_same(outputs, atol=1e-5):
    (want, want_grads), (got, got_grads) = outputs
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-4, rtol=0, msg=name)


def test_the_models_body_on_a_shared_row_equals_the_padded_forward(llama):
    assert_same(body_outputs(llama))


@pytest.mark.parametrize("fault", [completions_see_a_sibling, completion_positions_restart])
def test_the_body_comparison_fails_on_a_faulty_shared_row(llama, fault):
    with fault(), pytest.raises(AssertionError):
        assert_same(body_outputs(llama))


def test_the_guard_refuses_a_shared_row_that_would_cross_examples(llama):
    ids, mask, labels = padded_call()
    packed, _ = unpad.pack_padded_call({"input_ids": ids}, mask, labels, False, True)
    structure = packed[SHARED_PREFIXES_KEY]
    restarted = packed["position_ids"].clone()
    restarted[0, 3:6] = torch.arange(3)  # the first completion's positions restart at 0
    leaking = SharedPrefixes(structure.parents, structure.key_index.clone(), structure.cu_seq_lens_k,
                             structure.max_length_k)
    leaking.key_index[5] = 6  # a key of the second completion taken from the first
    cases = {"positions continue from its prompt's end": {**packed, "position_ids": restarted},
             "keys are not each segment's ancestors'": {**packed, SHARED_PREFIXES_KEY: leaking},
             "names parents for 4 segments": {**packed, SHARED_PREFIXES_KEY: SharedPrefixes.build(
                 [4, 2, 3, 1], [-1, 0, 0, 0])},
             "must be a padfree_plugins.packing.prefixes.SharedPrefixes": {**packed, SHARED_PREFIXES_KEY: [0, 1]}}
    for message, inputs in cases.items():
        with pytest.raises(BoundaryError, match=message):
            llama.model(**inputs)


# -- trainers -----------------------------------------------------------------------------------------------------


def test_dpo_comparison_fails_on_a_completion_that_sees_its_sibling_or_restarts_its_positions():
    """TRL's DPOTrainer, shared by default: against TRL's padded run, each fault fails the comparison that the
    shared run passes (tests/test_trl_preference.py runs every loss type shared)."""
    pytest.importorskip("trl")
    from tests.test_trl_preference import assert_same_run, run

    want = run("dpo", False)
    for fault in (completions_see_a_sibling, completion_positions_restart):
        with fault():
            got = run("dpo", True)
        with pytest.raises(AssertionError, match="logged values off"):
            assert_same_run(got, want)


def test_grpo_comparison_fails_on_a_completion_that_sees_its_sibling(packed_calls):
    """TRL's GRPOTrainer: its 4 completions of a prompt share it (tests/test_trl_rl.py); a kernel that lets each see
    one token of its sibling fails the comparison."""
    pytest.importorskip("trl")
    from tests.test_trl_rl import beyond_tolerance, padded, train

    want = padded("grpo", loss_type="grpo")
    got = train("grpo", True, packed_calls, fault=completions_see_a_sibling(), loss_type="grpo")
    assert got.shared_prompts and all(got.shared_prompts)
    assert "grad_norm" in beyond_tolerance(got, want)


def dpo_trainer(model=None):
    import trl

    from tests.test_trainer import tokenizer
    from tests.test_trl_preference import pairs, policy

    model = policy() if model is None else model
    with tempfile.TemporaryDirectory() as out:
        return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), train_dataset=pairs(8),
                              args=trl.DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False),
                              processing_class=copy.deepcopy(tokenizer()))


class NoSharing:
    @hookimpl
    def register_attention_backends(self):
        return [AttentionBackend("noshare", exact_varlen, features=frozenset(FEATURES))]


def refused_trainer(reason: str):
    """A DPO trainer on which prefix sharing cannot apply for ``reason``, and the config that makes it so."""
    if reason == "mixers":
        from tests.hybrids_common import hybrid_model
        from tests.test_trainer import tokenizer

        return dpo_trainer(hybrid_model("mamba", vocab_size=len(tokenizer())).train()), {}
    trainer = dpo_trainer()
    if reason == "router":
        trainer.aux_loss_enabled = True  # what TRL sets for an MoE policy with router_aux_loss_coef > 0
    if reason == "no prompt":
        trainer.train_dataset = trainer.train_dataset.remove_columns(
            [column for column in trainer.train_dataset.column_names if column.startswith("prompt")])
    return trainer, {"attention": "noshare"} if reason == "backend" else {}


REFUSALS = {"backend": "the 'noshare' attention backend does not take shared prefixes",
            "mixers": "mamba runs sequence mixers: its MambaMixer cannot start a completion from its prompt's state "
                      r"\(transformers' Mamba1 selective scan",
            "router": "MoE router aux loss",
            "no prompt": "has no prompt column"}


@pytest.mark.parametrize("reason", list(REFUSALS))
def test_prefix_sharing_on_is_refused_where_it_cannot_apply_and_auto_turns_it_off(reason):
    """``prefix_sharing: on`` is a ConfigError at accelerate() that leaves the trainer and its models untouched;
    ``auto`` trains them unshared."""
    pytest.importorskip("trl")
    trainer, config = refused_trainer(reason)
    host = PluginHost({"noshare": NoSharing()})
    forwards = (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"])
    with pytest.raises(ConfigError, match=REFUSALS[reason]):
        accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on", **config}, host=host)
    assert (vars(trainer.model)["forward"], vars(trainer.ref_model)["forward"]) == forwards
    assert patch_of(trainer.model) is None and patch_of(trainer.ref_model) is None
    acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "auto", **config}, host=host)
    assert acceleration.trainer_patch.shares_prefixes is False
    assert not any(head.share_prefixes for head in acceleration.trainer_patch.heads)
    acceleration.undo()


def test_prefix_sharing_is_on_by_default_and_off_when_asked():
    pytest.importorskip("trl")
    for mode, shares in (("auto", True), ("on", True), ("off", False)):
        trainer = dpo_trainer()
        acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": mode})
        assert acceleration.trainer_patch.shares_prefixes is shares
        assert [head.share_prefixes for head in acceleration.trainer_patch.heads] == [shares, shares]
        acceleration.undo()
    with pytest.raises(ConfigError, match="prefix_sharing"):
        accelerate(dpo_trainer(), {"task": "causal_lm", "prefix_sharing": "sometimes"})


def test_a_call_without_shared_prompts_packs_as_before():
    """Rows whose prompts all differ, and a batch of one row: the packed call is the ordinary one."""
    ids, mask, labels = padded_call()
    for rows in ([0, 2], [1]):
        packed, _ = unpad.pack_padded_call({"input_ids": ids[rows]}, mask[rows], labels[rows], False, True)
        plain, _ = unpad.pack_padded_call({"input_ids": ids[rows]}, mask[rows], labels[rows])
        assert SHARED_PREFIXES_KEY not in packed
        assert packed.keys() == plain.keys() and all(torch.equal(packed[k], plain[k]) for k in ("input_ids",
                                                                                                 "position_ids"))


def test_record_counts_the_shared_prompts(llama):
    ids, mask, labels = padded_call()
    packed, _ = unpad.pack_padded_call({"input_ids": ids}, mask, labels, False, True)
    with record_attention_calls() as calls:
        llama.model(**packed)
    assert [call.shared_prompts for call in calls] == [1] * llama.config.num_hidden_layers


def test_a_collators_batch_shares_its_repeated_prefixes():
    """share_packed: examples 0 and 2 begin with the same 2 tokens, example 1 is alone. Per-token keys keep the
    tokens the row holds (positions go on from the prefix's end), seq_idx numbers the segments, per-example values
    stay; each example's end is found, and its tokens whole come back through SharedPrefixes.whole."""
    from padfree_plugins.packing.collator import PackingCollator
    from padfree_plugins.packing.prefixes import share_packed

    examples = [[5, 6, 7, 8], [9, 10], [5, 6, 11]]
    batch = PackingCollator(example_keys=("label",))([{"input_ids": ids, "label": i} for i, ids in enumerate(examples)])
    shared, ends = share_packed(batch, [(2, (5, 6)), None, (2, (5, 6))])
    assert shared["input_ids"].tolist() == [[5, 6, 7, 8, 11, 9, 10]]
    assert shared["position_ids"].tolist() == [[0, 1, 2, 3, 2, 0, 1]]
    assert shared["seq_idx"].tolist() == [[0, 0, 1, 1, 2, 3, 3]]
    assert shared["cu_seq_lens_q"].tolist() == [0, 2, 4, 5, 7] and shared["max_length_q"] == 2
    assert shared[SHARED_PREFIXES_KEY].parents == (-1, 0, 0, -1)
    assert shared["label"].tolist() == [0, 1, 2] and ends == [1, 3, 2]
    index, bounds = shared[SHARED_PREFIXES_KEY].whole(ends)
    whole = shared["input_ids"][0, index].tolist()
    assert [whole[b:e] for b, e in zip(bounds.tolist(), bounds.tolist()[1:])] == examples
    unshared, ends = share_packed(batch, [None, None, (2, (5, 6))])  # a prefix no other example repeats
    assert unshared is batch and ends == [0, 1, 2]


def whole_example_trainer(kind: str):
    """An HF Trainer, a TRL SFTTrainer (whose plugins share prefixes) or a Trainer subclass with its own loss (plugin
    any_trainer, which trains every example whole)."""
    from transformers import Trainer

    from tests.test_trainer import make_trainer

    if kind != "own loss":
        return make_trainer(kind, packed=False)[0]

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    hf = make_trainer("hf", packed=False)[0]
    return OwnLoss(model=hf.model, args=hf.args, train_dataset=hf.train_dataset, data_collator=hf.data_collator)


@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_hf_trainer_and_sft_trainer_accept_prefix_sharing_on(kind):
    """HF Trainer and SFTTrainer share the unlabelled tokens their examples begin with (tests/test_sft_prefix_sharing
    .py compares them with padded runs): ``on`` is accepted and their collator shares; ``off`` does not."""
    pytest.importorskip("trl")
    trainer = whole_example_trainer(kind)
    for mode in ("on", "off"):
        acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": mode})
        assert trainer.data_collator.share_prefixes is (mode == "on")
        acceleration.undo()


@pytest.mark.parametrize("kind, name, plugin", [("own loss", "OwnLoss", "any_trainer")])
def test_prefix_sharing_on_is_refused_for_trainers_that_share_nothing(kind, name, plugin, caplog):
    """``prefix_sharing: on`` with a trainer whose plugin trains every example whole is a ConfigError at accelerate()
    naming the trainer, the reason and the trainers that share, with the trainer and its model unchanged; ``auto``
    trains as before and the log says why nothing is shared; ``off`` says nothing."""
    pytest.importorskip("trl")
    trainer = whole_example_trainer(kind)
    collator, attributes = trainer.data_collator, set(vars(trainer))
    with pytest.raises(ConfigError, match=rf"prefix_sharing: on with {name}: its plugin \({plugin}\) trains every "
                                          r"example whole.*DPOTrainer.*Set prefix_sharing: auto or off"):
        accelerate(trainer, {"task": "causal_lm", "prefix_sharing": "on"})
    assert trainer.data_collator is collator and set(vars(trainer)) == attributes
    assert patch_of(trainer.model) is None and trainer.model.config._attn_implementation == "sdpa"
    for mode, said in (("auto", True), ("off", False)):
        caplog.clear()
        with caplog.at_level("INFO", logger="padfree_plugins"):
            acceleration = accelerate(trainer, {"task": "causal_lm", "prefix_sharing": mode})
        assert any(f"prompts are not shared for {name}" in r.getMessage() for r in caplog.records) is said, mode
        acceleration.undo()
