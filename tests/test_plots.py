"""Figures draw from real traces and accept an Axes."""

import matplotlib.colors
import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from parcourse import Tracer, plots
from parcourse.trace import Span, Trace


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


def spans_trace(world_size, *spans):
    """A trace from (rank, name, kind, start_ms, end_ms, depth, meta) tuples."""
    ms = 1_000_000
    return Trace(
        world_size, [Span(r, n, k, int(a * ms), int(b * ms), d, m) for r, n, k, a, b, d, m in spans]
    )


def shown_labels(fig):
    fig.canvas.draw()  # labels are placed at draw time, after layout
    (labels,) = [a for a in fig.axes[0].get_children() if isinstance(a, plots.BarLabels)]
    return sorted(labels.shown)


def test_timeline_labels_only_where_they_fit():
    trace = spans_trace(
        2,
        (0, "work", "compute", 0, 100, 0, {"label": "wide"}),
        # four bars far too narrow for their labels: nothing, rather than "b0b1b2b3"
        *[
            (0, "all_reduce", "comm", 100 + i * 0.2, 100.2 + i * 0.2, 0, {"bucket": i})
            for i in range(4)
        ],
        # in flight together: b1 is drawn over all of b0 but its first millisecond
        (1, "all_reduce", "comm", 0, 50, 0, {"bucket": 0}),
        (1, "all_reduce", "comm", 1, 60, 0, {"bucket": 1}),
        # a collective's steps cover its own label
        (1, "all_gather", "comm", 60, 100, 0, {"label": "hidden"}),
        (1, "all-gather 0", "comm", 60, 100, 1, {"chunk": 1}),
    )
    assert shown_labels(plots.timeline(trace)) == ["b1", "c1", "wide"]
    plt.close("all")


def test_timeline_colours_phases_and_collectives_apart_with_a_legend():
    kinds = [
        ("forward", "compute", {}),
        ("backward (DDP inside)", "compute", {}),
        ("optimizer", "compute", {}),
        ("0F1", "compute", {"action": "F"}),
        ("all_reduce", "comm", {}),
        ("reduce_scatter", "comm", {}),
        ("all-gather 2", "comm", {"phase": "all-gather"}),
        ("row (forward)", "comm", {"op": "all_reduce"}),
        ("send", "comm", {}),
        ("barrier", "idle", {}),
    ]
    trace = spans_trace(2, *[(0, n, k, i, i + 1, 0, m) for i, (n, k, m) in enumerate(kinds)])
    assert [plots.span_color_key(s) for s in trace.spans] == [
        "forward",
        "backward",
        "optimizer",
        "forward",
        "all-reduce",
        "reduce-scatter",
        "all-gather",
        "all-reduce",
        "comm",
        "idle",
    ]
    ax = plots.timeline(trace).axes[0]
    colours = {tuple(p.get_facecolor()) for p in ax.patches}
    assert len(colours) == 8  # forward, backward, optimizer, 3 collectives, comm, idle
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "forward",
        "backward",
        "optimizer",
        "all-reduce",
        "reduce-scatter",
        "all-gather",
        "comm",
        "idle (waiting)",
    ]
    # waiting is drawn as no work: an outline, hatched, not a filled bar of some kind
    (idle,) = [p for p in ax.patches if p.get_hatch()]
    assert idle.get_facecolor()[3] == 0
    plt.close("all")


def test_legends_sit_outside_the_plotted_area():
    trace = two_rank_trace()
    figures = [
        plots.timeline(trace),
        plots.timeline(trace, comm_lane=True),
        plots.memory(trace, theory={"after forward": 300}),
        plots.bandwidth([1024, 4096], {"ring": [1e6, 2e6]}, {"ring": lambda s: 500 * s}),
    ]
    for fig in figures:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x0 >= ax.get_window_extent(renderer).x1, "legend over the data"
        assert legend.x1 <= fig.bbox.x1, "legend cut off by the figure's edge"
    plt.close("all")


def test_timeline_of_one_rank_says_there_is_nothing_to_communicate():
    tracer = Tracer(0)
    with tracer.span("all_reduce", kind="comm"):
        pass  # one rank: returns at once
    fig = plots.timeline(Trace.merge(1, [tracer.data()]), title="ring")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["one rank: nothing to communicate"], "no microsecond-wide empty axis"
    assert not fig.axes[0].patches
    with tracer.span("forward"):
        pass
    fig = plots.timeline(Trace.merge(1, [tracer.data()]), title="training")
    assert fig.axes[0].get_title(loc="left") == "training (one rank: nothing to communicate)"
    assert len(fig.axes[0].patches) == 1, "compute is still drawn, the no-op collective not"
    plt.close("all")


