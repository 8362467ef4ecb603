"""Prefix trees: a shared row whose prefixes nest (padfree_plugins.packing.prefixes.prefix_tree).

The rows of a batch are read as a trie of their shareable prefixes (the tokens before the first that predicts a label,
with their positions), no layout assumed: a history every row shares, under it the turns some rows share, under each
the completions. One shared call on that tree equals the padded call — log-probabilities within 1e-5, gradients within
1e-4 — on a Llama and on every hybrid family whose mixers continue a state (a segment's recurrent state and conv taps
start from its parent's, and the taps reach into the grandparent where the parent is shorter than the kernel). Each
deliberate fault fails the comparison: a branch two levels down that sees its sibling branch, a segment whose mixers
start from zeros or from a sibling's state. The shared row's memory is bounded by the rows packed whole: checked on
the keys attention gathers and on the activations autograd saves.
"""

from __future__ import annotations

import random

import pytest
import torch

from padfree_plugins import assemble
from padfree_plugins.modeling import unpad
from padfree_plugins.modeling.mixers import mixer_chunk
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY, Segment, SharedPrefixes, gathered_keys, \
    prefix_tree, shared_layout, tokens_saved
from padfree_plugins.testing.faults import branch_sees_a_sibling_branch, completions_see_a_sibling, \
    completions_start_from_zero, conv_taps_stop_at_the_parent
from tests.conftest import tiny_model
from tests.test_hybrid_prefixes import SHARING, compare_call, differences, model_for, padded_rows

# -- the trie -----------------------------------------------------------------------------------------------------


def test_the_trie_of_the_rows_prefixes_is_found_without_a_layout():
    """Rows 0, 2, 3, 5 begin with ``h h``; under it rows 0 and 3 share ``a a`` and rows 2 and 5 a one-token ``b``;
    row 1 shares nothing, row 4 is empty, row 6 has nothing shareable. Depth first, each tree where its first row
    appears, children in row order."""
    h, a, b = "h", "a", "b"
    shareable = [[h, h, a, a], ["x"], [h, h, b], [h, h, a, a, "c"], None, [h, h, b, "d"], None]
    lengths = [6, 3, 4, 7, 0, 6, 2]
    segments = prefix_tree(lengths, shareable)
    assert segments == [
        Segment(0, 0, 2), Segment(0, 2, 2, 0), Segment(0, 4, 2, 1), Segment(3, 4, 3, 1),
        Segment(2, 2, 1, 0), Segment(2, 3, 1, 4), Segment(5, 3, 3, 4),
        Segment(1, 0, 3), Segment(6, 0, 2)]
    assert tokens_saved(segments) == (2 * 3 + 2 + 1)  # h h three times more, a a once, b once
    assert SharedPrefixes.build([s.length for s in segments], [s.parent for s in segments]).depth == 2
    with pytest.raises(ValueError, match="shared prefix of 3 tokens in a row of 3"):
        prefix_tree([3], [["p", "p", "p"]])  # every row keeps a token of its own


def test_one_level_layout_is_the_one_level_tree():
    """shared_layout's groups (equal keys) are the trie of one level: rows of different keys share nothing, even
    with equal first tokens."""
    lengths, prefixes = [5, 4, 6], [(2, "p"), (2, "q"), (2, "p")]
    assert shared_layout(lengths, prefixes) == [Segment(0, 0, 2), Segment(0, 2, 3, 0), Segment(2, 2, 4, 0),
                                                Segment(1, 0, 4)]
    # a key of equal value (another object) shares; an equal key over another length does not
    assert shared_layout([5, 6], [(2, ("p", (1, 2))), (2, tuple(["p", (1, 2)]))]) == [
        Segment(0, 0, 2), Segment(0, 2, 3, 0), Segment(1, 2, 4, 0)]
    assert not any(segment.parent >= 0 for segment in shared_layout([5, 6], [(2, "p"), (3, "p")]))


def random_trie(rng: random.Random) -> tuple[list[int], list[list[str]]]:
    """Rows drawn as walks down a random tree of token runs: shared histories, branching turns, own tails."""
    runs = [[f"{depth}{branch}{i}" for i in range(rng.randint(1, 6))] for depth in range(4) for branch in range(3)]
    lengths, shareable = [], []
    for _ in range(rng.randint(2, 12)):
        prefix = [item for depth in range(rng.randint(0, 4)) for item in runs[depth * 3 + rng.randint(0, 2)]]
        shareable.append(prefix)
        lengths.append(len(prefix) + rng.randint(1, 4))
    return lengths, shareable


