"""The figures lessons draw beside their panels, in one place: what a panel shows after a
run, from the run's results (matplotlib only; the library's own charts are
parcourse.plots, which these build on)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from parcourse import plots
from parcourse.experiments.pipeline import ScheduleSummary
from parcourse.trace import Trace

if TYPE_CHECKING:
    from parcourse.planner import Plans


def pipeline_step(
    trace: Trace,
    per_rank_bytes: Sequence[float],
    title: str,
    in_flight: Sequence[int] | None = None,
    microbatch_bytes: Sequence[Sequence[float]] | None = None,
) -> Figure:
    """A measured pipeline step (lessons 06 and 07): each rank's timeline coloured by
    microbatch, above what each rank held at its peak. With `in_flight` (the most
    microbatches each rank holds at once) the bars count microbatches, what the lessons
    reason about, each labelled with its bytes and, from `microbatch_bytes`, one
    microbatch's bytes on that rank (stages holding the embedding or the head differ from
    the others); without, the bars are the bytes."""
    ranks = len(per_rank_bytes)
    fig, axes = plt.subplots(
        2, 1, figsize=(10, 3 + 1.2 * ranks), layout="constrained", height_ratios=[ranks, 2]
    )
    plots.timeline(trace, ax=axes[0], color_by="microbatch", title=title)
    if in_flight is None:
        axes[1].bar(range(ranks), [b / 1024 for b in per_rank_bytes], color="C0")
        axes[1].set_ylabel("peak activations (KiB)")
    else:
        axes[1].bar(range(ranks), in_flight, color="C0")
        for r, (n, b) in enumerate(zip(in_flight, per_rank_bytes)):
            each = ""
            if microbatch_bytes is not None and len(microbatch_bytes[r]) == 1:
                each = f"\n({microbatch_bytes[r][0] / 1024:.0f} KiB each)"
            axes[1].text(r, n, f"{b / 1024:.0f} KiB{each}", ha="center", va="bottom", fontsize=8)
        axes[1].set_ylabel("microbatches held at once")
        axes[1].set_ylim(0, max(in_flight, default=1) * 1.35 + 0.5)
    axes[1].set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    return fig


def plot_schedules(summaries: Sequence[ScheduleSummary], title: str = "") -> Figure:
    """Bubble and peak in-flight activations of each schedule: measured bars beside the
    simulator's (hatched)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    names = [s.name for s in summaries]
    xs = range(len(names))
    for ax, measured, simulated, label in (
        (
            axes[0],
            [s.bubble for s in summaries],
            [s.simulated_bubble for s in summaries],
            "bubble (idle fraction)",
        ),
        (
            axes[1],
            [s.peak_bytes / 1024 for s in summaries],
            [s.simulated_peak_bytes / 1024 for s in summaries],
            "peak activations, busiest rank (KiB)",
        ),
    ):
        ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured", color="C0")
        ax.bar(
            [x + 0.2 for x in xs],
            simulated,
            width=0.4,
            label="simulated",
            color="white",
            edgecolor="C0",
            hatch="//",
        )
        ax.set_xticks(list(xs), names, rotation=20, ha="right")
        ax.set_ylabel(label)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        fig.suptitle(title)
    return fig


def mesh_layouts(
    shape: dict[str, int],
    ranks_per_node: int | None,
    orders: Sequence[str] = ("megatron", "llama3"),
) -> Figure:
    """The ranks of a mesh laid out by each order, side by side (lesson 09): one column per
    rank, a row for the node it sits on and a row per axis, each cell coloured by the
    group of that axis it belongs to. A group whose cells span two node colours crosses
    a node boundary (its messages take the slow links)."""
    from parcourse.mesh import Layout, nodes_of

    axes_shown = ("tp", "dp", "pp")
    layouts = [Layout.of(shape, order) for order in orders]
    n = layouts[0].world_size
    fig, axes = plt.subplots(
        len(orders),
        1,
        figsize=(max(6, 0.7 * n + 2), 1.6 * len(orders)),
        layout="constrained",
        squeeze=False,
    )
    palette = plt.get_cmap("tab10")
    for ax, order, layout in zip(axes[:, 0], orders, layouts):
        rows = ["node", *axes_shown]
        for y, row in enumerate(rows):
            if row == "node":
                groups = [
                    list(range(k, min(k + (ranks_per_node or n), n)))
                    for k in range(0, n, ranks_per_node or n)
                ]
            else:
                groups = layout.groups(row)
            for g, ranks in enumerate(groups):
                crosses = row != "node" and len(nodes_of(ranks, ranks_per_node)) > 1
                for r in ranks:
                    ax.add_patch(
                        plt.Rectangle(
                            (r, y),
                            0.94,
                            0.9,
                            color=palette(g % 10),
                            alpha=0.35 if row == "node" else 0.8,
                        )
                    )
                    ax.text(
                        r + 0.47,
                        y + 0.45,
                        f"{g}{'*' if crosses else ''}",
                        ha="center",
                        va="center",
                        fontsize=8,
                    )
        ax.set_xlim(0, n)
        ax.set_ylim(len(rows), 0)
        ax.set_yticks([y + 0.45 for y in range(len(rows))], rows)
        ax.set_xticks([r + 0.47 for r in range(n)], [str(r) for r in range(n)])
        ax.set_xlabel("rank")
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
        outer = ", ".join(a for a in layout.axes if layout.size(a) > 1) or "one rank"
        ax.set_title(
            f"{order}: outermost first {outer}; cells show each rank's group (* crosses a node)",
            loc="left",
            fontsize=10,
        )
    return fig