def test_counts_are_singular_after_one():
    from parcourse.plots import count

    assert [count(1, "rank"), count(2, "rank"), count(0, "stage")] == [
        "1 rank",
        "2 ranks",
        "0 stages",
    ]
    assert [count(1, "microbatch"), count(4, "microbatch")] == ["1 microbatch", "4 microbatches"]


def test_timelines_sharing_a_time_axis_show_the_longer_whole():
    """Two timelines on a shared time axis (1F1B above ZB-H1 in lesson 07): the axis spans
    the longer one, whichever is drawn last."""
    import matplotlib.pyplot as plt

    from parcourse import plots
    from parcourse.experiments.pipeline import as_trace
    from parcourse.pipeline.schedule import one_f_one_b, zero_bubble_h1
    from parcourse.pipeline.simulate import Costs, simulate

    costs = Costs(forward=1.0, backward=2.0, weight=1.0)
    long, short = simulate(one_f_one_b(4, 8), costs), simulate(zero_bubble_h1(4, 8), costs)
    assert long.step_time > short.step_time
    for first, second in ((long, short), (short, long)):
        fig, axes = plt.subplots(2, 1, sharex=True)
        plots.timeline(as_trace(first), ax=axes[0])
        plots.timeline(as_trace(second), ax=axes[1])
        assert axes[0].get_xlim()[1] >= long.step_time * 1e3  # ms
        plt.close(fig)


def test_a_comm_lane_holds_the_disks_reads_and_writes_too():
    """With `comm_lane`, data moving is drawn under the compute: messages, and a disk's
    reads and writes (ZeRO-Infinity's, beside the update), not on top of the update."""
    trace = spans_trace(
        2,
        (0, "update", "compute", 0, 10, 0, {}),
        (0, "disk read", "other", 2, 8, 0, {}),
        (0, "send", "comm", 3, 4, 0, {}),
        (1, "update", "compute", 20, 30, 0, {}),
    )
    ax = plots.timeline(trace, comm_lane=True).axes[0]
    update, disk, send, _ = sorted(ax.patches, key=lambda p: p.get_x())
    assert disk.get_y() == send.get_y() != update.get_y()
    plt.close("all")


def test_before_and_after_numbers_fit_their_cells_at_eight_ranks():
    """Lesson 00 at 8 ranks: 8 numbers a rank, an all_gather's rows 64 long. Its numbers
    get a smaller font, or none where even that would not fit, rather than one that runs
    into the next cell's (each label narrower than its cell)."""
    import torch

    before = [torch.arange(8 * r, 8 * r + 8) for r in range(8)]
    fig = plots.tensors_before_after(before, [torch.cat(before)] * 8, "all_gather")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    after = fig.axes[1]
    cell = after.get_window_extent(renderer).width / 64
    labels = [t for t in after.texts if t.get_text()]
    assert all(t.get_window_extent(renderer).width < cell for t in labels)
    assert fig.axes[0].texts, "the shorter rows keep their numbers"
    plt.close("all")


def test_memory_bars_are_numbered_without_touching_at_eight_ranks():
    """Eight ranks' bars in three groups on a narrow axes (one of two side by side): each
    numbered under it, no label over the next one ("r0r1r2..." was)."""
    from parcourse.trace import MemorySample, Trace

    trace = Trace(
        8,
        memory=[
            MemorySample(r, label, 0, {"params": 100 * (r + 1)}, {})
            for label in ("after forward", "after backward", "after step")
            for r in range(8)
        ],
    )
    fig, ax = plt.subplots(figsize=(3.4, 3), layout="constrained")
    plots.memory(trace, ax=ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    numbers = sorted(
        (t for t in ax.texts if t.get_text()[-1:].isdigit()),
        key=lambda t: t.get_window_extent(renderer).x0,
    )
    assert len(numbers) == 24
    boxes = [t.get_window_extent(renderer) for t in numbers]
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), "labels overlap"
    plt.close("all")


