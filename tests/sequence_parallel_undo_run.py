"""torchrun worker of tests/test_sequence_parallel_undo.py: one model assembled, undone and assembled again under
sequence parallelism with its mixers split, then gathered, then split again, on 2 CPU processes (gloo).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_undo_run.py OUT

Every rank builds the tiny Qwen3.5 hybrid of tests/sequence_parallel_run.py (gated delta rule layers around an
attention layer), records the model's own padded call and its state (:func:`~padfree_plugins.testing.undo.model_state`),
and computes the one-process reference: the group's two micro-batches packed in one row through an assembly without
sequence parallelism (loss and gradients), undone. Then, on the same model object, for each of :data:`MODES`: assemble
with ``sequence_parallel: {size: 2, mixers: MODE}``, run this rank's micro-batch (loss and gradients summed over the
group), undo, and check the model's state and its padded call against the ones recorded first. Last, the deliberate
fault (:func:`undo_in_installation_order`): split, undone in installation order, then gather. Rank 0 writes ``OUT``.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

import torch
import torch.distributed as dist

from padfree_plugins import assemble
from padfree_plugins.batching.distributed import num_label_tokens
from padfree_plugins.modeling.patching import ModelPatch
from padfree_plugins.packing.padded import pad_examples
from padfree_plugins.testing.undo import assert_state_restored, model_state
from tests.distributed_common import finish, gloo_group, leave
from tests.sequence_parallel_run import build, micro_batches

MODEL = "qwen3_5_text"
#: The assemblies, in order, on one model object: every change of mode follows an undo of the other.
MODES = ("split", "gather", "split")


def padded_logits(model, examples: list[dict]) -> torch.Tensor:
    inputs = pad_examples(examples, pad_token_id=0, side="right")
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def grads_of(model) -> dict[str, torch.Tensor]:
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def reference(model, micro: list[list[dict]], rank: int) -> tuple[torch.Tensor, float, dict]:
    """One process: every rank's micro-batch in one packed row (the group's row), loss and gradients; and the group's
    label count (of each rank's own micro-batch, summed), which every run divides by."""
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact"})
    try:
        count = num_label_tokens(assembly.collator(micro[rank])).clone()
        dist.all_reduce(count)
        everyone = [example for examples in micro for example in examples]
        loss = assembly.forward(model, assembly.collator(everyone), num_items_in_batch=count).loss
        loss.backward()
    finally:
        assembly.undo()
    return count, float(loss.detach()), grads_of(model)


def sequence_parallel(model, mode: str, mine: list[dict], count: torch.Tensor) -> dict:
    """This rank's micro-batch through the model assembled with its mixers ``mode``; the group's loss and gradients,
    and what shows which mixers ran; undone."""
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact",
                                "sequence_parallel": {"size": 2, "mixers": mode}})
    try:
        kinds = [type(module.__dict__.get("forward")).__name__ for module in model.modules()]
        loss = assembly.forward(model, assembly.collator(mine), num_items_in_batch=count).loss
        loss.backward()
    finally:
        assembly.undo()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = grads_of(model)
    for grad in grads.values():
        dist.all_reduce(grad)
    return {"loss": float(total), "grads": grads, "split": kinds.count("SplitMixer"),
            "gathered": kinds.count("WholeRowMixer")}


@contextlib.contextmanager
def undo_in_installation_order():
    """The deliberate fault: ``undo`` takes the assembly's pieces off first installed first (as before the fix)."""
    right = ModelPatch.undo

    def wrong(self):
        for handle in list(self.handles):
            handle.remove()
        self.handles.clear()
        right(self)

    ModelPatch.undo = wrong
    try:
        yield
    finally:
        ModelPatch.undo = right


def run(rank: int) -> dict:
    model = build(MODEL)
    (micro,) = micro_batches(2)[:1]
    everyone = [example for examples in micro for example in examples]
    want_padded = padded_logits(model, everyone)
    before = model_state(model)
    count, want_loss, want_grads = reference(model, micro, rank)
    assert_state_restored(before, model)
    runs = []
    for mode in MODES:
        result = {"mode": mode}
        try:
            got = sequence_parallel(model, mode, micro[rank], count)
            result.update(loss=abs(got["loss"] - want_loss), split=got["split"], gathered=got["gathered"],
                          grads=max(float((got["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-3))
                                    for n, g in want_grads.items()))
            assert_state_restored(before, model)
            result["padded"] = float((padded_logits(model, everyone) - want_padded).abs().max())
        except Exception:
            result["error"] = traceback.format_exc()
            print(f"rank {rank}, {mode}: {result['error']}", file=sys.stderr, flush=True)
        runs.append(result)
        dist.barrier()
    fault = {}
    try:
        with undo_in_installation_order():
            sequence_parallel(model, "split", micro[rank], count)
            fault["left"] = [name for name, module in model.named_modules() if "forward" in module.__dict__]
            sequence_parallel(model, "gather", micro[rank], count)
    except Exception as error:
        fault["error"] = f"{type(error).__name__}: {error}"
    return {"runs": runs, "fault": fault, "reference_loss": want_loss}


def main(out: str) -> None:
    gloo_group()
    result = run(dist.get_rank())
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    finish(gathered, out)


if __name__ == "__main__":
    main(sys.argv[1])
    leave()
