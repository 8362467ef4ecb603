"""torch.compile on packed rows: a patched model compiles whole (``fullgraph=True``: no graph break), at
most twice for rows of every length and example count, trains as it does eagerly, still refuses boundaries that would
mix examples, and reads nothing on the host on the varlen path. ``aot_eager`` traces forward and backward as inductor
gets them, without its C++ compile time; ``exact`` is the CPU backend, ``cpu_varlen`` the built-in ``varlen``
backend's wrapper over a CPU stand-in for torch's kernel (tests/varlen_stand_in.py)."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from padfree_plugins import PluginHost, assemble
from padfree_plugins.errors import BoundaryError
from padfree_plugins.modeling import patching
from padfree_plugins.testing import faults
from padfree_plugins.testing.compiled import compile_report, counting_backend, host_reads
from tests import varlen_stand_in
from tests.conftest import make_examples, tiny_model

#: Example lengths of the rows a run trains on: one example alone, 1-token examples first, last and inside a row,
#: equal lengths, then random rows of 1-6 examples of 2-90 tokens (a row needs a token to predict: a lone 1-token
#: example has none, and its loss is NaN eagerly as compiled).
FIXED_ROWS = [[40], [1, 12], [12, 1, 1], [7, 1, 7, 30], [90, 2]]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (dynamo's caches and counters of an earlier test would hide its graphs)."""
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def row_lengths(steps: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    rows = list(FIXED_ROWS)
    while len(rows) < steps:
        rows.append([rng.randint(2, 90) for _ in range(rng.randint(1, 6))])
    return rows[:steps]


def host_for(backend: str, monkeypatch) -> PluginHost | None:
    return PluginHost({"cpu_varlen": varlen_stand_in.install(monkeypatch)}) if backend == "cpu_varlen" else None


def packed_batches(assembly, steps: int, seed: int = 0) -> list:
    rng = random.Random(seed + 1)
    return [assembly.collator([{"input_ids": ids, "labels": ids}
                               for ids in ([rng.randrange(5, 128) for _ in range(n)] for n in lengths)])
             for lengths in row_lengths(steps, seed)]


def train(model, assembly, batches) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses and gradients of SGD steps, one per batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for batch in batches:
        loss = assembly.forward(model, batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def compiled_and_eager(backend: str, monkeypatch, steps: int = 20):
    """The same model trained ``steps`` steps compiled (``fullgraph=True``) and eagerly, on rows of changing length
    and example count; returns both runs and the compile report."""
    model = tiny_model("llama", "causal_lm", num_key_value_heads=2).train()
    assembly = assemble(model, {"task": "causal_lm", "attention": backend}, host=host_for(backend, monkeypatch))
    batches = packed_batches(assembly, steps)
    eager = copy.deepcopy(model)
    with compile_report() as report:
        compiled = torch.compile(model, fullgraph=True, backend=counting_backend(report))
        compiled_run = train(compiled, assembly, batches)
    return compiled_run, train(eager, assembly, batches), report


def assert_runs_equal(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), atol=1e-5, rtol=0)
    for step, (grads, reference) in enumerate(zip(got[1], want[1])):
        for grad, expected in zip(grads, reference):
            torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("backend", ["exact", "cpu_varlen"])
def test_a_compiled_model_trains_as_eager_in_one_or_two_graphs_without_a_break(backend, monkeypatch):
    """20 SGD steps on rows of 1-6 examples of 1-90 tokens (1-token examples too): losses within 1e-5 and
    gradients within 1e-5 of eager at every step, at most 2 graphs (the first; one more when the python-int max
    lengths of ``varlen`` turn symbolic), no graph break (``fullgraph=True`` would raise at one)."""
    compiled, eager, report = compiled_and_eager(backend, monkeypatch)
    assert_runs_equal(compiled, eager)
    assert report.break_count == 0, report.breaks
    assert 1 <= report.graphs <= 2, report.graphs


def test_an_example_that_sees_its_neighbour_under_compile_fails_the_comparison(monkeypatch):
    """The deliberate fault: compiled attention treats the first two examples of every row as one (the second sees
    the first). The eager run is unchanged, and the comparison above fails."""
    with faults.examples_merge_under_compile():
        compiled, eager, _ = compiled_and_eager("exact", monkeypatch, steps=3)
    with pytest.raises(AssertionError):
        assert_runs_equal(compiled, eager)


def shifted_boundaries(batch):
    """``batch`` with its first inner boundary one token late: the row's tokens, cut at the wrong place."""
    wrong = dict(batch)
    cu = batch["cu_seq_lens_q"].clone()
    cu[1] += 1
    wrong["cu_seq_lens_q"] = wrong["cu_seq_lens_k"] = cu
    return wrong


def compiled_forward_raises(batch) -> bool:
    model = tiny_model("llama", "causal_lm")
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact"})
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assembly.forward(compiled, assembly.collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))  # compiles
    try:
        assembly.forward(compiled, batch(assembly))
    except RuntimeError as error:  # the guard's assert, raised from the compiled graph
        assert "does not match the packed row" in str(error)
        return True
    return False