def mesh_memory(
    shapes: Sequence[dict[str, int]],
    measured: dict[int, Sequence[Sequence[dict[str, int]]]],
    theory: dict[int, Sequence[dict[str, float]]],
) -> Figure:
    """Memory per rank for several mesh shapes (lesson 09), one panel per ZeRO stage
    (`measured[zero][i]`: every rank's `Hybrid.memory()` on `shapes[i]`): the largest
    rank's parameters, gradients and Adam state stacked, the smallest rank's total as a
    thin bar (uneven stages), and `theory.mesh_bytes` as a black tick."""
    stages = sorted(measured)
    fig, axes = plt.subplots(
        1,
        len(stages),
        figsize=(5.5 * len(stages), 3.2),
        layout="constrained",
        sharey=True,
        squeeze=False,
    )
    categories = ("params", "grads", "optimizer")
    labels = [" x ".join(f"{a}{s[a]}" for a in ("dp", "tp", "pp")) for s in shapes]
    for ax, zero in zip(axes[0], stages):
        for i, ranks in enumerate(measured[zero]):
            largest = max(ranks, key=lambda m: sum(m[c] for c in categories))
            bottom = 0.0
            for k, c in enumerate(categories):
                ax.bar(
                    i,
                    largest[c] / 1024,
                    bottom=bottom,
                    color=f"C{k}",
                    width=0.6,
                    label={"optimizer": "Adam state"}.get(c, c) if i == 0 else None,
                )
                bottom += largest[c] / 1024
            smallest = min(sum(m[c] for c in categories) for m in ranks)
            ax.bar(
                i + 0.38,
                smallest / 1024,
                width=0.1,
                color="0.5",
                label="smallest rank" if i == 0 else None,
            )
            formula = sum(theory[zero][i][c] for c in categories) / 1024
            ax.plot(
                [i - 0.3, i + 0.3],
                [formula, formula],
                color="black",
                lw=2,
                label="formula (stages balanced)" if i == 0 else None,
            )
        ax.set_xticks(range(len(shapes)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(
            f"ZeRO-{zero} over dp" if zero else "optimizer replicated over dp",
            loc="left",
            fontsize=10,
        )
    axes[0][0].set_ylabel("KiB per rank (largest rank)")
    axes[0][-1].legend(fontsize=8, loc="upper right")
    return fig


def plan_bars(
    plans: Plans, memory_limit: float, top: int = 6, closest: int = 3, title: str = ""
) -> Figure:
    """The planner's choices (lesson 09, part 2): the busiest rank's memory by category
    for the `top` fastest configurations that fit and the `closest` that did not, against
    the GPU's memory (a line), beside each fitting one's step split into compute, tp,
    bubble, dp and the optimizer. `plans`: `parcourse.planner.Plans`."""
    ranked = plans.ranked[:top]
    out = sorted(
        (p for p in plans.rejected if p.why_not.startswith("out of memory")),
        key=lambda p: p.memory[p.busiest]["total"],
    )[:closest]
    fig, (mem_ax, time_ax) = plt.subplots(
        1,
        2,
        figsize=(12, 0.5 + 0.45 * (top + closest)),
        layout="constrained",
        width_ratios=[1.2, 1],
    )
    gib = 2**30
    rows = [*ranked, *out]
    for y, p in enumerate(rows):
        left = 0.0
        mem = p.memory[p.busiest]
        for k, c in enumerate(("params", "grads", "optimizer", "activations")):
            mem_ax.barh(
                y,
                mem[c] / gib,
                left=left,
                color=f"C{k}",
                label=c.replace("optimizer", "optimizer state") if y == 0 else None,
                alpha=1.0 if y < len(ranked) else 0.45,
            )
            left += mem[c] / gib
    mem_ax.axvline(memory_limit / gib, color="black", lw=1.5, ls="--", label="GPU memory")
    mem_ax.set_yticks(
        range(len(rows)),
        [p.choice.label() + ("" if i < len(ranked) else "  (out)") for i, p in enumerate(rows)],
        fontsize=8,
    )
    mem_ax.invert_yaxis()
    mem_ax.set_xlabel("GiB on the busiest pipeline rank")
    # Each legend in rows of three under its own axes: side by side, neither runs into
    # the other whatever the figure's width.
    mem_ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    parts = ("compute", "tp", "bubble", "dp", "optimizer", "cores")
    drawn = [c for c in parts if any(p.time.get(c, 0.0) > 0 for p in ranked)]
    longest = 0.0
    for y, p in enumerate(ranked):
        left = 0.0
        for k, c in enumerate(parts):
            seconds = max(0.0, p.time.get(c, 0.0))
            time_ax.barh(
                y, seconds, left=left, color=f"C{k + 4}", label=c if y == 0 and c in drawn else None
            )
            left += seconds
        time_ax.text(left, y, f" MFU {100 * p.time['mfu']:.0f}%", va="center", fontsize=8)
        longest = max(longest, left)
    # room inside the axes for the MFU written after the longest bar
    time_ax.set_xlim(0, 1.25 * longest or 1)
    time_ax.set_yticks(range(len(ranked)), [str(i + 1) for i in range(len(ranked))])
    time_ax.set_ylim(len(rows) - 0.5, -0.5)
    time_ax.set_xlabel("predicted seconds a step")
    time_ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def predicted_vs_measured(rows: dict[str, list[dict[str, dict[str, float]]]]) -> Figure:
    """The planner checked (lesson 09, part 2): for each configuration (a key of `rows`)
    and each of its pipeline ranks, the measured bytes by category stacked, and the
    predicted total as a black tick. `rows[label]`: `[{"pp", "measured", "predicted"}]`."""
    categories = ("params", "grads", "optimizer", "activations")
    fig, ax = plt.subplots(figsize=(10, 3.2), layout="constrained")
    x = 0.0
    ticks: list[float] = []
    labels: list[str] = []
    for per_rank in rows.values():
        for row in per_rank:
            bottom = 0.0
            for k, c in enumerate(categories):
                ax.bar(
                    x,
                    row["measured"][c] / 1024,
                    bottom=bottom,
                    color=f"C{k}",
                    width=0.7,
                    label=c if not ticks else None,
                )
                bottom += row["measured"][c] / 1024
            ax.plot(
                [x - 0.4, x + 0.4],
                [row["predicted"]["total"] / 1024] * 2,
                color="black",
                lw=2,
                label="predicted" if not ticks else None,
            )
            ticks.append(x)
            labels.append(f"pp {row['pp']}")
            x += 1
        x += 0.8
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("KiB on the rank (measured)")
    starts = 0
    for label, per_rank in rows.items():
        centre = sum(ticks[starts : starts + len(per_rank)]) / len(per_rank)
        ax.annotate(
            label,
            (centre, 0),
            xytext=(0, -26),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            annotation_clip=False,
        )
        starts += len(per_rank)
    ax.legend(fontsize=7, ncol=5, loc="upper left")
    return fig


def saved_bytes_over_a_step(curves: dict[str, list[tuple[float, float]]], n_layers: int) -> Figure:
    """Lesson 08: the activations held over one step, one curve per policy (the step's
    saves and releases in order, as a fraction; bytes in layer outputs)."""
    fig, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
    for k, (policy, points) in enumerate(curves.items()):
        xs, ys = zip(*points)
        ax.step(xs, ys, where="post", color=f"C{k}", label=policy, lw=1.6)
    ax.set_xlabel("the step's saves and releases, in order (forward, then backward)")
    ax.set_ylabel("held (layer outputs)")
    ax.set_title(f"{n_layers} layers: what autograd holds over one step", loc="left", fontsize=10)
    ax.legend(**plots.LEGEND_OUTSIDE)
    ax.grid(alpha=0.3)
    return fig


def in_flight_over_a_step(traces: dict[str, Trace], title: str) -> Figure:
    """Lesson 08: the activations each pipeline stage holds for microbatches in flight,
    one curve per run (e.g. with and without recomputation), one panel per rank. Drawn
    in order of the rank's forwards and backwards, not time: the runs take different
    times, and memory is what the picture is about."""
    ranks = sorted(
        {c.rank for t in traces.values() for c in t.counters if c.name == "in_flight_bytes"}
    )
    fig, axes = plt.subplots(
        len(ranks),
        1,
        figsize=(9, 0.4 + 1.3 * len(ranks)),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, rank in zip(axes[:, 0], ranks):
        for k, (label, trace) in enumerate(traces.items()):
            held = [
                c.meta["now"] / 1024
                for c in trace.counters
                if c.rank == rank and c.name == "in_flight_bytes"
            ]
            ax.step(
                range(len(held) + 1), [0.0, *held], where="post", color=f"C{k}", label=label, lw=1.6
            )
        ax.set_ylabel(f"rank {rank}\nKiB", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(title, loc="left", fontsize=10)
    axes[0, 0].legend(**plots.LEGEND_OUTSIDE)
    axes[-1, 0].set_xlabel("the rank's forwards (up) and backwards (down), in order")
    return fig
