"""The equivalence check: a packed batch through the assembled model equals every example run alone, unpatched.

Outputs (per-token logits or hidden states, or per-example logits) are compared example by example, and so are the
gradients of every parameter, of a scalar loss (the outputs times a fixed random projection): the packed loss's
gradient must equal the sum over the examples run alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from padfree_plugins.assembly import assemble
from padfree_plugins.modeling.patching import patch_of, unwrap_model
from padfree_plugins.testing.models import example_batch

#: Per-token keys of an example that its run alone hands to the model besides ``input_ids``.
ALONE_TOKEN_KEYS = ("token_type_ids",)
#: Output attributes compared, in order of preference.
OUTPUT_NAMES = ("logits", "last_hidden_state")


@dataclass
class EquivalenceReport:
    """What :func:`assert_packed_matches_alone` measured (differences are max abs; ``*_tolerance`` the limits used)."""

    task: str
    architecture_plugin: str
    lengths: tuple[int, ...]
    output: str  # the compared output: "logits" or "last_hidden_state", "per token" or "per example"
    max_output_diff: float = 0.0
    worst_example: int | None = None
    output_tolerance: float = 0.0  # the tolerance at the worst example (atol + rtol × its scale)
    max_grad_diff: float | None = None  # None: gradients not compared
    worst_parameter: str | None = None
    grad_tolerance: float | None = None
    parameters_compared: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        grads = ("gradients not compared" if self.max_grad_diff is None else
                 f"gradients of {self.parameters_compared} parameters max diff {self.max_grad_diff:.2e} "
                 f"({self.worst_parameter})")
        return (f"{self.task} via {self.architecture_plugin}, lengths {list(self.lengths)}: {self.output} max diff "
                f"{self.max_output_diff:.2e} (example {self.worst_example}); {grads}")


def output_of(result: Any) -> tuple[str, torch.Tensor]:
    """The compared output of a model call: ``logits`` when it has them, else ``last_hidden_state``."""
    for name in OUTPUT_NAMES:
        value = getattr(result, name, None)
        if value is None and isinstance(result, Mapping):
            value = result.get(name)
        if isinstance(value, torch.Tensor):
            return name, value
    raise TypeError(f"the model returned {type(result).__name__} with neither logits nor last_hidden_state: "
                    "assert_packed_matches_alone compares one of them")


def split_packed(tensor: torch.Tensor, batch: Mapping) -> list[torch.Tensor]:
    """``[1, T, ...]`` -> the list of per-example ``[L_i, ...]``, cut at ``batch["cu_seq_lens_q"]``."""
    cu = batch["cu_seq_lens_q"].tolist()
    return [tensor[0, cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def default_task(model: Any) -> str:
    """The task a model class is trained for: ``causal_lm`` for an LM head, ``seq_cls`` for a sequence classifier,
    else ``hidden_states``."""
    name = type(unwrap_model(model)).__name__
    if name.endswith("ForCausalLM"):
        return "causal_lm"
    if name.endswith("ForSequenceClassification"):
        return "seq_cls"
    return "hidden_states"


def _config_for(model: Any, config: Any) -> Any:
    if config is None:
        return {"task": default_task(model)}
    if isinstance(config, Mapping) and "task" not in config:
        return {**config, "task": default_task(model)}
    return config


def run_alone(model: Any, example: Mapping[str, Any], **kwargs: Any) -> Any:
    """One example through ``model`` as a batch of one, without padding (the reference a packed row must equal):
    its ``input_ids`` and :data:`ALONE_TOKEN_KEYS`, plus ``kwargs`` for the model."""
    device = next(model.parameters()).device
    inputs = {key: torch.tensor([example[key]], device=device) for key in ("input_ids", *ALONE_TOKEN_KEYS)
              if example.get(key) is not None}
    return model(**inputs, **kwargs)


def _worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Max abs difference (``inf`` when anything is not finite, or the shapes differ) and the scale of ``want``
    (its max abs)."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return math.inf, 0.0
    difference = (got - want).abs()
    if not bool(torch.isfinite(got).all()):
        return math.inf, 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    return (float(difference.max()) if difference.numel() else 0.0), scale


def _projection(shape: torch.Size, seed: int, device: Any) -> torch.Tensor:
    """The fixed random weights of one example's outputs in the scalar loss (float64, seeded per example)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float64).to(device)


def _loss_of(outputs: torch.Tensor, i: int, loss: Callable | None, projections: Sequence[torch.Tensor]) -> Any:
    """Example ``i``'s term of the scalar loss whose gradients are compared."""
    return loss(outputs) if loss is not None else (outputs.double() * projections[i]).sum()


def _where(got: torch.Tensor, want: torch.Tensor, per_token: bool) -> str:
    """Where the largest difference of one example is: its token (per-token outputs) or its index."""
    if got.shape != want.shape or not got.numel() or not bool(torch.isfinite(got).all()):
        return ""
    flat = int((got.detach().double() - want.double()).abs().argmax())
    return f", worst at token {flat // max(1, got[0].numel())}" if per_token else f", worst at index {flat}"