def rows_with_shifted_boundaries(assembly):
    return shifted_boundaries(assembly.collator([{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}]))


def test_the_boundary_guard_still_raises_under_compile_and_a_silenced_guard_is_caught():
    """Boundaries that do not fall where position_ids restart fail the compiled forward as they fail the eager one;
    with the guard's compiled check silenced (the fault), the same forward runs: the test above would see it."""
    assert compiled_forward_raises(rows_with_shifted_boundaries)
    torch._dynamo.reset()
    with faults.boundary_guard_silenced():
        assert not compiled_forward_raises(rows_with_shifted_boundaries)


def test_the_varlen_path_reads_nothing_on_the_host(monkeypatch):
    """One eager forward + backward on the varlen path, the guard as on an accelerator (its check runs on the
    device): no data-shaped op, and one host read, transformers' own (``find_packed_sequence_indices`` reads
    ``.all()`` once per forward when it is not compiling; a compiled forward has none)."""
    monkeypatch.setattr(patching, "HOST_CHECKED_DEVICES", ())
    model = tiny_model("llama", "causal_lm", num_hidden_layers=4).train()
    assembly = assemble(model, {"task": "causal_lm", "attention": "cpu_varlen"},
                        host=host_for("cpu_varlen", monkeypatch))
    batch = assembly.collator([{"input_ids": ids, "labels": ids} for ids in ([5, 6, 7], [8] * 9, [9])])
    with host_reads() as seen:
        assembly.forward(model, batch).loss.backward()
    assert seen.data_shaped == {}
    assert seen.reads == {"__bool__": 1}, seen.reads


def test_the_device_side_guard_raises_as_the_host_one_does(monkeypatch):
    """On an accelerator (here: the CPU, told it is one) the eager guard checks on the device: the same boundaries
    fail, with the same message."""
    model = tiny_model("llama", "causal_lm")
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact"})
    wrong = rows_with_shifted_boundaries(assembly)
    monkeypatch.setattr(patching, "HOST_CHECKED_DEVICES", ())
    with pytest.raises(RuntimeError, match="does not match the packed row"):
        assembly.forward(model, wrong)


def compiled_trainer_run(kind: str, packed: bool):
    from tests.test_trainer import make_trainer

    torch._dynamo.reset()
    trainer, _ = make_trainer(kind, packed=packed, max_steps=20, torch_compile=True, torch_compile_backend="aot_eager")
    with compile_report() as report:
        trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    return trainer, report


#: The graph break of TRL's fused LM head (trl/kernels/chunked_logprob.py: ``torch.mm(..., out=tile)``), which
#: ``SFTTrainer`` adds to every model, padded or not.
TRL_FUSED_HEAD_BREAK = "non-contiguous `out=` tensor"


@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_trainer_with_torch_compile_trains_as_eager_in_at_most_two_graphs(kind):
    """``TrainingArguments(torch_compile=True)``, 20 steps of 4 examples of 2-60 tokens with partial labels: the
    curve within 1e-5 of eager. HF ``Trainer``: at most 2 graphs, no graph break. TRL ``SFTTrainer`` runs its own
    fused LM head inside the model's forward, which breaks the graph on TRL's side (its tiled matmul into an ``out=``
    view) in the padded run too: padding-free adds no break and no graph to TRL's padded compiled run."""
    from tests.test_trainer import losses, make_trainer

    eager, _ = make_trainer(kind, packed=True, max_steps=20)
    eager.train()
    compiled, report = compiled_trainer_run(kind, packed=True)
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), atol=1e-5, rtol=0)
    if kind == "hf":
        assert report.break_count == 0, report.breaks
        assert 1 <= report.unique_graphs <= 2, report.unique_graphs
        return
    _, padded = compiled_trainer_run(kind, packed=False)
    assert all(TRL_FUSED_HEAD_BREAK in reason for reason in report.breaks), report.breaks
    assert report.break_count <= padded.break_count, (report.breaks, padded.breaks)
    assert report.unique_graphs <= padded.unique_graphs, (report.unique_graphs, padded.unique_graphs)


def test_a_hybrid_with_exact_mixers_breaks_once_per_mixer_call_and_then_compiles_nothing(monkeypatch):
    """Bamba (Mamba2 layers around an attention layer), ``mixers: exact``: each Mamba2 call runs its examples eagerly
    (their lengths steer the run), one graph break per mixer call and no other. Every graph segment compiles at
    most twice (the first shapes, then dynamic ones): after a warm-up of 4 steps, 6 steps of new lengths compile
    nothing. Losses and gradients within 1e-5 of eager."""
    from tests.hybrids_common import hybrid_model

    model = hybrid_model("bamba").train()
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact", "mixers": "exact"})
    batches = packed_batches(assembly, 10, seed=3)
    eager = copy.deepcopy(model)
    with compile_report() as warm_up:
        compiled = torch.compile(model, backend=counting_backend(warm_up))
        first = train(compiled, assembly, batches[:4])
    with compile_report() as steady:
        second = train(compiled, assembly, batches[4:])
    mixer_breaks = [reason for reason in warm_up.breaks if "_run_packed_eagerly" in reason]
    assert mixer_breaks and warm_up.break_count == sum(warm_up.breaks[reason] for reason in mixer_breaks), \
        warm_up.breaks
    assert (steady.graphs, steady.break_count) == (0, 0), (steady.graphs, steady.breaks)
    assert_runs_equal((first[0] + second[0], first[1] + second[1]), train(eager, assembly, batches))


