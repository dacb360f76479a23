"""Matplotlib figures of what ranks did: timelines, memory, tensors.

Every function returns the Figure and takes an optional Axes, so a lesson can
put several pictures side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parcourse.memory import CATEGORIES
from parcourse.trace import Trace

KIND_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "idle": "#BBBBBB", "other": "#55A868"}
CATEGORY_COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "other": "#8172B3",
}
# Span metadata worth writing on a bar, in order of preference.
LABEL_KEYS = ("label", "microbatch", "chunk", "bucket", "stage", "step")


def _axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    return fig, ax


def _span_label(meta: Mapping[str, object], label_key: str | None) -> str | None:
    keys = (label_key,) if label_key else LABEL_KEYS
    for key in keys:
        if key in meta:
            value = meta[key]
            return str(value) if key == "label" else f"{key[0]}{value}"
    return None


def timeline(trace: Trace, ax: Axes | None = None, *, title: str | None = None,
             label_key: str | None = None, color_by: str | None = None,
             comm_lane: bool = False, unit: str = "ms") -> Figure:
    """One row per rank, one bar per span, coloured by kind (compute, comm, idle).

    `color_by="chunk"` (or any metadata key with integer values) colours spans
    by that value instead, e.g. to follow one chunk around a ring. Nested spans
    are drawn thinner on top of their parents. A span whose metadata has a
    `label`, `microbatch`, `chunk`, `bucket`, `stage` or `step` (or
    `label_key`) gets it written on the bar when there is room.
    `comm_lane=True` draws communication in a lane of its own under each rank's
    compute, so that overlap (comm during backward) shows.
    """
    scale = {"s": 1e9, "ms": 1e6, "us": 1e3}[unit]
    fig, ax = _axes(ax, (10, 0.6 + 0.5 * trace.world_size))
    t0 = trace.t0_ns
    end = max((s.end_ns for s in trace.spans), default=t0 + 1)
    span_width = (end - t0) / scale
    values = sorted({s.meta[color_by] for s in trace.spans if color_by in s.meta}) \
        if color_by else []
    palette = plt.get_cmap("tab10" if len(values) <= 10 else "tab20")
    color_of = {v: palette(i % palette.N) for i, v in enumerate(values)}
    for s in sorted(trace.spans, key=lambda s: s.depth):
        height = 0.8 * 0.75**s.depth
        y = s.rank
        if comm_lane:
            height /= 2
            y += 0.2 if s.kind == "comm" else -0.2
        left, width = (s.start_ns - t0) / scale, (s.end_ns - s.start_ns) / scale
        color = color_of.get(s.meta.get(color_by)) if color_by else None
        ax.barh(y, width, left=left, height=height,
                color=color or KIND_COLORS.get(s.kind, "#999"),
                edgecolor="white", linewidth=0.5, zorder=2 + s.depth)
        text = _span_label(s.meta, label_key)
        if text and width > 0.03 * span_width:
            ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=7,
                    color="white", zorder=10)
    ax.set_yticks(range(trace.world_size), [f"rank {r}" for r in range(trace.world_size)])
    ax.set_ylim(trace.world_size - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, span_width * 1.01 or 1)
    if values:
        handles = [Patch(color=color_of[v], label=f"{color_by} {v}") for v in values]
    else:
        kinds = sorted({s.kind for s in trace.spans}, key=list(KIND_COLORS).index)
        handles = [Patch(color=KIND_COLORS[k], label=k) for k in kinds]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              ncols=min(len(handles), 6) or 1, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, loc="left")
    return fig


def memory(trace: Trace, ax: Axes | None = None, *, labels: Sequence[str] | None = None,
           theory: Mapping[str, float] | None = None, title: str | None = None) -> Figure:
    """Bytes per rank, stacked by category, at each named memory sample.

    Groups of bars, one group per label (e.g. "after forward"), one bar per
    rank. `theory` maps a label to the bytes per rank the formula predicts,
    drawn as a black line across that group.
    """
    labels = list(labels) if labels else list(dict.fromkeys(m.label for m in trace.memory))
    fig, ax = _axes(ax, (max(5, 1.6 * len(labels) * max(1, trace.world_size) ** 0.5), 4))
    n = trace.world_size
    width = 0.8 / n
    peak = max((m.total for m in trace.memory), default=1)
    unit, div = _unit(peak)
    used: set[str] = set()
    for g, label in enumerate(labels):
        samples = trace.memory_at(label)
        for rank, sample in samples.items():
            x = g - 0.4 + width * (rank + 0.5)
            bottom = 0.0
            for category in CATEGORIES:
                value = sample.bytes.get(category, 0) / div
                if value:
                    ax.bar(x, value, width * 0.9, bottom=bottom, color=CATEGORY_COLORS[category])
                    used.add(category)
                bottom += value
            if n <= 8:
                ax.text(x, -0.02, f"r{rank}", ha="center", va="top", fontsize=7,
                        transform=ax.get_xaxis_transform())
        if theory and label in theory:
            ax.hlines(theory[label] / div, g - 0.42, g + 0.42, colors="black", linestyles="--",
                      zorder=5, label="theory" if g == 0 else None)
    ax.set_xticks(range(len(labels)), labels)
    ax.tick_params(axis="x", pad=14)
    ax.set_ylabel(f"bytes per rank ({unit})")
    handles = [Patch(color=CATEGORY_COLORS[c], label=c) for c in CATEGORIES if c in used]
    if theory:
        handles.append(plt.Line2D([], [], color="black", linestyle="--", label="theory"))
    ax.legend(handles=handles, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    return fig


def _unit(peak: float) -> tuple[str, float]:
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if peak >= div:
            return unit, div
    return "B", 1


def tensors_before_after(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                         title: str = "", fig: Figure | None = None) -> Figure:
    """Each rank's tensor before and after a collective, one row per rank.

    Cells are coloured by value and show it, so the learner sees what moved
    where: an all_reduce makes every row equal, an all_gather makes rows longer.
    """
    rows = len(before)
    fig = fig or plt.figure(figsize=(9, 0.5 + 0.45 * rows), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[_width(before), _width(after)])
    values = [t.float().flatten() for t in [*before, *after] if t.numel()]
    lo = float(min(v.min() for v in values)) if values else 0.0
    hi = float(max(v.max() for v in values)) if values else 1.0
    for ax, tensors, name in zip(axes, (before, after), ("before", "after")):
        width = max(1, _width(tensors))
        grid = np.full((rows, width), np.nan)
        for r, t in enumerate(tensors):
            flat = t.detach().float().flatten().numpy()
            grid[r, : flat.size] = flat
        ax.imshow(grid, cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1, aspect="auto")
        for r, t in enumerate(tensors):
            for i, v in enumerate(t.detach().flatten().tolist()):
                shade = (v - lo) / (hi - lo) if hi > lo else 0.0
                text = f"{v:g}" if isinstance(v, float) else str(v)
                ax.text(i, r, text, ha="center", va="center", fontsize=8,
                        color="black" if shade > 0.6 else "white")
        ax.set_yticks(range(rows), [f"rank {r}" for r in range(rows)])
        ax.set_xticks([])
        ax.set_title(name, fontsize=10)
    if title:
        fig.suptitle(title)
    return fig


def _width(tensors: Sequence[torch.Tensor]) -> int:
    return max((t.numel() for t in tensors), default=1)


def bandwidth(sizes: Sequence[int], measured: Mapping[str, Sequence[float]],
              models: Mapping[str, Callable[[int], float]] | None = None,
              ax: Axes | None = None, *, ceiling: float | None = None,
              title: str | None = None) -> Figure:
    """Bus bandwidth against message size, measured (dots) beside a model (lines).

    `measured` maps an algorithm to its busbw in bytes/s at each size; `models`
    maps an algorithm to a function size -> predicted busbw (e.g. from an
    alpha-beta fit); `ceiling` draws the link's own bandwidth.
    """
    fig, ax = _axes(ax, (7, 4))
    dense = np.geomspace(min(sizes), max(sizes), 100)
    for i, (algo, values) in enumerate(measured.items()):
        color = f"C{i}"
        ax.plot(sizes, np.asarray(values) / 1e9, "o", color=color, label=f"{algo} (measured)")
        if models and algo in models:
            ax.plot(dense, [models[algo](int(s)) / 1e9 for s in dense], "-", color=color,
                    alpha=0.7, label=f"{algo} (alpha-beta model)")
    if ceiling:
        ax.axhline(ceiling / 1e9, color="black", linestyle=":", label="link (p2p) bandwidth")
    ax.set_xscale("log", base=2)
    ticks = [s for s in sizes]
    ax.set_xticks(ticks, [_size_label(s) for s in ticks], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return fig


def _size_label(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return f"{n}B"