def _gradients(loss: torch.Tensor, parameters: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, parameters, allow_unused=True))


def _summed(total: list | None, grads: list) -> list:
    if total is None:
        return grads
    return [b if a is None else a if b is None else a + b for a, b in zip(total, grads)]


def check_no_dropout(model: Any) -> None:
    """Raise ``ValueError`` if ``model`` is in training mode with dropout: packed and alone would draw different
    masks and differ by chance, not by a bug."""
    if not model.training:
        return
    config = getattr(unwrap_model(model), "config", None)
    active = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    active += [name for name in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")
               if (getattr(config, name, 0.0) or 0.0) > 0]
    if active:
        raise ValueError(f"the model is in training mode with dropout ({', '.join(active[:3])}…): packed and alone "
                         "would differ by chance. Call model.eval(), or set the dropout probabilities to 0")


@dataclass
class _Run:
    """One side of the comparison: per-example outputs and the summed gradients of the scalar loss."""

    name: str
    per_token: bool
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None] | None


def _run_alone(model: Any, examples: Sequence[Mapping[str, Any]], parameters: list, loss: Any, seed: int,
               device: Any) -> tuple[_Run, list[torch.Tensor]]:
    """The reference: every example alone, through the model as it is."""
    outputs, projections, total, name, per_token = [], [], None, "", True
    for i, example in enumerate(examples):
        name, out = output_of(run_alone(model, example))
        per_token = out.dim() >= 3 and out.shape[0] == 1 and out.shape[1] == len(example["input_ids"])
        out = out[0] if per_token else out.reshape(-1)
        outputs.append(out.detach())
        if parameters:
            if loss is None:
                projections.append(_projection(out.shape, seed * 1_000_003 + i, device))
            total = _summed(total, _gradients(_loss_of(out, i, loss, projections), parameters))
    return _Run(name, per_token, outputs, total), projections


def _run_packed(model: Any, assembly: Any, examples: Sequence[Mapping[str, Any]], reference: _Run, parameters: list,
                loss: Any, projections: list, forward_kwargs: Mapping[str, Any], device: Any) -> _Run:
    """The examples packed into one row through the assembled model, cut back into examples."""
    lengths = [len(example["input_ids"]) for example in examples]
    batch = assembly.collator(examples).to(device)
    name, packed = output_of(assembly.forward(model, batch, **forward_kwargs))
    if name != reference.name:
        raise AssertionError(f"the packed forward returned {name}, the examples alone {reference.name}")
    if reference.per_token:
        if tuple(packed.shape[:2]) != (1, sum(lengths)):
            raise AssertionError(f"packed {name} have shape {tuple(packed.shape)}; expected [1, {sum(lengths)}, …] "
                                 f"for examples of lengths {lengths}")
        parts = split_packed(packed, batch)
    else:
        if packed.shape[0] != len(examples):
            raise AssertionError(f"packed {name} have shape {tuple(packed.shape)}; expected one row per example "
                                 f"({len(examples)})")
        parts = list(packed.reshape(len(examples), -1))
    grads = None
    if parameters:
        grads = _gradients(sum(_loss_of(part, i, loss, projections) for i, part in enumerate(parts)), parameters)
    return _Run(name, True, [part.detach() for part in parts], grads)


