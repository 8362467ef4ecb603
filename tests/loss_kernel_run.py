"""Liger's fused linear cross-entropy against the torch tiles, on DEVICE (argv[1]: cuda, or cpu under Triton's
interpreter, TRITON_INTERPRET=1): the head's loss alone (hidden-state and weight gradients) and one packed step of a
tiny Llama through ``assembly.forward``. Prints the largest differences as one JSON line; exits 1 where they exceed
the tolerances or Liger did not compute the loss, 77 where Triton cannot run a kernel here at all. Run by
tests/test_loss_kernel.py (a subprocess, so that Triton reads TRITON_INTERPRET before it is imported)."""

from __future__ import annotations

import json
import sys

import torch

from padfree_plugins.modeling import loss_kernel
from padfree_plugins.modeling.tiling import TiledHeadLoss
from padfree_plugins import assemble
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from tests.conftest import make_examples
from tests.test_tiling import LENGTHS, causal_lm

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
CANNOT_RUN = 77


def triton_runs(device: str) -> str | None:
    """None where Triton runs a trivial kernel on ``device``, else the error."""
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def double(x, out, n, BLOCK: tl.constexpr):
            offsets = tl.arange(0, BLOCK)
            tl.store(out + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)

        x = torch.arange(5.0, device=device)
        out = torch.empty_like(x)
        double[(1,)](x, out, 5, BLOCK=8)
        assert torch.equal(out, x * 2), out
    except Exception as error:  # noqa: BLE001 - any failure means: no Triton here
        return f"{type(error).__name__}: {error}"
    return None


def step(device: str, kernel: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every gradient of one packed step of a tiny Llama with the tiled loss by ``kernel``."""
    model = causal_lm("llama").to(device)
    assembly = assemble(model, {"task": "causal_lm", "memory": {"tile_tokens": 16, "loss_kernel": kernel}})
    try:
        batch = keep_labelled_logits(assembly.collator(make_examples(LENGTHS, seed=3))).to(device)
        loss = assembly.forward(model, batch).loss
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    finally:
        assembly.undo()


def head_only(device: str, smoothing: float, divisor: float | None) -> dict[str, float]:
    """The loss of hidden [K, H] @ weight.T + bias against labels (some -100), by Liger and by the torch tiles."""
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(75, 32, generator=generator) / 4).to(device).requires_grad_()
    weight = torch.randn(130, 32, generator=generator).to(device).requires_grad_()
    bias = torch.randn(130, generator=generator).to(device).requires_grad_()
    labels = torch.randint(0, 130, (75,), generator=generator).to(device)
    labels[::4] = -100
    count = torch.tensor(float((labels != -100).sum()) if divisor is None else divisor, device=device)
    liger = loss_kernel.liger_head_loss(hidden, weight, bias, labels, count, smoothing)
    want = TiledHeadLoss.apply(hidden, weight, bias, labels, count, 16, smoothing)
    got_grads = torch.autograd.grad(liger, (hidden, weight, bias))
    want_grads = torch.autograd.grad(want, (hidden, weight, bias))
    diffs = {"loss": (liger - want).abs().item()}
    for name, got, wanted in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        diffs[name] = (got - wanted).abs().max().item()
    return diffs


def model_step(device: str) -> dict[str, float]:
    """One packed step of a tiny Llama with the tiled loss by Liger and by the torch tiles: loss and every gradient."""
    calls = []
    original = loss_kernel.liger_head_loss

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    loss_kernel.liger_head_loss = counted
    try:
        got = step(device, "liger")
    finally:
        loss_kernel.liger_head_loss = original
    want = step(device, "torch")
    assert calls, "Liger did not compute the loss"
    assert got[1].keys() == want[1].keys() and "lm_head.weight" in want[1]
    grads = {name: (got[1][name] - grad).abs().max().item() for name, grad in want[1].items()}
    return {"loss": (got[0] - want[0]).abs().item(), "lm_head.weight": grads["lm_head.weight"],
            "every parameter": max(grads.values())}


def main(device: str) -> int:
    why = triton_runs(device)
    if why is not None:
        print(f"Triton cannot run a kernel on {device} here: {why}", file=sys.stderr)
        return CANNOT_RUN
    figures = {f"head smoothing={s} divisor={d}": head_only(device, s, d) for s in (0.0, 0.1) for d in (None, 250.0)}
    figures["tiny llama step"] = model_step(device)
    print(json.dumps(figures))
    worst_loss = max(f["loss"] for f in figures.values())
    worst_grad = max(v for f in figures.values() for k, v in f.items() if k != "loss")
    return 0 if worst_loss <= LOSS_TOL and worst_grad <= GRAD_TOL else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
