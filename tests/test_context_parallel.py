"""All-gather context parallelism (padfree_plugins/modeling/attention/context_parallel.py), in one process: each
rank's slice of queries attended to the row's keys with :func:`slice_boundaries` equals the row's attention, in
values and in every gradient, for causal and bidirectional attention, GQA, sliding windows, soft-capping and
sinks, with examples crossing every cut (one spanning three slices) and 1-token examples at cuts. The deliberate
faults of padfree_plugins.testing.faults must break it. The scheme choice and its refusals (model untouched) are
checked here too, and that a balanced model plans its row once per forward, not per layer (a gloo group of this one
process); the distributed runs are in tests/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch

from padfree_plugins import AttentionBackend, PluginHost, assemble, hookimpl, load_config
from padfree_plugins.builtin.backends import EXACT_FEATURES, SHARED_FEATURES
from padfree_plugins.config.schema import SequenceParallelConfig
from padfree_plugins.errors import ConfigError
from padfree_plugins.modeling.attention import PadfreeAttention
from padfree_plugins.modeling.attention.backends import exact_varlen
from padfree_plugins.assembly import plan
from padfree_plugins.modeling.attention.context_parallel import (
    AllGatherAttention,
    AttentionLayout,
    Zigzag,
    balance_choice,
    causal_work,
    ulysses_share,
    unbalanced,
)
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.packing.sequence_parallel import padded_length
from padfree_plugins.testing import faults
from tests import sequence_parallel_run as worker

SIZE = 4
#: 40 tokens in 4 slices of 10: an example of 23 spans slices 0-2, one of 1 token sits right after the cut at 30.
LENGTHS = (2, 23, 5, 1, 9)
HEADS, KV_HEADS, DIM = 6, 2, 8


class Module(torch.nn.Module):
    def __init__(self, causal: bool, window: int | None = None):
        super().__init__()
        self.is_causal, self.sliding_window = causal, window


def boundaries(lengths=LENGTHS) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    shapes = [(1, HEADS, total, DIM), (1, KV_HEADS, total, DIM), (1, KV_HEADS, total, DIM)]
    return [torch.randn(*shape, generator=generator, requires_grad=True) for shape in shapes]


def attention(causal: bool, window=None, softcap=None, sinks=None):
    """The exact attention function and the kwargs of one packed call of a row."""
    cu = boundaries()
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
                  sliding_window=window, softcap=softcap, s_aux=sinks)
    function = PadfreeAttention(_exact_backend())
    return function, Module(causal, window), kwargs


def _exact_backend():
    return AttentionBackend("exact", exact_varlen, features=EXACT_FEATURES | SHARED_FEATURES)


def sliced(function, module, query, key, value, kwargs, causal) -> torch.Tensor:
    """Every rank's output (its queries against the row's keys: :meth:`AllGatherAttention.attend`), joined."""
    local = query.shape[2] // SIZE
    outputs = []
    for rank in range(SIZE):
        ranked = AllGatherAttention(function, SequenceGroup(None, rank, SIZE))
        out, _ = ranked.attend(module, query[:, :, rank * local:(rank + 1) * local], key, value, None, causal,
                               **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1)


def outputs_and_grads(compute, query, key, value):
    out = compute()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    return out.detach(), grads


VARIANTS = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "causal-window": dict(causal=True, window=4),
    "softcap": dict(causal=True, softcap=2.0),
    "sinks": dict(causal=True, sinks=torch.randn(HEADS, generator=torch.Generator().manual_seed(3))),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_slices_of_queries_against_the_row_equal_the_row(variant):
    options = VARIANTS[variant]
    function, module, kwargs = attention(**options)
    query, key, value = inputs()
    want, want_grads = outputs_and_grads(lambda: function(module, query, key, value, None, **kwargs)[0],
                                         query, key, value)
    got, got_grads = outputs_and_grads(lambda: sliced(function, module, query, key, value, kwargs,
                                                      options["causal"]), query, key, value)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_the_row_has_an_example_across_three_slices_and_one_token_at_a_cut():
    starts = boundaries().tolist()
    local = sum(LENGTHS) // SIZE
    spans = list(zip(starts[:-1], starts[1:]))
    assert any(a < local and b > 2 * local for a, b in spans)  # crosses the cuts at 10 and 20
    assert (3 * local, 3 * local + 1) in spans  # a 1-token example right after the cut at 30


@pytest.mark.parametrize("fault", [faults.context_keys_from_own_slice_only, faults.context_queries_one_token_ahead])
def test_a_deliberate_fault_breaks_the_equality(fault):
    function, module, kwargs = attention(causal=True)
    query, key, value = inputs()
    want = function(module, query, key, value, None, **kwargs)[0].detach()
    with fault():
        got = sliced(function, module, query, key, value, kwargs, True).detach()
    assert (got - want).abs().max() > 1e-2


# --- the causal work balanced (zigzag) -----------------------------------------------------------------------------


def balanced(function, module, query, key, value, kwargs) -> torch.Tensor:
    """Every rank's :class:`Zigzag` chunks of queries, each attended at its own row positions
    (:meth:`AllGatherAttention.attend` with ``start``), put back in row order (the exchanges are the distributed
    runs')."""
    total = query.shape[2]
    out = [None] * total
    for rank in range(SIZE):
        ranked = AllGatherAttention(function, SequenceGroup(None, rank, SIZE), balance="zigzag")
        for start, stop in Zigzag.of(kwargs["cu_seq_lens_q"], SIZE).spans(rank):
            if stop > start:
                piece, _ = ranked.attend(module, query[:, :, start:stop], key, value, None, True, start=start,
                                         **kwargs)
                out[start:stop] = piece.unbind(1)
    return torch.stack(out, 1)


@pytest.mark.parametrize("variant", [name for name, options in VARIANTS.items() if options["causal"]])
def test_zigzag_chunks_of_queries_against_the_row_equal_the_row(variant):
    function, module, kwargs = attention(**VARIANTS[variant])
    query, key, value = inputs()
    want, want_grads = outputs_and_grads(lambda: function(module, query, key, value, None, **kwargs)[0],
                                         query, key, value)
    got, got_grads = outputs_and_grads(lambda: balanced(function, module, query, key, value, kwargs),
                                       query, key, value)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_zigzag_mask_misaligned_across_the_exchange_breaks_the_equality():
    function, module, kwargs = attention(causal=True)
    query, key, value = inputs()
    want = function(module, query, key, value, None, **kwargs)[0].detach()
    with faults.zigzag_chunks_masked_as_one_run():
        got = balanced(function, module, query, key, value, kwargs).detach()
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("lengths, size", [(LENGTHS, 4), ((30, 14), 4), ((9,), 3), ((1, 1, 1, 1), 4), ((6,), 2),
                                           ((5, 40, 9, 3, 7, 12, 2, 2), 4)])
def test_zigzag_route_takes_each_rank_its_chunks_and_back(lengths, size):
    """The all-to-all of :meth:`Zigzag.route`, played in one process: every rank receives exactly the tokens of its
    two chunks, in row order; the way back returns every token to its slice's place."""
    total = sum(lengths)
    zigzag, local = Zigzag.of(boundaries(lengths), size), total // size
    routes = [zigzag.route(rank, SequenceGroup(None, rank, size), torch.device("cpu")) for rank in range(size)]
    row = torch.arange(total)
    outgoing = []  # [source][destination]: the positions sent
    for rank, route in enumerate(routes):
        assert sum(route.send) == local and sorted(route.order.tolist()) == list(range(local))
        outgoing.append(row[rank * local:(rank + 1) * local][route.order].split(route.send))
    received = []
    for rank, route in enumerate(routes):
        assert route.receive == [len(outgoing[source][rank]) for source in range(size)]
        received.append(torch.cat([outgoing[source][rank] for source in range(size)]))
        want = [p for start, stop in zigzag.spans(rank) for p in range(start, stop)]
        assert received[rank].tolist() == want
    assert sorted(torch.cat(received).tolist()) == list(range(total))
    for rank, route in enumerate(routes):  # back: each destination returns its pieces to their sources
        back = torch.cat([received[d].split(routes[d].receive)[rank] for d in range(size)])
        assert back[route.inverse].tolist() == list(range(rank * local, (rank + 1) * local))


def rank_work(lengths, size: int, zigzag: bool) -> list[int]:
    cu = torch.tensor([0, *lengths]).cumsum(0)
    total = int(cu[-1])
    local = total // size
    return [causal_work(cu, Zigzag.of(cu, size).spans(rank) if zigzag else [(rank * local, (rank + 1) * local)])
            for rank in range(size)]


@pytest.mark.parametrize("lengths", [(4096,), (37, 4000, 59), (3, 61, 5, 11)])
def test_zigzag_balances_the_causal_work_that_contiguous_slices_do_not(lengths):
    """The (query, key) pairs each of 4 ranks computes, for a row that is one long example, a long example crossing
    every cut between short ones, and a short row of 80 tokens with one example across 3 slices: within 10% of each
    other by zigzag, far apart by contiguous slices (the last rank does 2N - 1 = 7 times the first's work on the
    single example); ``auto`` finds every one of them worth balancing."""
    everything = causal_work(boundaries(lengths), [(0, sum(lengths))])
    for zigzag in (True, False):
        work = rank_work(lengths, 4, zigzag)
        spread = max(work) / min(work)
        print(f"{lengths} {'zigzag' if zigzag else 'contiguous'}: {work} (max / min {spread:.3f})")
        assert sum(work) == everything
        assert spread < 1.1 if zigzag else spread > 1.5
    assert unbalanced(boundaries(lengths), 4)


@pytest.mark.parametrize("size", [2, 4])
def test_auto_exchanges_the_distributed_runs_spanning_row(size):
    """The spanning micro-step of tests/sequence_parallel_run.py (its group's row, the padding segment after it) is
    one ``balance: auto`` exchanges, so the SP = 2 and SP = 4 all-gather cases run the zigzag path."""
    lengths = [n for rank in worker.SPANNING[:size] for n in rank]
    padding = padded_length(sum(lengths), size) - sum(lengths)
    assert unbalanced(boundaries(lengths + ([padding] if padding else [])), size)


@pytest.mark.parametrize("lengths", [(1024,) * 4, (16,) * 256, (7, 9) * 128])
def test_auto_leaves_rows_whose_slices_are_balanced_anyway(lengths):
    """Rows of examples no longer than a slice: contiguous slices within 10% of the mean work, no exchange."""
    assert not unbalanced(boundaries(lengths), 4)


def test_balance_is_chosen_wherever_allgather_runs_and_check_shows_it():
    assert balance_choice("auto", 1, 4)[0] and balance_choice("zigzag", 2, 4)[0]
    assert "zigzag over the 2 all-gather ranks" in balance_choice("auto", 2, 4)[1]
    assert not balance_choice("off", 1, 4)[0] and "off: each of the 4" in balance_choice("off", 1, 4)[1]
    off, why = balance_choice("zigzag", 4, 4)
    assert not off and "Ulysses alone" in why and "no effect" in why
    config = kv2_model().config
    described = plan(config, {"attention": "exact", "sequence_parallel": {"size": 4}}).describe()
    assert "all-gather across 2" in described["sequence parallel"]
    assert "balance: zigzag over the 2 all-gather ranks" in described["sequence parallel"]
    described = plan(config, {"attention": "exact", "sequence_parallel": {"size": 4, "attention": "allgather",
                                                                          "balance": "off"}}).describe()
    assert "all-gather" in described["sequence parallel"] and "balance: off" in described["sequence parallel"]
    assert plan(config, {"attention": "exact"}).describe()["sequence parallel"].startswith("off")
    with pytest.raises(ConfigError, match="zigzag"):
        load_config({"sequence_parallel": {"size": 4, "balance": "zigzg"}})
    assert SequenceParallelConfig().balance == "auto"
    layout = AttentionLayout(4, None, SequenceGroup(None, 0, 4), balance="auto")
    assert layout.suffix == "_sp4_allgather_zigzag"
    assert layout.wrap(PadfreeAttention(_exact_backend())).balance == "auto"
    assert "slice's causal work above 1.1 x the mean" in balance_choice("auto", 1, 4)[1]
    assert "above" not in balance_choice("zigzag", 1, 4)[1]


# --- the scheme and its refusals ---------------------------------------------------------------------------------


def test_auto_runs_ulysses_where_the_heads_divide_and_says_why_it_does_not():
    assert ulysses_share("auto", 8, 4) == (4, None)
    share, note = ulysses_share("auto", 6, 4)  # Ulysses over 2 ranks (3 heads each), all-gather across 2 blocks
    assert share == 2 and "does not divide the 6 attention heads" in note and "blocks of 2 consecutive ranks" in note
    share, note = ulysses_share("auto", 4, 3)
    assert share == 1 and "all-gather context parallelism" in note
    assert ulysses_share("auto", 12, 8) == (4, ulysses_share("auto", 12, 8)[1])
    assert ulysses_share("ulysses", 6, 4) == (4, None)  # refused by assemble, with advice
    assert ulysses_share("allgather", 8, 4) == (1, None)


def test_layout_names_and_wraps_each_scheme():
    group = SequenceGroup(None, 1, 4)
    ulysses, gather = SequenceGroup(None, 1, 2), SequenceGroup(None, 0, 2)
    function = PadfreeAttention(_exact_backend())
    assert AttentionLayout(4, group, None).suffix == "_sp4"
    assert AttentionLayout(4, None, group).suffix == "_sp4_allgather"
    mixed = AttentionLayout(4, ulysses, gather)
    assert mixed.suffix == "_sp4_ulysses2x2"
    wrapped = mixed.wrap(function)  # Ulysses within the block, all-gather across the blocks inside it
    assert wrapped.group is ulysses and wrapped.row_size == 4
    assert wrapped.inner.group is gather and wrapped.inner.inner is function


def test_unknown_scheme_is_refused_with_the_nearest():
    with pytest.raises(ConfigError, match="allgather"):
        load_config({"sequence_parallel": {"size": 2, "attention": "all_gather"}})
    assert load_config({"sequence_parallel": {"attention": "allgather"}}).sequence_parallel.attention == "allgather"
    assert SequenceParallelConfig().attention == "auto"


def kv2_model():
    """The tiny Llama of 6 attention heads and 2 key / value heads of the distributed runs."""
    return worker.build("llama_kv2")


def refused(model, config, host=None) -> str:
    implementation = model.config._attn_implementation
    with pytest.raises(ConfigError) as error:
        assemble(model, config, host=host)
    assert model.config._attn_implementation == implementation
    assert not any("forward" in module.__dict__ for module in model.modules())
    return str(error.value)


def test_forced_ulysses_on_heads_it_cannot_split_names_allgather():
    message = refused(kv2_model(), {"attention": "exact", "sequence_parallel": {"size": 4, "attention": "ulysses"}})
    assert "6 attention heads, which 4 ranks cannot split" in message and "attention: allgather" in message


def test_allgather_on_a_backend_that_cannot_align_queries_to_keys_is_refused():
    class StartAligned:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackend("startaligned", exact_varlen, features=EXACT_FEATURES)]

    host = PluginHost({"startaligned": StartAligned()})
    for scheme in ("auto", "allgather"):
        message = refused(kv2_model(), {"attention": "startaligned",
                                        "sequence_parallel": {"size": 4, "attention": scheme}}, host=host)
        assert "'startaligned' attention backend" in message and "attention: exact or flash_attn" in message