def assert_packed_matches_alone(model: Any, config: Any = None, examples: Sequence[Mapping[str, Any]] | None = None,
                                *, atol: float = 1e-5, grad_atol: float | None = 1e-4, rtol: float | None = None,
                                grad_rtol: float | None = None, host: Any = None, plugin: str | None = None,
                                forward_kwargs: Mapping[str, Any] | None = None,
                                loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                seed: int = 0) -> EquivalenceReport:
    """Assert that ``model``, assembled for ``config``, computes a packed batch of ``examples`` exactly as it computes
    each example alone before the patch; return what was measured (an :class:`EquivalenceReport`).

    * ``model``: an **unpatched** transformers model, dropout off (eval mode, or dropout probabilities of 0).
    * ``config``: the padfree config (dict, path, ``PadfreeConfig``); ``None`` or a dict without ``task`` takes the
      model class's task (:func:`default_task`). ``host``: a :class:`~padfree_plugins.contract.host.PluginHost`
      (e.g. with a plugin not yet installed). ``plugin``: the plugin the architecture must come from.
    * ``examples``: ``[{"input_ids": [...]}, …]`` (plus the task's keys); default :func:`example_batch` of the model.

    The references run first, every example alone through the model as it is (its own attention); then the model
    is assembled, ``assembly.collator(examples)`` packed and ``assembly.forward(model, batch, **forward_kwargs)``
    run; the assembly is undone at the end, whatever happens. The compared output is ``logits`` if the model returns
    them (per token for an LM, per example for a classifier), else ``last_hidden_state``. An example fails when
    its max abs difference exceeds ``atol + rtol × scale``, ``scale`` being the example's max abs reference value
    (``rtol`` defaults to ``atol``; ``rtol=0``: an absolute bound). Unless ``grad_atol`` is ``None``, the gradients
    of a scalar loss w.r.t. every parameter are compared the same way (``grad_atol + grad_rtol × scale`` per
    parameter, ``grad_rtol`` defaulting to ``grad_atol``): the packed loss's against the sum over the examples
    alone. The loss is the sum over examples of ``loss(outputs)`` (one example's ``[L, …]`` per-token or
    ``[C]`` per-example outputs), by default ``(outputs × fixed random weights).sum()`` (seeded by ``seed``).
    Raises ``AssertionError`` naming the examples and parameters that differ, their difference and the tolerance.
    """
    if patch_of(model) is not None or patch_of(unwrap_model(model)) is not None:
        raise ValueError("assert_packed_matches_alone needs the model unpatched (the reference runs through its own "
                         "attention): undo its assembly first")
    check_no_dropout(model)
    examples = list(examples) if examples is not None else example_batch(model)
    if not examples:
        raise ValueError("assert_packed_matches_alone needs at least one example")
    lengths = tuple(len(example["input_ids"]) for example in examples)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad] if grad_atol is not None else []
    if grad_atol is not None and not named:
        raise ValueError("no parameter of the model requires grad: pass grad_atol=None to compare outputs only")
    parameters = [p for _, p in named]
    device = next(model.parameters()).device

    with torch.set_grad_enabled(bool(parameters)):
        reference, projections = _run_alone(model, examples, parameters, loss, seed, device)
        assembly = assemble(model, _config_for(model, config), host=host)
        try:
            if plugin is not None and assembly.plan.architecture_plugin != plugin:
                raise AssertionError(f"the architecture came from plugin {assembly.plan.architecture_plugin!r}, not "
                                     f"{plugin!r}: {assembly.plan.describe()}")
            packed = _run_packed(model, assembly, examples, reference, parameters, loss, projections,
                                 dict(forward_kwargs or {}), device)
        finally:
            assembly.undo()

    report = EquivalenceReport(assembly.plan.task.name, assembly.plan.architecture_plugin, lengths,
                               f"{reference.name} ({'per token' if reference.per_token else 'per example'})")
    rtol = atol if rtol is None else rtol
    for i, (got, want) in enumerate(zip(packed.outputs, reference.outputs)):
        difference, scale = _worst(got, want)
        tolerance = atol + rtol * scale
        if difference >= report.max_output_diff:
            report.max_output_diff, report.worst_example, report.output_tolerance = difference, i, tolerance
        if not difference <= tolerance:
            report.failures.append(
                f"example {i} (length {lengths[i]}): packed {reference.name} differ from the example run alone by "
                f"{difference:.3e} (max abs; tolerance {tolerance:.1e} = atol {atol:g} + rtol {rtol:g} × scale "
                f"{scale:.3g}){_where(got, want, reference.per_token)}")
    if parameters:
        _compare_gradients(report, named, reference.grads, packed.grads, grad_atol,
                           grad_atol if grad_rtol is None else grad_rtol)
    if report.failures:
        more = len(report.failures) - 20
        shown = report.failures[:20] + ([f"… and {more} more"] if more > 0 else [])
        raise AssertionError(f"packed ≠ alone for task {report.task} (architecture from plugin "
                             f"{report.architecture_plugin}), examples of lengths {list(lengths)}:\n  "
                             + "\n  ".join(shown))
    return report


def _compare_gradients(report: EquivalenceReport, named: list, reference: list, packed: list, grad_atol: float,
                       grad_rtol: float) -> None:
    """Every parameter's packed gradient against the reference's (a missing one counts as zeros), into ``report``."""
    if all(g is None for g in reference):
        raise AssertionError("the reference produced no gradients: the outputs depend on no parameter that requires "
                             "grad")
    report.max_grad_diff, report.grad_tolerance = 0.0, 0.0
    for (name, parameter), want, got in zip(named, reference, packed):
        if want is None and got is None:
            continue
        want = torch.zeros_like(parameter) if want is None else want
        got = torch.zeros_like(parameter) if got is None else got
        report.parameters_compared += 1
        difference, scale = _worst(got, want)
        tolerance = grad_atol + grad_rtol * scale
        if difference >= report.max_grad_diff:
            report.max_grad_diff, report.worst_parameter, report.grad_tolerance = difference, name, tolerance
        if not difference <= tolerance:
            report.failures.append(
                f"gradient of {name}: packed differs from the sum over the examples alone by {difference:.3e} (max "
                f"abs; tolerance {tolerance:.1e} = grad_atol {grad_atol:g} + grad_rtol {grad_rtol:g} × scale "
                f"{scale:.3g})")
