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
