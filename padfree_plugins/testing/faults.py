"""Deliberate packing bugs, to prove that an equivalence test can fail and to measure how small a bug it catches.

Both leave a model run on one example alone exactly as it was, and change only packed rows:

* :func:`leak_across_boundaries`: after one layer, the first token of every example but the first receives
  ``strength ×`` the hidden state of the token before it, the last token of the previous example;
* :func:`positions_run_on`: learned absolute positions number the whole packed row instead of restarting at every
  example.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from padfree_plugins.modeling.patching import unwrap_model
from padfree_plugins.packing.batch import restarts


def layers_of(model: Any) -> torch.nn.ModuleList:
    """The model's stack of transformer layers: its first ``ModuleList`` of ``num_hidden_layers`` modules."""
    inner = unwrap_model(model)
    count = getattr(inner.config.get_text_config(), "num_hidden_layers", None)
    lists = [module for module in inner.modules() if isinstance(module, torch.nn.ModuleList) and len(module)]
    for candidate in lists:
        if count is None or len(candidate) == count:
            return candidate
    raise ValueError(f"no stack of {count} layers found in {type(inner).__name__}")


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _replace_hidden(output: Any, hidden: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    if isinstance(output, list):
        return [hidden, *output[1:]]
    return hidden


@contextmanager
def leak_across_boundaries(model: Any, strength: float = 1e-3, layer: int = 0,
                           backward_only: bool = False) -> Iterator[None]:
    """Within the block, the output of layer ``layer`` leaks across example boundaries on packed rows: the first
    token of example ``i > 0`` gets ``strength ×`` the previous token's hidden state added (a relative leak of
    about ``strength``). A row of one example, or a padded batch, is left alone. Works patched or not: the
    boundaries are read from ``cu_seq_lens_q`` (or from where ``position_ids`` restart) of the base model's call.

    ``backward_only=True`` leaks gradients only: the forward values stay exact (the leak is added and subtracted
    detached), but gradients flow back across the boundary, as from a wrong backward kernel.
    """
    inner = unwrap_model(model)
    base = getattr(inner, "base_model", inner)
    target = layers_of(inner)[layer]
    state: dict[str, Any] = {}

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        cu = kwargs.get("cu_seq_lens_q")
        state["cu"] = cu.long().cpu() if isinstance(cu, torch.Tensor) else restarts(kwargs.get("position_ids"))

    def forget(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        state.pop("cu", None)

    def leak(module: Any, args: tuple, output: Any) -> Any:
        cu = state.get("cu")
        if cu is None or cu.numel() <= 2:
            return None
        hidden = _hidden(output)
        mask = torch.zeros(hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        mask[cu[1:-1].to(hidden.device)] = strength
        previous = torch.roll(hidden, 1, dims=1)
        if backward_only:
            previous = previous - previous.detach()
        return _replace_hidden(output, hidden + mask[None, :, None] * previous)

    handles = [base.register_forward_pre_hook(record, with_kwargs=True),
               base.register_forward_hook(forget, with_kwargs=True, always_call=True),
               target.register_forward_hook(leak)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run_on(position_ids: torch.Tensor) -> torch.Tensor:
    """Positions counting on from the row's first one: what a model that ignores the restarts would use."""
    start = position_ids[..., :1]
    return start + torch.arange(position_ids.shape[-1], device=position_ids.device, dtype=position_ids.dtype)


@contextmanager
def positions_run_on(model: Any) -> Iterator[None]:
    """Within the block, the model's learned absolute position table is looked up at ``p, p+1, …`` across a packed
    row from its first position, instead of at positions restarting at every example; an example run alone gets
    the same positions as before. The model's inputs are unchanged, so the patch's guard sees nothing.

    Only absolute positions (BERT-style ``position_embeddings``, GPT-2's ``wpe``): rotary embeddings see only
    distances within an example, so a RoPE model with positions running on computes the same attention."""
    inner = unwrap_model(model)
    tables = [m for name, m in inner.named_modules()
              if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in ("position_embeddings", "wpe")]
    if not tables:
        raise ValueError(f"{type(inner).__name__} has no learned position table (position_embeddings / wpe); "
                         "rotary positions are shift-invariant, so positions running on would change nothing")

    def table_positions(module: Any, args: tuple) -> tuple:
        return (_run_on(args[0]), *args[1:])

    with ExitStack() as stack:
        for module in tables:
            stack.callback(module.register_forward_pre_hook(table_positions).remove)
        yield