def test_memory_against_gpus_writes_a_small_model_in_its_own_unit():
    """A thousand bytes a rank reads in KiB, not as 9.31e-07 GiB labels piled on each other,
    and no GPU is drawn beside it; a 10B model in GiB beside the GPUs."""
    small = plots.memory_against_gpus({"params": 4000, "grads": 4000, "optimizer": 8000})
    ax = small.axes[0]
    assert ax.get_ylabel() == "per rank (KiB)"
    assert [t.get_text() for t in ax.texts] == ["3.91", "3.91", "7.81", "15.6"]
    big = plots.memory_against_gpus({"params": 4e10, "grads": 4e10, "optimizer": 8e10})
    assert big.axes[0].get_ylabel() == "per rank (GiB)"
    assert any("GB" in t.get_text() for t in big.axes[0].texts)
    plt.close("all")


def test_a_collective_waiting_for_its_partner_is_drawn_hatched_not_as_its_axis():
    """Rank 0 enters a tp all-reduce at 10 ms, rank 1 at 60: rank 0's first 50 ms are
    drawn as waiting (an outline, hatched), not as a 55 ms bar of tp's colour."""
    group = {"axis": "tp", "group": (0, 1)}
    trace = spans_trace(
        2,
        (0, "all_reduce", "comm", 10, 65, 0, group),
        (1, "all_reduce", "comm", 60, 65, 0, group),
        (0, "work", "compute", 0, 10, 0, {}),
        (1, "work", "compute", 0, 60, 0, {}),
    )
    fig = plots.timeline(trace, color_by="axis")
    bars = [p for p in fig.axes[0].patches if p.get_width() > 0]
    hatched = [p for p in bars if p.get_hatch()]
    assert [(round(p.get_x()), round(p.get_width())) for p in hatched] == [(10, 50)]
    tp = [
        p
        for p in bars
        if not p.get_hatch()
        and p.get_facecolor()[:3] == matplotlib.colors.to_rgb(plots.AXIS_COLORS["tp"])
    ]
    assert sorted(round(p.get_width()) for p in tp) == [5, 5]
    plt.close("all")


def test_the_steps_of_a_collective_start_after_its_wait():
    """The course's ring all-gather nests its steps in the collective's span: rank 0
    enters at 10 ms, rank 1 at 60; rank 0's first step (10 to 40 ms, all of it waiting)
    is left out and its second (40 to 62) starts at 60, so nothing covers the wait."""
    from parcourse.trace import with_collective_waits

    group = {"op": "all-gather", "group": (0, 1)}
    trace = spans_trace(
        2,
        (0, "all-gather K", "comm", 10, 65, 0, group),
        (0, "all-gather 0", "comm", 10, 40, 1, {"phase": "all-gather"}),
        (0, "all-gather 1", "comm", 40, 62, 1, {"phase": "all-gather"}),
        (1, "all-gather K", "comm", 60, 65, 0, group),
        (1, "all-gather 0", "comm", 60, 64, 1, {"phase": "all-gather"}),
    )
    drawn = with_collective_waits(trace)
    ms = 1_000_000
    rank0 = sorted((s.name, s.start_ns // ms, s.end_ns // ms) for s in drawn.spans if s.rank == 0)
    assert rank0 == [
        ("all-gather 1", 60, 62),
        ("all-gather K", 60, 65),
        ("wait for partners (all-gather K)", 10, 60),
    ]
    rank1 = sorted((s.name, s.start_ns // ms) for s in drawn.spans if s.rank == 1)
    assert rank1 == [("all-gather 0", 60), ("all-gather K", 60)]


def test_device_turns_draws_the_device_and_the_exposed_waits():
    """Per run, a row of the turn held (forward, backward) and a row of all-to-all waits,
    red only where no compute covered them: here [3, 4] of the wait [2, 4]."""
    run = {
        "start": 0.0,
        "held": [("F", 0.0, 0.002), ("B", 0.002, 0.003)],
        "waits": [(0.002, 0.004)],
    }
    fig = plots.device_turns({"DualPipe": run}, title="rank 0")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "DualPipe: all-to-all",
        "DualPipe: device",
    ]
    red = [
        c for c in ax.collections if matplotlib.colors.same_color(c.get_facecolor()[0], "#C44E52")
    ]
    (exposed,) = red
    (path,) = exposed.get_paths()
    box = path.get_extents()
    assert (box.x0, box.x1) == (pytest.approx(3.0), pytest.approx(4.0))
    plt.close(fig)
