"""The measures torch.compile on packed rows is held to: graphs and graph breaks under ``torch.compile``,
host reads and data-shaped ops in an eager forward. Each counter is shown to see what it counts, so that a count of 0
means 0; the patched model's counts today are the baseline docs/compile.md records."""

from __future__ import annotations

import torch

from padfree_plugins.testing.compiled import compile_report, counting_backend, host_reads


def test_host_reads_counts_every_read_of_values_and_every_data_shaped_op():
    x = torch.arange(6)
    with host_reads() as seen:
        x.tolist()
        int(x[0])
        bool(x[1] > 0)
        torch.equal(x, x)
        torch.nonzero(x)
        x.unique_consecutive()
        x.repeat_interleave(x)  # output size from the data
        x.repeat_interleave(2)  # known size: not counted
        x.repeat_interleave(x, output_size=15)  # known size: not counted
        x * 2
    assert seen.reads == {"tolist": 1, "__int__": 1, "__bool__": 1, "equal": 1}
    assert seen.data_shaped == {"nonzero": 1, "unique_consecutive": 1, "repeat_interleave": 1}
    assert seen.total == 7
    with host_reads() as none:
        (x * 2 + 1).sum(0, keepdim=True)
    assert none.total == 0


def test_compile_report_counts_graphs_and_breaks_with_their_cause():
    def clean(y):
        return (y * 2).sin()

    def breaking(y):
        z = y * 2
        return z + int(z.sum())  # a host read: dynamo breaks the graph there

    with compile_report() as report:
        compiled = torch.compile(clean, backend=counting_backend(report), dynamic=True)
        for size in (3, 5, 9):
            compiled(torch.ones(size))
    assert report.graphs == report.unique_graphs == 1 and report.break_count == 0
    with compile_report() as report:
        torch.compile(breaking, backend=counting_backend(report))(torch.ones(3))
    assert report.break_count == 1 and report.graphs == report.unique_graphs == 2
    (reason,) = report.breaks
    assert "item()" in reason or "_local_scalar_dense" in reason
