"""The figures lessons draw beside their panels, in one place: what a panel shows after a
run, from the run's results (matplotlib only; the library's own charts are
parcourse.plots, which these build on)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from parcourse import plots
from parcourse.experiments.pipeline import ScheduleSummary
from parcourse.trace import Trace


def pipeline_step(trace: Trace, per_rank_bytes: Sequence[float], title: str) -> Figure:
    """A measured pipeline step (lessons 06 and 07): each rank's timeline coloured by
    microbatch, above the peak activations each rank held."""
    ranks = len(per_rank_bytes)
    fig, axes = plt.subplots(2, 1, figsize=(10, 3 + 1.2 * ranks), layout="constrained",
                             height_ratios=[ranks, 2])
    plots.timeline(trace, ax=axes[0], color_by="microbatch", title=title)
    axes[1].bar(range(ranks), [b / 1024 for b in per_rank_bytes], color="C0")
    axes[1].set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes[1].set_ylabel("peak activations (KiB)")
    return fig


def plot_schedules(summaries: Sequence[ScheduleSummary], title: str = "") -> Figure:
    """Bubble and peak in-flight activations of each schedule: measured bars beside the
    simulator's (hatched)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    names = [s.name for s in summaries]
    xs = range(len(names))
    for ax, measured, simulated, label in (
            (axes[0], [s.bubble for s in summaries], [s.simulated_bubble for s in summaries],
             "bubble (idle fraction)"),
            (axes[1], [s.peak_bytes / 1024 for s in summaries],
             [s.simulated_peak_bytes / 1024 for s in summaries],
             "peak activations, busiest rank (KiB)")):
        ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured", color="C0")
        ax.bar([x + 0.2 for x in xs], simulated, width=0.4, label="simulated", color="white",
               edgecolor="C0", hatch="//")
        ax.set_xticks(list(xs), names, rotation=20, ha="right")
        ax.set_ylabel(label)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        fig.suptitle(title)
    return fig


def mesh_layouts(shape: dict[str, int], ranks_per_node: int | None,
                 orders: Sequence[str] = ("megatron", "llama3")) -> Figure:
    """The ranks of a mesh laid out by each order, side by side (lesson 09): one column per
    rank, a row for the node it sits on and a row per axis, each cell coloured by the
    group of that axis it belongs to. A group whose cells span two node colours crosses
    a node boundary (its messages take the slow links)."""
    from parcourse.mesh import Layout, nodes_of

    axes_shown = ("tp", "dp", "pp")
    layouts = [Layout.of(shape, order) for order in orders]
    n = layouts[0].world_size
    fig, axes = plt.subplots(len(orders), 1, figsize=(max(6, 0.7 * n + 2), 1.6 * len(orders)),
                             layout="constrained", squeeze=False)
    palette = plt.get_cmap("tab10")
    for ax, order, layout in zip(axes[:, 0], orders, layouts):
        rows = ["node", *axes_shown]
        for y, row in enumerate(rows):
            if row == "node":
                groups = [list(range(k, min(k + (ranks_per_node or n), n)))
                          for k in range(0, n, ranks_per_node or n)]
            else:
                groups = layout.groups(row)
            for g, ranks in enumerate(groups):
                crosses = row != "node" and len(nodes_of(ranks, ranks_per_node)) > 1
                for r in ranks:
                    ax.add_patch(plt.Rectangle((r, y), 0.94, 0.9, color=palette(g % 10),
                                               alpha=0.35 if row == "node" else 0.8))
                    ax.text(r + 0.47, y + 0.45, f"{g}{'*' if crosses else ''}", ha="center",
                            va="center", fontsize=8)
        ax.set_xlim(0, n)
        ax.set_ylim(len(rows), 0)
        ax.set_yticks([y + 0.45 for y in range(len(rows))], rows)
        ax.set_xticks([r + 0.47 for r in range(n)], [str(r) for r in range(n)])
        ax.set_xlabel("rank")
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
        outer = ", ".join(a for a in layout.axes if layout.size(a) > 1) or "one rank"
        ax.set_title(f"{order}: outermost first {outer}; cells show each rank's group "
                     f"(* crosses a node)", loc="left", fontsize=10)
    return fig


def mesh_memory(shapes: Sequence[dict[str, int]],
                measured: dict[int, Sequence[Sequence[dict[str, int]]]],
                theory: dict[int, Sequence[dict[str, float]]]) -> Figure:
    """Memory per rank for several mesh shapes (lesson 09), one panel per ZeRO stage
    (`measured[zero][i]`: every rank's `Hybrid.memory()` on `shapes[i]`): the largest
    rank's parameters, gradients and Adam state stacked, the smallest rank's total as a
    thin bar (uneven stages), and `theory.mesh_bytes` as a black tick."""
    stages = sorted(measured)
    fig, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 3.2),
                             layout="constrained", sharey=True, squeeze=False)
    categories = ("params", "grads", "optimizer")
    labels = [" x ".join(f"{a}{s[a]}" for a in ("dp", "tp", "pp")) for s in shapes]
    for ax, zero in zip(axes[0], stages):
        for i, ranks in enumerate(measured[zero]):
            largest = max(ranks, key=lambda m: sum(m[c] for c in categories))
            bottom = 0.0
            for k, c in enumerate(categories):
                ax.bar(i, largest[c] / 1024, bottom=bottom, color=f"C{k}", width=0.6,
                       label={"optimizer": "Adam state"}.get(c, c) if i == 0 else None)
                bottom += largest[c] / 1024
            smallest = min(sum(m[c] for c in categories) for m in ranks)
            ax.bar(i + 0.38, smallest / 1024, width=0.1, color="0.5",
                   label="smallest rank" if i == 0 else None)
            formula = sum(theory[zero][i][c] for c in categories) / 1024
            ax.plot([i - 0.3, i + 0.3], [formula, formula], color="black", lw=2,
                    label="formula (stages balanced)" if i == 0 else None)
        ax.set_xticks(range(len(shapes)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"ZeRO-{zero} over dp" if zero else "optimizer replicated over dp",
                     loc="left", fontsize=10)
    axes[0][0].set_ylabel("KiB per rank (largest rank)")
    axes[0][-1].legend(fontsize=8, loc="upper right")
    return fig