def test_a_padded_batch_under_unpad_off_compiled_behaves_as_eager():
    """``unpad: off``: a padded batch runs the model's own code, compiled as eagerly (the same logits); a batch packed
    without its boundaries gets the same clear error compiled as eagerly."""
    model = tiny_model("llama", "causal_lm")
    assemble(model, {"task": "causal_lm", "unpad": "off"})
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(5, 128, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = mask[2, 3:] = 0
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                               model(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=0)
    packed = {"input_ids": ids[:1], "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])}
    for run in (model, compiled):
        with pytest.raises(BoundaryError, match="restart inside a row but no cu_seq_lens_q"):
            run(**packed)


@pytest.mark.parametrize("backward", ["cpu kernels", "by hand"])
@pytest.mark.parametrize("case", ["causal", "bidirectional", "window", "gqa", "shared keys"])
def test_the_exact_op_and_its_backward_equal_eager_exact_attention(case, backward, monkeypatch):
    """``padfree::exact_varlen`` (the compiled graph's call of ``exact``) and its backward — ATen's CPU flash kernels,
    or the hand-written one other devices use — against eager ``exact_varlen`` differentiated by autograd, float64:
    outputs and gradients within 1e-12. ``opcheck`` checks the op's registration (its fake tensor, its autograd) as
    torch.compile relies on it."""
    from padfree_plugins.modeling.attention import backends
    from padfree_plugins.modeling.attention.backends import exact_varlen, exact_varlen_op

    if backward == "by hand":
        monkeypatch.setattr(backends, "_attention_grads_cpu", backends._attention_grads)

    generator = torch.Generator().manual_seed(0)
    lengths_q = [1, 7, 7, 30, 3]
    lengths_k = [length + 4 * (i % 2) for i, length in enumerate(lengths_q)] if case == "shared keys" else lengths_q
    heads_k = 2 if case == "gqa" else 4
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
                  for ls in (lengths_q, lengths_k))
    query = torch.randn(sum(lengths_q), 4, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    key, value = (torch.randn(sum(lengths_k), heads_k, 8, dtype=torch.float64, generator=generator,
                              requires_grad=True) for _ in range(2))
    causal, window, scale = case != "bidirectional", 5 if case == "window" else None, 0.3
    grad = torch.randn(sum(lengths_q), 4, 8, dtype=torch.float64, generator=generator)
    got = exact_varlen_op(query, key, value, cu_q, cu_k, causal, scale, -1 if window is None else window)
    want = exact_varlen(query, key, value, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal, scale=scale,
                        window=window)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for a, b in zip(torch.autograd.grad(got, (query, key, value), grad),
                    torch.autograd.grad(want, (query, key, value), grad)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.library.opcheck(exact_varlen_op, (query, key, value, cu_q, cu_k, causal, scale, -1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


TASKS = {"seq_cls-llama": ("llama", "seq_cls", "configs/seq_cls.yaml"),
         "seq_cls-bert": ("bert", "seq_cls", "configs/seq_cls.yaml"),
         "embedding-bert": ("bert", "base", {"task": "embedding", "pooling": "mean"}),
         "hidden_states-llama": ("llama", "base", {"task": "hidden_states"})}


@pytest.mark.parametrize("name,head,config", TASKS.values(), ids=TASKS.keys())
def test_every_task_compiles_whole_and_answers_as_eager(name, head, config):
    """The per-example tasks (a decoder's and an encoder's classifier, mean-pooled embeddings, hidden states):
    ``fullgraph=True`` over rows of changing length and example count, at most 2 graphs, the eager outputs."""
    from tests.tasks_common import model_for
    from tests.test_tasks_seq_cls import labelled

    model = model_for(name, head=head, **({"num_labels": 3} if head == "seq_cls" else {}))
    assembly = assemble(model, config)
    with compile_report() as report:
        compiled = torch.compile(model, fullgraph=True, backend=counting_backend(report))
        for seed, lengths in enumerate([[1, 13, 7], [30, 7, 2, 9], [5, 60]]):
            examples = make_examples(lengths, seed=seed)
            batch = assembly.collator(labelled(examples, "single_label") if head == "seq_cls" else examples)
            got, want = assembly.forward(compiled, batch), assembly.forward(model, batch)
            for key in ("loss", "logits", "last_hidden_state"):
                if getattr(want, key, None) is not None:
                    torch.testing.assert_close(getattr(got, key), getattr(want, key), atol=1e-5, rtol=1e-5)
    assert report.break_count == 0 and 1 <= report.graphs <= 2, (report.graphs, report.breaks)
