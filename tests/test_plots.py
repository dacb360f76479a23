"""Figures draw from real traces and accept an Axes."""

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from torch import nn

from parcourse import Tracer, plots
from parcourse.trace import Trace


def two_rank_trace():
    parts = []
    for rank in range(2):
        tracer = Tracer(rank)
        model = nn.Linear(8, 8 * (rank + 1))
        with tracer.span("forward", microbatch=rank):
            tracer.memory("after forward", model=model)
        with tracer.span("all_reduce", kind="comm", bucket=0):
            pass
        parts.append(tracer.data())
    return Trace.merge(2, parts)


def test_timeline_and_memory_return_figures_and_accept_axes():
    trace = two_rank_trace()
    fig = plots.timeline(trace, title="t")
    assert isinstance(fig, Figure)
    bars = [p for p in fig.axes[0].patches]
    assert len(bars) == 4  # 2 ranks x 2 spans
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]

    fig2, (a, b) = plt.subplots(1, 2)
    assert plots.timeline(trace, ax=a) is fig2
    assert plots.memory(trace, ax=b, theory={"after forward": 300}) is fig2
    mem = plots.memory(trace)
    heights = sorted(p.get_height() for p in mem.axes[0].patches)
    # params of Linear(8, 8) and Linear(8, 16), in bytes (below 1 KiB, so unit B)
    assert heights == [(64 + 8) * 4, (128 + 16) * 4]
    plt.close("all")


def test_tensors_before_after_shows_every_value():
    before = [torch.tensor([r, r]) for r in range(3)]
    after = [torch.tensor([3, 3]) for _ in range(3)]
    fig = plots.tensors_before_after(before, after, "all_reduce")
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("3") == 6 and texts.count("0") == 2
    plt.close("all")