def test_auto_warns_once_which_scheme_runs(caplog):
    """Without torch.distributed the assembly is refused after the scheme is chosen: the warning names it."""
    model = kv2_model()
    with caplog.at_level("WARNING", logger="padfree_plugins"):
        message = refused(model, {"attention": "exact", "sequence_parallel": {"size": 4}})
    assert "needs torch.distributed initialised" in message
    notes = [record.getMessage() for record in caplog.records if "all-gather" in record.getMessage()]
    assert len(notes) == 1 and "does not divide the 6 attention heads" in notes[0]


# --- the balance planned once per forward, not per layer --------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone, and the sequence-parallel group of it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield SequenceGroup(None, 0, 1)
    finally:
        dist.destroy_process_group()


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch.model_inputs()).loss
    loss.backward()
    return loss.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_the_balance_is_planned_once_per_forward_not_per_layer(one_rank_group, monkeypatch, checkpointing):
    """A 3-layer decoder whose all-gather attention balances every causal call (``zigzag`` over a group of this one
    process: its two chunks exchanged by all-to-all and attended at their row positions, the code path of N ranks):
    one forward and backward reads the row's boundaries on the host once (:func:`cumulative_work`, inside the plan
    the base model's pre-hook makes), not once per layer, and not again in gradient checkpointing's recompute; loss
    and gradients equal the model without sequence parallelism. With the hook removed, every attention call plans
    its row itself (the behaviour this replaces): one read per layer, per recompute too."""
    from padfree_plugins.modeling.attention import context_parallel
    from padfree_plugins.modeling.sequence_parallel import PlanBalance, SequenceParallelPatch
    from padfree_plugins.testing.models import random_examples, tiny_model

    layers = 3
    model = tiny_model("llama", "causal_lm", num_hidden_layers=layers, vocab_size=96).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assembly = assemble(model, {"attention": "exact"})
    batch = assembly.collator(random_examples((5, 30, 9), 96, seed=2, low=3))
    want_loss, want_grads = _loss_and_grads(model, batch)

    layout = AttentionLayout(1, None, one_rank_group, "zigzag")
    installed = SequenceParallelPatch.install(assembly.patch, one_rank_group, layout)
    assert model.config._attn_implementation.endswith("_allgather_zigzag")
    hooks = [hook for hook in installed.hooks
             if isinstance(model.model._forward_pre_hooks.get(hook.id), PlanBalance)]
    assert len(hooks) == 1
    reads, balanced, right = [], [], context_parallel.cumulative_work
    monkeypatch.setattr(context_parallel, "cumulative_work", lambda cu: reads.append(1) or right(cu))
    spans = context_parallel.AllGatherAttention.attend_balanced
    monkeypatch.setattr(context_parallel.AllGatherAttention, "attend_balanced",
                        lambda *args, **kwargs: balanced.append(1) or spans(*args, **kwargs))
    got_loss, got_grads = _loss_and_grads(model, batch)
    calls = (2 if checkpointing else 1) * layers  # forward, then the checkpointed layers' recompute
    print(f"checkpointing={checkpointing}: {len(balanced)} balanced attention calls, {len(reads)} host read(s) of "
          "the boundaries")
    assert len(balanced) == calls and len(reads) == 1
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)

    hooks[0].remove()  # no plan in the kwargs: each attention call plans its row
    reads.clear()
    unplanned_loss, _ = _loss_and_grads(model, batch)
    assert len(reads) == calls
    torch.testing.assert_close(unplanned_loss, want_loss, atol=1e-5, rtol=1e-5)
    installed.remove()
    assembly.undo()


def test_a_plan_of_another_row_is_refused_before_any_exchange():
    """A balance plan made for another row (other tokens, or another group size) is refused with a clear error
    before the keys are gathered: every rank refuses alike, none waits in a collective."""
    from padfree_plugins.errors import BoundaryError
    from padfree_plugins.modeling.attention import BALANCE_PLAN_KWARG
    from padfree_plugins.modeling.attention.context_parallel import BalancePlan

    function, module, kwargs = attention(causal=True)
    query, key, value = inputs()
    local = query.shape[2] // SIZE
    ranked = AllGatherAttention(function, SequenceGroup(None, 0, SIZE), balance="zigzag")
    for plan in (BalancePlan(sum(LENGTHS) + SIZE, SIZE), BalancePlan(sum(LENGTHS), SIZE // 2)):
        with pytest.raises(BoundaryError, match="balance plan describes a row"):
            ranked(module, query[:, :, :local], key[:, :, :local], value[:, :, :local], None,
                   **{**kwargs, BALANCE_PLAN_KWARG: plan})
