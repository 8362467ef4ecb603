"""What ``torch.compile`` makes of a patched model, and what a forward asks of the host: the two measures that say
whether packed rows are compile-stable (one graph, no breaks, no recompiles across lengths) and sync-free.

* :func:`compile_report`: inside the block, every graph dynamo hands to the backend (:func:`counting_backend`) and
  every graph break, by reason, from dynamo's own counters;
* :func:`host_reads`: inside the block, every read of a tensor's values on the host (``tolist``, ``item``, a tensor
  used as a bool or an int, ``numpy``, ``torch.equal``) and every op whose output shape depends on the data
  (``nonzero``, ``unique*``, ``masked_select``, ``repeat_interleave`` without ``output_size``). On a GPU each stalls the stream;
  on a CPU they are what a compiled graph cannot hold. Counted on the CPU too, so a test needs no GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class CompileReport:
    """What :func:`compile_report` saw: ``graphs`` handed to a :func:`counting_backend`, ``unique_graphs`` compiled
    by any backend (dynamo's own count: a trainer that compiles with a backend by name), and graph breaks
    (:func:`short_reason` → count)."""

    graphs: int = 0
    unique_graphs: int = 0
    breaks: Counter = field(default_factory=Counter)

    @property
    def break_count(self) -> int:
        return sum(self.breaks.values())


def counting_backend(report: CompileReport, backend: str | Callable = "aot_eager") -> Callable:
    """A ``torch.compile`` backend that counts every graph in ``report`` and compiles it with ``backend``
    (``aot_eager`` traces forward and backward as inductor does, without its C++ compile time)."""
    from torch._dynamo import lookup_backend

    compile_graph = lookup_backend(backend) if isinstance(backend, str) else backend

    def counted(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        report.graphs += 1
        return compile_graph(graph, example_inputs)

    return counted


@contextmanager
def compile_report() -> Iterator[CompileReport]:
    """A :class:`CompileReport` of the block: compile with ``backend=counting_backend(report)`` inside it (or with any
    backend, and read ``unique_graphs``). Graph breaks and unique graphs come from dynamo's counters
    (``torch._dynamo.utils.counters``), counted from the block's start."""
    from torch._dynamo.utils import counters

    report = CompileReport()
    before, graphs_before = Counter(counters["graph_break"]), counters["stats"]["unique_graphs"]
    try:
        yield report
    finally:
        report.unique_graphs = counters["stats"]["unique_graphs"] - graphs_before
        after = Counter(counters["graph_break"])
        after.subtract(before)
        for reason, count in after.items():
            if count > 0:
                report.breaks[short_reason(reason)] += count


def short_reason(reason: str) -> str:
    """Dynamo's graph-break reason (a paragraph) cut to its cause: the first line and its explanation."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    return " ".join(part for part in (lines[0] if lines else "", explanation[len("Explanation:"):].strip()) if part)


#: Tensor methods that read values on the host.
HOST_READ_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
#: Ops that return a python value computed from the data (seen below the tensor methods).
HOST_READ_OPS = ("equal",)
#: Ops whose output shape depends on the data (and so a host read inside the op).
DATA_SHAPED_OPS = ("nonzero", "unique_consecutive", "_unique", "_unique2", "unique_dim", "masked_select")


@dataclass
class HostReads:
    """Host reads (method → count) and data-shaped ops (op → count) seen inside :func:`host_reads`."""

    reads: Counter = field(default_factory=Counter)
    data_shaped: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.reads.values()) + sum(self.data_shaped.values())


class _MethodCounter(TorchFunctionMode):
    def __init__(self, seen: HostReads) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            self.seen.reads[name] += 1
        return func(*args, **(kwargs or {}))


class _OpCounter(TorchDispatchMode):
    def __init__(self, seen: HostReads) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READ_OPS:
            self.seen.reads[name] += 1
        elif name in DATA_SHAPED_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                       and len(args) and isinstance(args[0], torch.Tensor)
                                       and not isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), int)):
            self.seen.data_shaped[name] += 1
        return func(*args, **kwargs)


@contextmanager
def host_reads() -> Iterator[HostReads]:
    """A :class:`HostReads` of the block (forward and backward alike; eager code only)."""
    seen = HostReads()
    with _MethodCounter(seen), _OpCounter(seen):
        yield seen
