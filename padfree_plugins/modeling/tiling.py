"""Tiled computation of the layers whose working set grows with the row: the MLP of every decoder layer and the LM
head with its loss (as DeepSpeed ALST does for long rows).

* :class:`TiledCall` runs a token-local module over tiles of a packed row's tokens under ``no_grad`` and keeps only
  its inputs; its backward recomputes the module tile by tile with gradients and backpropagates each tile at once,
  so the module's intermediate activations (``tile × intermediate``) live for one tile at a time. The parameters'
  gradients are returned once per call (summed over the tiles), so their hooks (FSDP2's reduce-scatter, ZeRO's)
  fire once per layer. Random state (a LoRA adapter's dropout) is replayed exactly in the recompute.
* :func:`tile_mlps` puts it on the feed-forward of every decoder layer: a dense MLP whole, or the routed experts
  of a mixture of experts (its router runs untiled, so router logits and the load-balancing loss are unchanged) and
  its shared experts; a feed-forward that is not token-local is refused, naming it.
* :class:`TiledHeadLoss` projects tiles of the labelled hidden states onto the vocabulary and sums their
  cross-entropy; its backward recomputes each tile's logits. The logits of the whole row never exist.
  :func:`tiled_loss` runs a model's own forward with its LM head computing that loss, normalised exactly as
  transformers' ``ForCausalLMLoss`` (by ``num_items_in_batch``, or the number of labels). Where liger-kernel is
  installed and the call fits, Liger's fused linear cross-entropy computes it instead (``memory.loss_kernel``,
  :mod:`~padfree_plugins.modeling.loss_kernel`).

Exact: the layers are token-local, so where the tiles cut changes nothing but the order of float sums over tiles
(the parameters' gradients: ~1e-7 relative in fp32).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from padfree_plugins.errors import ConfigError, UnsupportedArchitectureError
from padfree_plugins.modeling.loss_kernel import LossKernel

logger = logging.getLogger("padfree_plugins")
#: Smallest MLP tile ``tile_tokens: auto`` picks, in tokens.
AUTO_MIN_TILE = 1024
#: Smallest loss tile ``tile_tokens: auto`` picks, in tokens.
AUTO_MIN_LOSS_TILE = 128


def auto_tiles(model_config: Any) -> tuple[int, int]:
    """``tile_tokens: auto``: (MLP tile, loss tile) in tokens. An MLP tile of ``max(1024, hidden_size)`` tokens
    holds an intermediate about the size of one MLP weight matrix (ALST's choice); a loss tile's logits are no more
    elements than an MLP tile's intermediate (``MLP tile x intermediate_size / vocab_size`` tokens, at least 128, a
    multiple of 64): Llama-8B's shape gets tiles of 4096 and 448 tokens."""
    text = model_config.get_text_config()
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0) or 1
    intermediate = int(getattr(text, "intermediate_size", 0) or getattr(text, "moe_intermediate_size", 0) or hidden)
    mlp = max(AUTO_MIN_TILE, hidden)
    return mlp, max(AUTO_MIN_LOSS_TILE, mlp * intermediate // vocab // 64 * 64)


def resolve_tiles(tile_tokens: Any, model_config: Any) -> tuple[int, int]:
    """(MLP tile, loss tile) in tokens for the config's ``memory.tile_tokens`` (``auto`` or a number of tokens)."""
    if tile_tokens == "auto":
        return auto_tiles(model_config)
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ConfigError(f"memory.tile_tokens must be auto or a number of tokens of at least 1, got {tile_tokens!r}: "
                          "a tile holds at least one token")
    return tile_tokens, tile_tokens


def _token_dim(tensor: torch.Tensor) -> int:
    """The token dimension of a feed-forward's input: ``[1, T, H]`` (a dense MLP) or ``[T, …]`` (routed experts)."""
    return 1 if tensor.ndim == 3 else 0


def _rng_states(device: torch.device) -> tuple[Any, Any]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _replayed_rng(states: tuple[Any, Any], device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        if devices:
            torch.cuda.set_rng_state(states[1], device)
        yield


def run_tile(fn: Callable, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tile's output: ``fn`` on the tile's pieces of the inputs (one place, replaced by a fault in the tests)."""
    return fn(*pieces)


class HeldGathered:
    """DeepSpeed ZeRO-3: a layer's partitioned parameters gathered once for all its tiles. ZeRO's own module hooks
    gather them at the first tile; a mark in each one's ``ds_active_sub_modules`` keeps ZeRO's hooks from releasing
    them between tiles; :meth:`let_go` (before the last tile's release) lets ZeRO's hooks release them as usual."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in module.parameters() if hasattr(p, "ds_active_sub_modules")]
        self.mark = f"padfree-plugins:tiled:{id(module)}"

    def __enter__(self) -> "HeldGathered":
        for p in self.params:
            p.ds_active_sub_modules.add(self.mark)
        return self

    def let_go(self) -> None:
        for p in self.params:
            p.ds_active_sub_modules.discard(self.mark)

    def __exit__(self, *exc: Any) -> None:
        self.let_go()


def _zero_partitioned(module: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def spans(total: int, tile: int) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` of each tile of a row of ``total`` tokens."""
    return tuple((start, min(tile, total - start)) for start in range(0, total, tile))


def agreed_spans(total: int, tile: int, device: torch.device) -> tuple[tuple[int, int], ...]:
    """ZeRO-3: the tiles of a row of ``total`` tokens, as many on every rank (the most any rank needs, a collective):
    ZeRO gathers parameters, and prefetches by the order of module calls, collectively, so every rank must call the
    layer's modules as many times. Tiles of ``ceil(total / count)`` tokens; the last ones may be empty."""
    import torch.distributed as dist

    count = torch.tensor(max(1, math.ceil(total / tile)), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    count = int(count.item())
    size = math.ceil(total / count)
    return tuple((min(i * size, total), max(0, min(size, total - i * size))) for i in range(count))


def run_tiles(fn: Callable, inputs: Sequence[torch.Tensor], dim: int, cuts: Sequence[tuple[int, int]],
              module: torch.nn.Module) -> torch.Tensor:
    """``fn`` on every tile (``cuts``: start, size) of ``inputs`` (no recompute), concatenated; under ZeRO-3 the
    parameters are gathered once for all the tiles (:class:`HeldGathered`)."""
    outputs = []
    with HeldGathered(module) as held:
        for index, (start, size) in enumerate(cuts):
            if index == len(cuts) - 1:
                held.let_go()  # ZeRO's hooks release the parameters after the last tile
            outputs.append(run_tile(fn, [x.narrow(dim, start, size) for x in inputs]))
    return torch.cat(outputs, dim=_token_dim(outputs[0]))


class TiledCall(torch.autograd.Function):
    """``fn(*inputs)`` over tiles of ``tile`` tokens (every input cut along its token dimension), recomputed tile by
    tile in the backward. ``params``: the tensors ``fn`` reads besides its inputs that need gradients. Under ZeRO-3
    (``module``'s parameters partitioned) ``params`` is an empty anchor that makes the backward run; the parameters
    stay gathered over the tiles, and their gradients accumulate over the tiles into ``.grad`` and reach ZeRO's
    reduce once, at the last tile (``ds_grad_is_ready``, as DeepSpeed's ``TiledMLP``)."""

    @staticmethod
    def forward(ctx, fn: Callable, module: torch.nn.Module, cuts: Sequence[tuple[int, int]], count: int,
                *tensors: torch.Tensor) -> torch.Tensor:
        inputs, params = tensors[:count], tensors[count:]
        dim = _token_dim(inputs[0])
        ctx.fn, ctx.module, ctx.cuts, ctx.count, ctx.dim = fn, module, cuts, count, dim
        ctx.rng = _rng_states(inputs[0].device)
        ctx.save_for_backward(*inputs)
        ctx.params = params
        return run_tiles(fn, inputs, dim, cuts, module)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        inputs, dim = ctx.saved_tensors, ctx.dim
        wants = [x.is_floating_point() and need for x, need in zip(inputs, ctx.needs_input_grad[4:4 + ctx.count])]
        if _zero_partitioned(ctx.module):
            input_grads = _zero_backward(ctx, inputs, wants, grad_output)
            return (None, None, None, None, *input_grads, *[None] * len(ctx.params))
        params = ctx.params
        input_grads = [torch.zeros_like(x) if want else None for x, want in zip(inputs, wants)]
        trained = [p for p, need in zip(params, ctx.needs_input_grad[4 + ctx.count:]) if need]
        param_grads: list[Any] = [None] * len(trained)
        out_dim = _token_dim(grad_output)
        with _replayed_rng(ctx.rng, inputs[0].device), torch.enable_grad():
            for start, size in ctx.cuts:
                pieces = [x.narrow(dim, start, size).detach().requires_grad_(want) for x, want in zip(inputs, wants)]
                output = run_tile(ctx.fn, pieces)
                targets = [p for p, want in zip(pieces, wants) if want] + trained
                grads = torch.autograd.grad(output, targets, grad_output.narrow(out_dim, start, size),
                                            allow_unused=True)
                grads = iter(grads)
                for i, want in enumerate(wants):
                    if want:
                        got = next(grads)
                        if got is not None:
                            input_grads[i].narrow(dim, start, size).copy_(got)
                for i, got in enumerate(grads):
                    if got is not None:
                        param_grads[i] = got if param_grads[i] is None else param_grads[i] + got
        param_grads_iter = iter(param_grads)
        every_param = [next(param_grads_iter) if need else None for need in ctx.needs_input_grad[4 + ctx.count:]]
        return (None, None, None, None, *input_grads, *every_param)


def _zero_backward(ctx: Any, inputs: Sequence[torch.Tensor], wants: list[bool], grad_output: torch.Tensor) -> list:
    """The backward of :class:`TiledCall` under ZeRO-3: each tile recomputed through ``module``'s (hooked) calls,
    the parameters held gathered from the first tile to the last (:class:`HeldGathered`); their gradients accumulate
    in ``.grad`` and ZeRO reduces them once, after the last tile (``ds_grad_is_ready`` false before it)."""
    dim, cuts = ctx.dim, ctx.cuts
    trained = [p for p in ctx.module.parameters() if p.requires_grad]
    input_grads = [torch.zeros_like(x) if want else None for x, want in zip(inputs, wants)]
    out_dim = _token_dim(grad_output)
    try:
        with _replayed_rng(ctx.rng, inputs[0].device), torch.enable_grad(), HeldGathered(ctx.module) as held:
            for index, (start, size) in enumerate(cuts):
                last = index == len(cuts) - 1
                for p in trained:
                    p.ds_grad_is_ready = last
                pieces = [x.narrow(dim, start, size).detach().requires_grad_(want) for x, want in zip(inputs, wants)]
                output = run_tile(ctx.fn, pieces)
                if last:
                    held.let_go()  # ZeRO's post-backward hooks release the parameters after this tile
                targets = [p for p, want in zip(pieces, wants) if want] + trained
                if targets and output.requires_grad:
                    torch.autograd.backward(output, grad_output.narrow(out_dim, start, size), inputs=targets)
                for i, (piece, want) in enumerate(zip(pieces, wants)):
                    if want and piece.grad is not None:
                        input_grads[i].narrow(dim, start, size).copy_(piece.grad)
    finally:
        for p in trained:
            p.ds_grad_is_ready = True
    return input_grads


def tiled(fn: Callable, module: torch.nn.Module, tile: int, *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` (a call of ``module``'s) over tiles of ``tile`` tokens: directly when the row fits one tile;
    under ``no_grad`` tile by tile without recomputation. Under DeepSpeed ZeRO-3 the module's parameters are
    gathered once per call, not once per tile, and their gradients reach ZeRO's reduce once per call."""
    dim = _token_dim(inputs[0])
    zero = _zero_partitioned(module)
    total = inputs[0].shape[dim]
    cuts = agreed_spans(total, tile, inputs[0].device) if zero else spans(total, tile)
    if len(cuts) == 1:
        return fn(*inputs)
    params = [p for p in module.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (params or any(x.requires_grad for x in inputs)):
        return run_tiles(fn, inputs, dim, cuts, module)
    if zero:  # the parameters are not the Function's inputs (their data is ZeRO's placeholder outside the layer)
        params = [inputs[0].new_empty(0).requires_grad_()] if params else []
    return TiledCall.apply(fn, module, cuts, len(inputs), *inputs, *params)


# -- which modules are tiled ----------------------------------------------------------------------------------------

#: Attribute names of a decoder layer's feed-forward, in the order tried.
FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe")
#: Leaf modules a token-local MLP may hold (besides activations and peft's adapter containers).
TOKEN_LOCAL_LEAVES = (torch.nn.Linear, torch.nn.Dropout, torch.nn.Identity)
#: Class-name endings of transformers' dense feed-forwards.
DENSE_SUFFIXES = ("MLP", "Mlp", "FeedForward")


def _is_activation(module: torch.nn.Module) -> bool:
    return type(module).__module__ in ("torch.nn.modules.activation", "transformers.activations")


def _empty_container(module: torch.nn.Module) -> bool:
    """An empty ``ModuleDict`` / ``ParameterDict`` (peft keeps them for adapter kinds a layer does not use)."""
    return isinstance(module, (torch.nn.ModuleDict, torch.nn.ParameterDict, torch.nn.ModuleList)) and not len(module)


def _non_token_local_leaves(module: torch.nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in module.modules() if not list(m.children()) and m is not module
                   and not isinstance(m, TOKEN_LOCAL_LEAVES) and not _is_activation(m) and not _empty_container(m)})


def _is_dense_mlp(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith(DENSE_SUFFIXES) and not _non_token_local_leaves(module)


def _is_experts(module: torch.nn.Module) -> bool:
    """transformers' routed experts (``…Experts``: every token's output from its own hidden state, expert ids and
    weights)."""
    return (type(module).__name__.endswith("Experts") and type(module).__module__.startswith("transformers.")
            and not _non_token_local_leaves(module))


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's stack of layers (a vision-language model's: its language model's)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UnsupportedArchitectureError(f"memory.tile_tokens: {type(model).__name__} has no decoder stack of "
                                           "layers to tile (get_decoder().layers)")
    return layers


def tiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :func:`tile_mlps` tiles in ``model``'s decoder layers; raises
    :class:`UnsupportedArchitectureError`, naming the layer and its feed-forward, where one is not token-local."""
    chosen = []
    for index, layer in enumerate(_layers(model)):
        name = next((n for n in FEED_FORWARD_NAMES if isinstance(getattr(layer, n, None), torch.nn.Module)), None)
        if name is None:
            raise UnsupportedArchitectureError(
                f"memory.tile_tokens: layer {index} ({type(layer).__name__}) has no feed-forward named "
                f"{' / '.join(FEED_FORWARD_NAMES)}; its MLP cannot be tiled. Set memory.tile_mlp: false")
        ffn = getattr(layer, name)
        if _is_dense_mlp(ffn):
            chosen.append(ffn)
            continue
        experts = [m for m in ffn.children() if _is_experts(m)]
        dense = [m for m in ffn.children() if _is_dense_mlp(m)]
        if not experts:
            odd = _non_token_local_leaves(ffn)
            raise UnsupportedArchitectureError(
                f"memory.tile_tokens: the feed-forward of layer {index} ({type(ffn).__name__}) is not known to be "
                f"token-local{' (it holds ' + ', '.join(odd) + ')' if odd else ''}: tiles of its tokens could change "
                "its output. Set memory.tile_mlp: false (the loss can still be tiled)")
        chosen.extend([*experts, *dense])
    return chosen


@dataclass
class MLPTiling:
    """Tiled feed-forwards installed on a model (an instance ``forward`` per module); ``remove()`` undoes it."""

    tile: int
    modules: list[torch.nn.Module] = field(default_factory=list)

    @classmethod
    def install(cls, model: torch.nn.Module, tile: int) -> "MLPTiling":
        """Tile the feed-forward of every decoder layer of ``model`` (checked first: nothing changes if refused)."""
        if tile < 1:
            raise ConfigError(f"memory.tile_tokens must be at least 1 token, got {tile}")
        modules = tiled_modules(model)
        tiling = cls(tile)
        for module in modules:
            if "forward" in module.__dict__:
                raise UnsupportedArchitectureError(
                    f"{type(module).__name__}.forward is already replaced on the instance (tiled twice, or by another "
                    "library); undo that first")
        for module in modules:
            original = type(module).forward.__get__(module)
            module.forward = _TiledForward(original, module, tile)
            tiling.modules.append(module)
        return tiling

    def remove(self) -> None:
        for module in self.modules:
            if isinstance(module.__dict__.get("forward"), _TiledForward):
                del module.__dict__["forward"]
        self.modules.clear()


@dataclass
class _TiledForward:
    """A module's forward over tiles of its tokens (its tensor arguments cut along the token dimension)."""

    original: Callable
    module: torch.nn.Module
    tile: int

    def __call__(self, *args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if kwargs or not args or not all(isinstance(a, torch.Tensor) for a in args):
            return self.original(*args, **kwargs)
        return tiled(self.original, self.module, self.tile, *args)


# -- the LM head and its loss ----------------------------------------------------------------------------------------


class TiledHeadLoss(torch.autograd.Function):
    """The summed cross-entropy of ``hidden [K, H] @ weight.T (+ bias)`` against ``labels [K]`` (-100 ignored), over
    tiles of ``tile`` rows, divided by ``divisor``; the backward recomputes each tile's logits. ``smoothing`` ε: each
    token's loss is ``(1 - ε) · nll + ε / V · Σ_v -log p_v``, as transformers' ``LabelSmoother``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, divisor, tile, smoothing=0.0):
        ctx.tile, ctx.smoothing = tile, smoothing
        ctx.save_for_backward(hidden, weight, bias, labels, divisor)
        sums, counts = [hidden.new_zeros((), dtype=torch.float32)], [labels.new_zeros(())]  # a row with no labels
        for start in range(0, hidden.shape[0], tile):
            logits = F.linear(hidden[start:start + tile], weight, bias).float()
            target = labels[start:start + tile]
            sums.append(F.cross_entropy(logits, target, ignore_index=-100, reduction="sum", label_smoothing=smoothing))
            counts.append((target != -100).sum())
        return normalised(sums, counts, divisor)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, divisor = ctx.saved_tensors
        grad = grad / divisor
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] \
            else None
        for start in range(0, hidden.shape[0], ctx.tile):
            piece, target = hidden[start:start + ctx.tile], labels[start:start + ctx.tile]
            # d(sum CE)/d logits = softmax - (1 - ε) one_hot - ε / V, rows of ignored labels zero; in place, one
            # tile of logits
            dlogits = F.linear(piece, weight, bias).float()
            dlogits.sub_(dlogits.amax(-1, keepdim=True)).exp_()
            dlogits.div_(dlogits.sum(-1, keepdim=True))
            if ctx.smoothing:
                dlogits.sub_(ctx.smoothing / dlogits.shape[-1])
            kept = target != -100
            rows = torch.nonzero(kept).reshape(-1)
            dlogits[rows, target[rows]] -= 1 - ctx.smoothing
            dlogits.mul_((kept * grad).unsqueeze(1))
            dlogits = dlogits.to(piece.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + ctx.tile] = dlogits @ weight
            if grad_weight is not None:
                grad_weight += (dlogits.t() @ piece).float()
            if grad_bias is not None:
                grad_bias += dlogits.sum(0).float()
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def normalised(sums: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], divisor: torch.Tensor) -> torch.Tensor:
    """The loss from the tiles' summed cross-entropies: their sum over ``divisor`` (the tiles' label ``counts`` are
    for a fault in the tests, which normalises per tile)."""
    return torch.stack(sums).sum() / divisor


def head_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, num_items_in_batch: Any,
              tile: int, smoothing: float = 0.0, kernel: LossKernel | None = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of ``head(hidden)`` against already shifted ``labels``, over tiles: the
    summed cross-entropy divided by ``num_items_in_batch`` (when given) or by the number of labels not -100; with
    ``smoothing``, the ``LabelSmoother``'s loss. ``kernel``: Liger's fused kernel where it takes the call (None: the
    torch tiles)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        divisor = (labels != -100).sum().float()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    if kernel is not None and kernel.uses_liger(hidden, head.weight, head.bias):
        return kernel.loss(hidden, head.weight, head.bias, labels, divisor, smoothing)
    return TiledHeadLoss.apply(hidden, head.weight, head.bias, labels, divisor, tile, smoothing)


#: Config attributes of models that scale or cap their logits after the head (the tiled loss would skip it).
LOGIT_SCALING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_tiled_loss(model: Any) -> torch.nn.Linear:
    """The LM head the tiled loss computes with; refused for a model that changes its logits after the head, or whose
    head is not a plain ``Linear`` (an adapter on the head)."""
    head = model.get_output_embeddings()
    text = model.config.get_text_config()
    scaled = [name for name in LOGIT_SCALING if getattr(text, name, None) is not None]
    if scaled:
        raise UnsupportedArchitectureError(
            f"memory.tile_loss: {type(model).__name__} changes its logits after the LM head ({', '.join(scaled)}), "
            "which the tiled loss would skip. Set memory.tile_loss: false")
    if type(head) is not torch.nn.Linear:
        raise UnsupportedArchitectureError(
            f"memory.tile_loss: the LM head of {type(model).__name__} is a {type(head).__name__}, not a plain Linear "
            "(an adapter on the head?); the tiled loss computes with its weight alone. Set memory.tile_loss: false")
    return head


@contextmanager
def tiled_loss(model: Any, shift_labels: torch.Tensor, num_items_in_batch: Any, tile: int,
               smoothing: float = 0.0, kernel: LossKernel | None = None) -> Iterator[None]:
    """Within the block, ``model``'s forward (called with ``shift_labels``, labels and usually ``logits_to_keep``)
    computes its causal-LM loss tile by tile: its LM head returns the loss of the positions it gets against
    ``shift_labels``, and its loss function passes it on. The head still runs through its module call, so hooks that
    gather a sharded weight (FSDP2, ZeRO-3) gather it. The output's ``logits`` are then that loss, not logits:
    for loss-only calls. ``smoothing``: label smoothing (ε) as transformers' ``LabelSmoother`` computes it.
    ``kernel``: Liger's fused linear cross-entropy for the calls it takes (None: the torch tiles)."""
    head = check_tiled_loss(model)
    saved = {"forward": head.__dict__.get("forward"), "loss": model.__dict__.get("_loss_function")}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return head_loss(hidden, head, shift_labels, num_items_in_batch, tile, smoothing, kernel)

    def passed_on(logits: torch.Tensor, labels: Any = None, vocab_size: Any = None, **kwargs: Any) -> torch.Tensor:
        given = kwargs.get("shift_labels")
        if not isinstance(given, torch.Tensor) or given.shape != shift_labels.shape or \
                given.data_ptr() != shift_labels.data_ptr():
            raise RuntimeError("padfree-plugins: the tiled loss was computed against other labels than the model's "
                               "loss got; call the model with the shift_labels given to tiled_loss")
        return logits

    head.forward = forward
    model.loss_function = passed_on
    try:
        yield
    finally:
        if saved["forward"] is None:
            head.__dict__.pop("forward", None)
        else:
            head.forward = saved["forward"]
        if saved["loss"] is None:
            model.__dict__.pop("_loss_function", None)
        else:
            model._loss_function = saved["loss"]


def tile_count(tokens: int, tile: int) -> int:
    """How many tiles a row of ``tokens`` takes."""
    return max(1, math.ceil(tokens / tile))


__all__: Sequence[str] = ("TiledCall", "TiledHeadLoss", "MLPTiling", "tiled", "tiled_loss", "head_loss",
                          "tiled_modules", "auto_tiles", "resolve_tiles", "check_tiled_loss", "tile_count",
                          "TiledLossForward")


#: The keyword with which a trainer plugin asks :class:`TiledLossForward` for label smoothing (ε).
SMOOTHING_KEYWORD = "padfree_label_smoothing"


@dataclass(frozen=True)
class TiledLossForward:
    """The assembly's ``forward`` with the tiled loss (``memory.tile_loss``): a call on a batch with labelled logits
    (``shift_labels``, held by the trainer plugins for their loss-only call, or added by
    :func:`~padfree_plugins.packing.labelled_logits.keep_labelled_logits`) computes the model's loss with
    :func:`tiled_loss` and returns no logits; any other call is ``inner``'s. Its other attributes are ``inner``'s.
    The keyword :data:`SMOOTHING_KEYWORD` (a trainer's label smoothing) is taken by this forward, never passed on.
    ``kernel``: ``memory.loss_kernel`` (None: the torch tiles)."""

    inner: Any
    tile: int
    kernel: LossKernel | None = None
    warned: dict = field(default_factory=dict, compare=False, repr=False)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "warned", "kernel"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, model: Any, batch: Any, **kwargs: Any) -> Any:
        smoothing = kwargs.pop(SMOOTHING_KEYWORD, 0.0)
        shift_labels = batch.get("shift_labels") if hasattr(batch, "get") else None
        if shift_labels is None or batch.get("labels") is None:
            if smoothing:
                raise RuntimeError("padfree-plugins: label smoothing asked of a call without labelled logits; the "
                                   "model's own loss would not smooth")
            if batch.get("labels") is not None and not self.warned:
                self.warned["untiled"] = True
                logger.warning(
                    "padfree-plugins: memory.tile_loss: a call with labels but no labelled logits (shift_labels) "
                    "computes every position's logits, untiled, once per such call (evaluation with "
                    "compute_metrics, return_outputs=True, or a loop of your own: keep_labelled_logits(batch) tiles "
                    "its loss)")
            return self.inner(model, batch, **kwargs)
        from padfree_plugins.modeling.patching import unwrap_model

        with tiled_loss(unwrap_model(model), shift_labels, kwargs.get("num_items_in_batch"), self.tile, smoothing,
                        self.kernel):
            outputs = self.inner(model, batch, **kwargs)
        if hasattr(outputs, "logits"):
            outputs["logits"] = None  # the head returned the loss, not logits
        return outputs