def test_every_prefix_has_two_children_so_the_keys_gathered_stay_bounded():
    """On random tries: every prefix segment has two children or more, each row's segments rebuild exactly its
    tokens, and the keys attention gathers exceed the rows' whole by at most the tokens saved (the memory bound)."""
    rng = random.Random(0)
    for _ in range(200):
        lengths, shareable = random_trie(rng)
        segments = prefix_tree(lengths, shareable)
        children = [sum(s.parent == index for s in segments) for index in range(len(segments))]
        assert all(count == 0 or count >= 2 for count in children)
        for row, length in enumerate(lengths):
            chain, index = [], next(i for i, s in enumerate(segments) if s.row == row and children[i] == 0)
            while index >= 0:
                chain.append(segments[index])
                index = segments[index].parent
            assert sum(s.length for s in chain) == length and chain[-1].start == 0
            assert all(a.start == b.start + b.length for a, b in zip(chain, chain[1:]))
        assert gathered_keys(segments) - sum(lengths) <= tokens_saved(segments)


def test_a_chain_of_single_child_prefixes_breaks_the_bound():
    """The bound needs two children per prefix: a row split into nested one-child prefixes gathers more keys than
    sharing saves (nothing), which is why the trie never makes one."""
    chain = [Segment(0, 0, 4), Segment(0, 4, 4, 0), Segment(0, 8, 4, 1)]
    assert gathered_keys(chain) - 12 > tokens_saved(chain) == 0


# -- one call on a tree: every family -----------------------------------------------------------------------------

#: Token runs: a history every row shares; turns ``a`` (5 tokens), ``b`` (2: one shareable, shorter than a conv
#: kernel) and ``c`` under it, ``c`` beginning with ``a``'s first token (a one-token branch point, three levels
#: down); a prompt ``p`` of its own; each row a walk and a labelled completion.
RUNS = {"history": 7, "a": 5, "b": 2, "c": 9, "p": 3}
ROWS = [(("history", "a"), 3), (("history", "b"), 2), (("history", "a"), 1), (("p",), 4), (("history", "c"), 3),
        (("history", "b"), 4), (("history", "a"), 6), (("p",), 2)]


def tree_call(vocab: int, seed: int = 0):
    """Right-padded rows (walks of RUNS, then completions), labels on the completions."""
    generator = torch.Generator().manual_seed(seed)
    runs = {name: torch.randint(3, vocab, (length,), generator=generator) for name, length in RUNS.items()}
    runs["c"][0], runs["b"][0] = runs["a"][0], runs["a"][0] % (vocab - 3) + 3  # c branches off a; b does not
    return padded_rows([(torch.cat([runs[name] for name in walk]),
                         torch.randint(3, vocab, (length,), generator=generator)) for walk, length in ROWS])


def shared_and_padded(model):
    """Log-probabilities at the tokens the shared row holds, padded and through the shared tree, with each call's
    parameter gradients of one weighted sum of them (tests/test_hybrid_prefixes.py's comparison)."""
    outputs, packed = compare_call(model, *tree_call(model.config.get_text_config().vocab_size))
    structure = packed[SHARED_PREFIXES_KEY]
    # history; a's first token (shared with c); a's next 3 with 3 rows; c's rest alone; b's one shareable token with 2
    # rows; the prompt p with 2
    assert structure.depth == 3 and structure.parents == (-1, 0, 1, 2, 2, 2, 1, 0, 7, 7, -1, 10, 10), \
        structure.parents
    return outputs


def assert_same(outputs):
    log_probs, grads = differences(outputs)
    assert log_probs <= 1e-5 and grads <= 1e-4, f"shared tree off: log-probs {log_probs:.2e}, gradients {grads:.2e}"


@pytest.fixture(scope="module", params=["llama", *SHARING])
def tree_model(request):
    if request.param == "llama":
        model = tiny_model("llama", "causal_lm", num_key_value_heads=2, initializer_range=0.1)
    else:
        model = model_for(request.param)
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})  # padded calls: the model's own code
    yield request.param, model
    assembly.undo()


def test_one_call_on_a_prefix_tree_equals_the_padded_call(tree_model):
    assert_same(shared_and_padded(tree_model[1]))


def faults_for(model_type: str) -> dict:
    faults = {"branch sees its sibling branch": branch_sees_a_sibling_branch,
              "completion sees its sibling": completions_see_a_sibling}
    if model_type != "llama":
        faults["zero state"] = completions_start_from_zero
    if model_type == "lfm2":
        faults["taps stop at the parent"] = conv_taps_stop_at_the_parent
    return faults


def test_the_tree_comparison_fails_on_every_fault(tree_model):
    """Each fault moves the log-probabilities by more than 100× the tolerance (the branch fault: only segments two
    levels down leak, so the deeper level is what the comparison sees; the taps fault: only taps past the one-token
    branch point). A state continued from a sibling is shown on one-level rows (tests/test_hybrid_prefixes.py): in
    this tree it would make a one-token branch point's state read in part, which the mixers refuse."""
    model_type, model = tree_model
    if model_type not in ("llama", "qwen3_5_text", "bamba", "lfm2"):
        pytest.skip("the faults are shown on one family of each kind of mixer")
    for name, fault in faults_for(model_type).items():
        with fault():
            outputs = shared_and_padded(model)
        assert differences(outputs)[0] > 1e-3, name
        with pytest.raises(AssertionError, match="shared tree off"):
            assert_same(outputs)


# -- memory -------------------------------------------------------------------------------------------------------


def caterpillar(depth: int, vocab: int, seed: int = 0):
    """Rows that branch at every turn of one episode: row ``k`` is the first ``k`` turns (2 tokens each), then its
    own 2-token completion — the deepest tree a batch of ``depth`` rows makes, the most keys gathered per token."""
    generator = torch.Generator().manual_seed(seed)
    turns = torch.randint(3, vocab, (2 * depth + 2,), generator=generator)
    return padded_rows([(turns[:2 + 2 * k], torch.randint(3, vocab, (2,), generator=generator))
                        for k in range(1, depth + 1)])


def saved_bytes(model, inputs) -> int:
    """The bytes of every tensor autograd saves for backward in one forward (each storage once; every saved tensor held
    until the count is made, so that no freed storage's address is reused and miscounted)."""
    storages: dict[int, int] = {}
    held = []

    def keep(tensor):
        held.append(tensor)
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(**inputs)
    return sum(storages.values())


def long_history(vocab: int, seed: int = 0):
    """Four rows under one 150-token history (two turns of 5 tokens, two rows each), then 3-token completions: a
    tree worth sharing also for mixers that pad every run to 64 tokens."""
    generator = torch.Generator().manual_seed(seed)
    history, turns = (torch.randint(3, vocab, (size,), generator=generator) for size in (150, 10))
    turns[5] = turns[0] % (vocab - 3) + 3  # the two turns differ from their first token
    rows = [(torch.cat([history, turns[5 * (k // 2):5 * (k // 2) + 5]]), torch.randint(3, vocab, (3,),
                                                                                         generator=generator))
            for k in range(4)]
    ids = torch.stack([torch.cat(row) for row in rows])
    labels = torch.full_like(ids, -100)
    labels[:, -3:] = ids[:, -3:]
    return ids, torch.ones_like(ids), labels


def sharing(model, ids, mask, labels, chunk=None):
    """The call packed whole and shared (with the model's mixer chunk, or ``chunk``)."""
    chunk = mixer_chunk(model) if chunk is None else chunk
    whole, _ = unpad.pack_padded_call({"input_ids": ids}, mask, labels, True, False)
    shared, _ = unpad.pack_padded_call({"input_ids": ids}, mask, labels, True, True, chunk=chunk)
    return whole, shared


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_a_shared_row_saves_no_more_activations_than_its_rows_packed_whole(model_type):
    """What autograd saves for a shared row is at most what it saves for the same rows packed whole, on the deepest
    tree (a row branching at every turn), a three-level tree and a long shared history. A Llama shares the deep tree
    at every level and saves more than half; a gated-DeltaNet hybrid, whose mixers pad every run to 64 tokens,
    shares only what saves its chunks (the long history) — and sharing the deep tree anyway (chunk 1) would keep
    more than the rows whole, which is what the chunk rule prevents."""
    model = tiny_model("llama", "causal_lm", num_key_value_heads=2) if model_type == "llama" else \
        model_for(model_type)
    assembly = assemble(model, {"task": "causal_lm", "unpad": "off"})
    try:
        vocab = model.config.get_text_config().vocab_size
        calls = {"deep": caterpillar(16, vocab), "tree": tree_call(vocab), "history": long_history(vocab)}
        saved = {}
        for name, call in calls.items():
            whole, shared = sharing(model, *call)
            assert SHARED_PREFIXES_KEY not in whole
            saved[name] = (saved_bytes(model, shared), saved_bytes(model, whole), shared.get(SHARED_PREFIXES_KEY))
            assert saved[name][0] <= saved[name][1], name
        assert saved["history"][2] is not None and saved["history"][0] < saved["history"][1]
        if model_type == "llama":
            assert saved["deep"][2].depth >= 8 and saved["deep"][0] < 0.5 * saved["deep"][1]
        else:
            whole, unguarded = sharing(model, *calls["deep"], chunk=1)
            assert unguarded[SHARED_PREFIXES_KEY].depth >= 8
            assert saved_bytes(model, unguarded) > saved_bytes(model, whole)
    finally:
        assembly.undo()
