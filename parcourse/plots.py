"""Matplotlib figures of what ranks did: timelines, memory, tensors.

Every function returns the Figure (the SubFigure, given an Axes on one) and takes an
optional Axes, so a lesson can put several pictures side by side. One file because the
figures share their colours, legends and bar helpers; read it by function: timeline,
memory (by rank, and `placement`, by where bytes live), memory_against_gpus,
tensors_before_after, bandwidth, device_turns, operator_timeline (torch.profiler's
operators under the course's spans).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backend_bases import RendererBase
from matplotlib.figure import Figure, SubFigure
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from parcourse.memory import CATEGORIES, byte_unit
from parcourse.parts import AXIS_COLORS
from parcourse.profiler import OpEvent, RankProfile
from parcourse.trace import Span, Trace, with_collective_waits

if TYPE_CHECKING:  # matplotlib >= 3.8
    from matplotlib.typing import ColorType

# A timeline bar's colour says what the span was: the phase of compute, the collective of
# communication, else its kind. Legends list them in this order.
SPAN_COLORS = {
    "forward": "#64B5CD",
    "backward": "#2A3F6F",
    "optimizer": "#8172B3",
    "compute": "#4C72B0",
    "all-reduce": "#DD8452",
    "reduce-scatter": "#C44E52",
    "all-gather": "#55A868",
    "all-to-all": "#B8860B",
    "comm": "#937860",
    "disk": "#DA8BC3",
    "idle": "#BBBBBB",
    "other": "#8C8C8C",
}
# Pipeline actions (parcourse.pipeline.schedule): I and W split backward in two.
ACTION_PHASES = {"F": "forward", "B": "backward", "I": "backward", "W": "backward"}
# A pipeline's backward kinds apart, whatever the colour: B darker, I darker and dotted,
# W lighter and hatched (zero-bubble's W's fill the bubble).
ACTION_SHADES = {"B": 0.65, "I": 0.65, "W": 1.35}
ACTION_HATCHES = {"I": "..", "W": "\\\\"}
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
# Legends go right of the plotted area, never over the data.
LEGEND_OUTSIDE: dict[str, Any] = {
    "loc": "upper left",
    "bbox_to_anchor": (1.01, 1.0),
    "borderaxespad": 0.0,
    "fontsize": 8,
}
CATEGORY_COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "other": "#8172B3",
}
# Span metadata worth writing on a bar, in order of preference.
LABEL_KEYS = ("label", "microbatch", "chunk", "bucket", "stage", "step")


def _axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure | SubFigure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    return fig, ax


def _span_label(meta: Mapping[str, object], label_key: str | None) -> str | None:
    if label_key is None and meta.get("action") in ACTION_PHASES and "microbatch" in meta:
        return f"{meta['action']}{meta['microbatch']}"  # a pipeline action: F0, B0, I0, W0
    keys = (label_key,) if label_key else LABEL_KEYS
    for key in keys:
        if key in meta:
            value = meta[key]
            return str(value) if key == "label" else f"{key[0]}{value}"
    return None


def _shaded(color: ColorType, factor: float) -> tuple[float, float, float]:
    """`color` darker (factor < 1) or lighter (> 1, towards white)."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    if factor <= 1:
        return (r * factor, g * factor, b * factor)
    k = factor - 1
    return (r + (1 - r) * k, g + (1 - g) * k, b + (1 - b) * k)


def span_color_key(span: Span) -> str:
    """The entry of SPAN_COLORS a span is drawn in: forward, backward or optimizer for
    compute, the collective for communication (from its `op`, its ring `phase` or its
    name), else its kind."""
    if span.kind == "compute":
        action = span.meta.get("action")
        if action in ACTION_PHASES:
            return ACTION_PHASES[str(action)]
        name = span.name.lower()
        for phase in ("forward", "backward", "optimizer"):
            if name.startswith(phase):
                return phase
        return "optimizer" if name.startswith("update") else "compute"
    if span.kind == "comm":
        for said in (span.meta.get("op"), span.meta.get("phase"), span.name):
            words = str(said or "").lower().replace("_", "-")
            for collective in COLLECTIVES:
                if collective in words:
                    return collective
        return "comm"
    if span.name.startswith("disk"):
        return "disk"
    return span.kind if span.kind in SPAN_COLORS else "other"


class BarLabels(Artist):
    """The labels written on a timeline's bars. Each is drawn only where it fits, which is
    known only at draw time, after layout: inside its bar and clear of the labels drawn
    before it (two overlapping bars would otherwise print "b0b1"). `shown` lists the
    labels of the last draw."""

    def __init__(self) -> None:
        super().__init__()
        self.set_zorder(10)
        self.set_in_layout(False)
        self._bars: list[tuple[float, float, float, Text]] = []
        self.shown: list[str] = []

    def add(self, left: float, width: float, y: float, height: float, text: str) -> None:
        label = Text(left + width / 2, y, text, ha="center", va="center", fontsize=7, color="white")
        self._bars.append((left, width, height, label))

    def draw(self, renderer: RendererBase) -> None:
        self.shown = []
        taken: list[Bbox] = []
        assert self.axes is not None, "drawn only once added to an Axes"
        to_pixels = self.axes.transData
        for left, width, height, label in self._bars:
            label.set_figure(self.figure)
            label.set_transform(to_pixels)
            (x0, y0), (x1, y1) = to_pixels.transform([(left, 0), (left + width, height)])
            box = label.get_window_extent(renderer)
            fits = box.width + 4 <= abs(x1 - x0) and box.height <= 1.15 * abs(y1 - y0)
            if fits and not any(box.overlaps(other) for other in taken):
                label.draw(renderer)
                taken.append(box)
                self.shown.append(label.get_text())
        self.stale = False


def _visible_parts(
    bars: list[tuple[float, float, float, float, str | None]],
) -> list[tuple[float, float, float, float, str]]:
    """(y, left, width, height, text) of the longest stretch of each labelled bar that no
    later bar in its lane covers: concurrent spans (all-reduces in flight together, a
    collective's steps nested in it) are drawn over each other, and a label belongs where
    its own bar shows."""
    by_lane: dict[float, list[int]] = {}
    for i, bar in enumerate(bars):
        by_lane.setdefault(bar[0], []).append(i)
    parts = []
    for indices in by_lane.values():
        lefts = np.array([bars[i][1] for i in indices])
        rights = np.array([bars[i][2] for i in indices])
        for k, i in enumerate(indices):
            y, left, right, height, text = bars[i]
            if not text:
                continue
            later = np.arange(len(indices)) > k
            over = later & (lefts < right) & (rights > left)
            best, start = (left, left), left
            for a, b in sorted(zip(lefts[over], rights[over])):
                if a > start and a - start > best[1] - best[0]:
                    best = (start, min(a, right))
                start = max(start, b)
            if right > start and right - start > best[1] - best[0]:
                best = (start, right)
            if best[1] > best[0]:
                parts.append((y, best[0], best[1] - best[0], height, text))
    return parts


# One colour per mesh axis, in every figure that shows axes (the timeline coloured by axis,
# the bytes each axis sent, ...), whichever axes a run has: the registry's
# (`parcourse.parts.AXIS_COLORS`, each axis' colour declared by its part).


def timeline(
    trace: Trace,
    ax: Axes | None = None,
    *,
    title: str | None = None,
    label_key: str | None = None,
    color_by: str | None = None,
    comm_lane: bool = False,
    unit: str = "ms",
) -> Figure | SubFigure:
    """One row per rank, one bar per span, coloured by what it was (span_color_key):
    forward, backward, optimizer or other compute; all-reduce, reduce-scatter, all-gather
    or other communication; idle.

    `color_by="chunk"` (or any metadata key with integer values) colours spans
    by that value instead, e.g. to follow one chunk around a ring. Nested spans
    are drawn thinner on top of their parents. A span whose metadata has a
    `label`, `microbatch`, `chunk`, `bucket`, `stage` or `step` (or
    `label_key`) gets it written on the bar where it fits (BarLabels).
    `comm_lane=True` draws communication (and a disk's reads and writes) in a lane of
    its own under each rank's compute, so that overlap (comm during backward) shows. The
    legend sits right of the bars.

    Drawn in steps, one function each: a colour per value of `color_by`
    (`_value_colors`), the bars (`_draw_spans`), their labels (`BarLabels`), the rows and
    the time axis (`_rank_axes`), the legend (`_timeline_legend`).
    """
    scale = {"s": 1e9, "ms": 1e6, "us": 1e3}[unit]
    fig, ax = _axes(ax, (11, 0.6 + 0.5 * trace.world_size))
    if trace.world_size == 1:
        # One rank has nobody to talk to: its collectives return at once, and a timeline of
        # them alone would be a few microseconds of nothing.
        title = (
            f"{title} (one rank: nothing to communicate)"
            if title
            else "one rank: nothing to communicate"
        )
        if not any(s.kind != "comm" for s in trace.spans):
            _nothing_to_communicate(ax, title)
            return fig
        # ... and what it recorded as communication (a collective over itself) is not
        # drawn under a title that says there is none.
        trace = dataclasses.replace(trace, spans=[s for s in trace.spans if s.kind != "comm"])
    # a collective's wait for the last of its partners is waiting, not that axis' work
    trace = with_collective_waits(trace)
    t0 = trace.t0_ns
    end = max((s.end_ns for s in trace.spans), default=t0 + 1)
    values, color_of = _value_colors(trace, color_by)
    used, bars = _draw_spans(
        ax,
        trace,
        t0,
        scale,
        color_by=color_by,
        color_of=color_of,
        comm_lane=comm_lane,
        label_key=label_key,
    )
    labels = BarLabels()
    for y, left, width, height, text in _visible_parts(bars):
        labels.add(left, width, y, height, text)
    ax.add_artist(labels)
    _rank_axes(ax, trace.world_size, unit, (end - t0) / scale)
    _timeline_legend(ax, trace, color_by, values, color_of, used)
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, loc="left")
    return fig


def _nothing_to_communicate(ax: Axes, title: str) -> None:
    """One rank's timeline of communication alone: a sentence instead of bars."""
    ax.text(
        0.5,
        0.5,
        "one rank: nothing to communicate",
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=11,
    )
    ax.set_axis_off()
    if title:
        ax.set_title(title, loc="left")


def _value_colors(trace: Trace, color_by: str | None) -> tuple[list[Any], dict[Any, ColorType]]:
    """The values of `color_by` in the trace's spans, sorted, and a colour for each (a mesh
    axis keeps its colour in every figure of the course)."""
    values = (
        sorted({s.meta[color_by] for s in trace.spans if color_by in s.meta}) if color_by else []
    )
    palette = plt.get_cmap("tab10" if len(values) <= 10 else "tab20")
    color_of: dict[Any, ColorType] = {v: palette(i % palette.N) for i, v in enumerate(values)}
    if color_by == "axis":
        color_of = {v: AXIS_COLORS.get(v, color_of[v]) for v in values}
    return values, color_of


def _draw_spans(
    ax: Axes,
    trace: Trace,
    t0: int,
    scale: float,
    *,
    color_by: str | None,
    color_of: Mapping[Any, ColorType],
    comm_lane: bool,
    label_key: str | None,
) -> tuple[set[str], list[tuple[float, float, float, float, str | None]]]:
    """A bar per span that lasts, time counted from `t0` in units of `scale` ns, parents
    before the spans nested in them (thinner, on top). Returns the SPAN_COLORS keys drawn
    (for the legend) and, in drawing order, each bar's (y, left, right, height, label)."""
    used: set[str] = set()
    bars: list[tuple[float, float, float, float, str | None]] = []
    for s in sorted(trace.spans, key=lambda s: s.depth):
        if s.end_ns <= s.start_ns:
            continue  # an instant (a message that had arrived): nothing to draw
        height = 0.8 * 0.75**s.depth
        y: float = s.rank
        if comm_lane:  # data moving (messages, and a disk's reads and writes) below
            height /= 2
            y += 0.2 if s.kind == "comm" or span_color_key(s) == "disk" else -0.2
        left, width = (s.start_ns - t0) / scale, (s.end_ns - s.start_ns) / scale
        # Waiting is no work of any axis or microbatch: always drawn as waiting.
        given = color_of.get(s.meta.get(color_by)) if color_by and s.kind != "idle" else None
        key = span_color_key(s) if given is None else ""
        if key:
            used.add(key)
        color = SPAN_COLORS[key] if given is None else given
        if key == "idle":  # an outline, hatched: time nothing ran, not a kind of work
            ax.barh(
                y,
                width,
                left=left,
                height=height,
                facecolor="none",
                edgecolor=color,
                hatch="////",
                linewidth=0.5,
                zorder=2 + s.depth,
            )
        else:
            action = str(s.meta.get("action"))
            ax.barh(
                y,
                width,
                left=left,
                height=height,
                color=_shaded(color, ACTION_SHADES.get(action, 1.0)),
                hatch=ACTION_HATCHES.get(action),
                edgecolor="white",
                linewidth=0.5,
                zorder=2 + s.depth,
            )
        # a wait keeps its collective's label in its metadata; written on it, it would read
        # as that collective's work
        label = None if key == "idle" else _span_label(s.meta, label_key)
        bars.append((y, left, left + width, height, label))
    return used, bars


def _rank_axes(ax: Axes, world_size: int, unit: str, span_width: float) -> None:
    """A row per rank, rank 0 on top; time from 0 to the end of the longest timeline that
    shares this one's time axis (drawn before it), so that none is cut off on the right."""
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_ylim(world_size - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    others = [a for a in ax.get_shared_x_axes().get_siblings(ax) if a is not ax and a.has_data()]
    ax.set_xlim(0, max([span_width, *(a.dataLim.x1 for a in others)]) * 1.01 or 1)


def _timeline_legend(
    ax: Axes,
    trace: Trace,
    color_by: str | None,
    values: Sequence[Any],
    color_of: Mapping[Any, ColorType],
    used: set[str],
) -> None:
    """The legend right of the bars: the values of `color_by`, the SPAN_COLORS drawn, and,
    coloured by value with several kinds of pipeline action, the shade of each kind."""
    handles = [Patch(color=color_of[v], label=f"{color_by} {v}") for v in values]
    handles += [
        Patch(facecolor="none", edgecolor=c, hatch="////", label="idle (waiting)")
        if k == "idle"
        else Patch(color=c, label=k)
        for k, c in SPAN_COLORS.items()
        if k in used
    ]
    actions = [
        a for a in ("F", "B", "I", "W") if any(sp.meta.get("action") == a for sp in trace.spans)
    ]
    if color_by and len(actions) > 1:  # the shades say which part of a microbatch's work
        names = {"F": "forward", "B": "backward", "I": "input grad.", "W": "weight grad."}
        handles += [
            Patch(
                facecolor=_shaded("#808080", ACTION_SHADES.get(a, 1.0)),
                hatch=ACTION_HATCHES.get(a),
                edgecolor="white",
                label=f"{a}: {names[a]}",
            )
            for a in actions
        ]
    rows = max(1, (trace.world_size * 3) // 2 + 2)  # entries that fit beside the bars
    ax.legend(handles=handles, frameon=False, ncols=-(-len(handles) // rows) or 1, **LEGEND_OUTSIDE)


PLACEMENTS = ("device", "host", "disk")


def placement(
    per_config: Mapping[str, Mapping[str, Mapping[str, float]]],
    params: int,
    formulas: Mapping[str, Mapping[str, Mapping[str, float]] | None] | None = None,
    ax: Axes | None = None,
    *,
    title: str | None = None,
) -> Figure | SubFigure:
    """Bytes per parameter by where they live: for each configuration, a bar for the
    device, the host and the disk, stacked by category ({label: {placement: {category:
    bytes}}}, as `zero.bytes_by_placement` gives them). `formulas` (same shape) are drawn
    as a dashed line over each bar."""
    labels = list(per_config)
    fig, ax = _axes(ax, (1.5 + 2.2 * len(labels), 3.6))
    used: set[str] = set()
    for g, label in enumerate(labels):
        for j, where in enumerate(PLACEMENTS):
            x = g + (j - 1) * 0.27
            _stacked_bar(ax, x, 0.25, per_config[label].get(where, {}), params, used)
            ax.text(
                x,
                -0.02,
                where,
                ha="center",
                va="top",
                fontsize=7,
                transform=ax.get_xaxis_transform(),
            )
            formula = (formulas or {}).get(label)
            if formula:
                want = sum(formula.get(where, {}).values()) / params
                ax.hlines(want, x - 0.13, x + 0.13, colors="black", linestyles="--", zorder=5)
    ax.set_xticks(range(len(labels)), [textwrap.fill(label, 16) for label in labels])
    ax.tick_params(axis="x", pad=14)
    ax.set_ylabel("bytes per parameter")
    _category_legend(ax, used, "formula" if formulas and any(formulas.values()) else None, title)
    return fig


def _stacked_bar(
    ax: Axes, x: float, width: float, by_category: Mapping[str, float], div: float, used: set[str]
) -> None:
    """One bar, its bytes stacked by category (each divided by `div`), in CATEGORIES'
    order; the categories drawn are added to `used`, for the legend."""
    bottom = 0.0
    for category in CATEGORIES:
        value = by_category.get(category, 0) / div
        if value:
            ax.bar(x, value, width, bottom=bottom, color=CATEGORY_COLORS[category])
            used.add(category)
        bottom += value


def _category_legend(ax: Axes, used: set[str], line: str | None, title: str | None) -> None:
    """The categories drawn, and the dashed line's meaning (`line`, if one is drawn)."""
    handles: list[Artist] = [
        Patch(color=CATEGORY_COLORS[c], label=c) for c in CATEGORIES if c in used
    ]
    if line:
        handles.append(plt.Line2D([], [], color="black", linestyle="--", label=line))
    ax.legend(handles=handles, **LEGEND_OUTSIDE)
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title)


def memory(
    trace: Trace,
    ax: Axes | None = None,
    *,
    labels: Sequence[str] | None = None,
    theory: Mapping[str, float] | None = None,
    title: str | None = None,
) -> Figure | SubFigure:
    """Bytes per rank, stacked by category, at each named memory sample.

    Groups of bars, one group per label (e.g. "after forward"), one bar per
    rank. `theory` maps a label to the bytes per rank the formula predicts,
    drawn as a black line across that group.
    """
    labels = list(labels) if labels else list(dict.fromkeys(m.label for m in trace.memory))
    fig, ax = _axes(ax, (1.3 + max(5, 1.6 * len(labels) * max(1, trace.world_size) ** 0.5), 4))
    n = trace.world_size
    width = 0.8 / n
    peak = max((m.total for m in trace.memory), default=1)
    unit, div = byte_unit(peak)
    used: set[str] = set()
    for g, label in enumerate(labels):
        samples = trace.memory_at(label)
        for rank, sample in samples.items():
            x = g - 0.4 + width * (rank + 0.5)
            _stacked_bar(ax, x, width * 0.9, sample.bytes, div, used)
            if n <= 8:  # "r0" under each bar; past 4 ranks the number alone (they touch)
                ax.text(
                    x,
                    -0.02,
                    f"r{rank}" if n <= 4 else str(rank),
                    ha="center",
                    va="top",
                    fontsize=7,
                    transform=ax.get_xaxis_transform(),
                )
        if theory and label in theory:
            ax.hlines(
                theory[label] / div,
                g - 0.42,
                g + 0.42,
                colors="black",
                linestyles="--",
                zorder=5,
                label="theory" if g == 0 else "",
            )
    # Two short lines rather than one long one: side-by-side plots leave little room.
    ax.set_xticks(range(len(labels)), [textwrap.fill(label, 12) for label in labels])
    ax.tick_params(axis="x", pad=14)
    if 4 < n <= 8:
        ax.set_xlabel("a bar per rank, numbered under it", fontsize=8)
    ax.set_ylabel(f"bytes per rank ({unit})")
    _category_legend(ax, used, "theory" if theory else None, title)
    return fig


# Memory of real GPUs (GiB; "80 GB" as sold is 80 GiB of HBM), drawn as reference lines.
GPU_MEMORY_GB = {"RTX 4090": 24, "A100 / H100": 80, "H200": 141, "MI300X / B200": 192}


def memory_against_gpus(
    per_rank: Mapping[str, float],
    ax: Axes | None = None,
    *,
    gpus: Mapping[str, float] = GPU_MEMORY_GB,
    title: str | None = None,
) -> Figure | SubFigure:
    """Bytes per rank as one bar per category and their stacked total, beside the memory
    of real GPUs (horizontal lines, in GiB): does it fit? Under a GiB a rank, in the unit
    that fits (a few bytes would read 9.31e-07 GiB), and no GPU is near it to draw."""
    fig, ax = _axes(ax, (7, 3.6))
    unit, div = byte_unit(sum(per_rank.values()))  # GiB at most
    names = list(per_rank)
    values = [per_rank[k] / div for k in names]
    total = sum(values)
    if unit != "GiB":
        gpus = {}
    for i, (name, value) in enumerate(zip(names, values)):
        ax.bar(i, value, 0.6, color=CATEGORY_COLORS.get(name, "#8C8C8C"))
        ax.annotate(
            f"{value:.3g}",
            (i, value),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    bottom = 0.0
    for name, value in zip(names, values):
        ax.bar(len(names), value, 0.6, bottom=bottom, color=CATEGORY_COLORS.get(name, "#8C8C8C"))
        bottom += value
    ax.annotate(
        f"{total:.3g}",
        (len(names), total),
        ha="center",
        va="bottom",
        fontsize=8,
        fontweight="bold",
        xytext=(0, 2),
        textcoords="offset points",
    )
    # Up to the first GPU it fits on, so the chart shows how much room is left.
    fits = [size for size in sorted(gpus.values()) if size >= total]
    top = max(total * 1.15, (fits[0] if fits else 0) * 1.1)
    for name, size in gpus.items():
        if size <= top:
            ax.axhline(size, color="black", linestyle=":", linewidth=1)
            ax.annotate(
                f"{name} {size:g} GB",
                (1.0, size),
                xycoords=("axes fraction", "data"),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(names) + 1), [*names, "total"])
    ax.set_ylabel(f"per rank ({unit})")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    return fig


def tensors_before_after(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    title: str = "",
    fig: Figure | None = None,
) -> Figure:
    """Each rank's tensor before and after a collective, one row per rank.

    Cells are coloured by value and show it, so the learner sees what moved
    where: an all_reduce makes every row equal, an all_gather makes rows longer.
    """
    rows = len(before)
    fig = fig or plt.figure(figsize=(9, 0.5 + 0.45 * rows), layout="constrained")
    widths = [max(1, _width(t)) for t in (before, after)]
    # Cells as wide on both sides, unless one side is far longer (an all_gather on many
    # ranks): the shorter then keeps a quarter of the width, and room for its numbers.
    ratios = [max(w, max(widths) / 4) for w in widths]
    axes = fig.subplots(1, 2, width_ratios=ratios)
    values = [t.float().flatten() for t in [*before, *after] if t.numel()]
    lo = float(min(v.min() for v in values)) if values else 0.0
    hi = float(max(v.max() for v in values)) if values else 1.0
    for ax, tensors, name, width, ratio in zip(
        axes, (before, after), ("before", "after"), widths, ratios
    ):
        grid = np.full((rows, width), np.nan)
        for r, t in enumerate(tensors):
            flat = t.detach().float().flatten().numpy()
            grid[r, : flat.size] = flat
        ax.imshow(grid, cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1, aspect="auto")
        texts = [
            [f"{v:g}" if isinstance(v, float) else str(v) for v in t.detach().flatten().tolist()]
            for t in tensors
        ]
        # A cell's width in points, and the font that fits its longest value in it (values
        # in cells too narrow for 5 points are left to the colours): at 8 ranks an
        # all_gather's row is 8 times as long, and its numbers must not run together.
        cell = 72 * fig.get_figwidth() * 0.85 * ratio / sum(ratios) / width
        longest = max((len(x) for row in texts for x in row), default=1)
        size = min(8.0, cell / (0.65 * longest + 0.6))
        for r, (t, row) in enumerate(zip(tensors, texts)):
            if size < 5:
                break
            for i, (v, text) in enumerate(zip(t.detach().flatten().tolist(), row)):
                shade = (v - lo) / (hi - lo) if hi > lo else 0.0
                ax.text(
                    i,
                    r,
                    text,
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="black" if shade > 0.6 else "white",
                )
        ax.set_yticks(range(rows), [f"rank {r}" for r in range(rows)])
        ax.set_xticks([])
        ax.set_title(name, fontsize=10)
    if title:
        fig.suptitle(title)
    return fig


def _width(tensors: Sequence[torch.Tensor]) -> int:
    return max((t.numel() for t in tensors), default=1)


def bandwidth(
    sizes: Sequence[int],
    measured: Mapping[str, Sequence[float]],
    models: Mapping[str, Callable[[int], float]] | None = None,
    ax: Axes | None = None,
    *,
    ceiling: float | None = None,
    title: str | None = None,
) -> Figure | SubFigure:
    """Bus bandwidth against message size, measured (dots) beside a model (lines).

    `measured` maps an algorithm to its busbw in bytes/s at each size; `models`
    maps an algorithm to a function size -> predicted busbw (e.g. from an
    alpha-beta fit); `ceiling` draws the link's own bandwidth.
    """
    fig, ax = _axes(ax, (9, 4))
    dense = np.geomspace(min(sizes), max(sizes), 100)
    for i, (algo, values) in enumerate(measured.items()):
        color = f"C{i}"
        ax.plot(sizes, np.asarray(values) / 1e9, "o", color=color, label=f"{algo} (measured)")
        if models and algo in models:
            ax.plot(
                dense,
                [models[algo](int(s)) / 1e9 for s in dense],
                "-",
                color=color,
                alpha=0.7,
                label=f"{algo} (alpha-beta model)",
            )
    if ceiling:
        ax.axhline(ceiling / 1e9, color="black", linestyle=":", label="link (p2p) bandwidth")
    ax.set_xscale("log", base=2)
    ticks = [s for s in sizes]
    ax.set_xticks(ticks, [_size_label(s) for s in ticks], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend(**LEGEND_OUTSIDE)
    if title:
        ax.set_title(title)
    return fig


def _size_label(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return f"{n}B"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 rank', '2 ranks', '1 microbatch', '4 microbatches': for titles and status
    lines, where a learner may have typed 1."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {plural or (noun + 'es' if noun.endswith(('ch', 'sh', 's', 'x')) else noun + 's')}"


class TurnsRun(TypedDict):
    """One rank's step as `device_turns` draws it (`experiments.experts.hidden_traffic`'s
    result): when it started, the turns held ((action kind, start, end)) and the
    all-to-all waits ((start, end)), in seconds."""

    start: float
    held: list[tuple[str, float, float]]
    waits: list[tuple[float, float]]


def device_turns(
    runs: Mapping[str, TurnsRun], ax: Axes | None = None, *, title: str | None = None
) -> Figure | SubFigure:
    """One rank's device over one step of each run, beside the all-to-all it waited for:
    for each label (a schedule), a row of the turn held (forward, backward) and under it a
    row of the all-to-all waits, grey where the other thread computed beside them (hidden),
    red where the device sat idle (exposed). `runs[label]`: a rank's result of
    `experiments.experts.hidden_traffic` ("start", "held", "waits")."""
    from parcourse.comm.turns import uncovered

    fig, ax = _axes(ax, (10, 1.2 + 1.1 * len(runs)))
    rows, y = [], 0.0
    for label, run in runs.items():
        t0 = float(run["start"])
        held = [(k, s, e) for k, s, e in run["held"] if e > t0]
        waits = [(s, e) for s, e in run["waits"] if e > t0]
        for phase in {ACTION_PHASES[kind] for kind, _, _ in held}:  # one call a colour
            ax.broken_barh(
                [
                    ((s - t0) * 1e3, (e - s) * 1e3)
                    for kind, s, e in held
                    if ACTION_PHASES[kind] == phase
                ],
                (y + 0.55, 0.4),
                color=SPAN_COLORS[phase],
            )
        ax.broken_barh(
            [((s - t0) * 1e3, (e - s) * 1e3) for s, e in waits],
            (y + 0.05, 0.4),
            color=SPAN_COLORS["idle"],
        )
        idle = uncovered(waits, [(s, e) for _, s, e in held])
        ax.broken_barh(
            [((s - t0) * 1e3, (e - s) * 1e3) for s, e in idle], (y + 0.05, 0.4), color="#C44E52"
        )
        rows += [(y + 0.25, f"{label}: all-to-all"), (y + 0.75, f"{label}: device")]
        y += 1.2
    ax.set_yticks([r for r, _ in rows], [t for _, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms into the step")
    ax.legend(
        handles=[
            Patch(color=SPAN_COLORS["forward"], label="forward"),
            Patch(color=SPAN_COLORS["backward"], label="backward"),
            Patch(color=SPAN_COLORS["idle"], label="all-to-all, hidden"),
            Patch(color="#C44E52", label="all-to-all, exposed"),
        ],
        **LEGEND_OUTSIDE,
    )
    if title:
        ax.set_title(title)
    return fig


# torch's names for a collective, in the words of SPAN_COLORS ("gloo:all_reduce",
# "c10d::allreduce_", "nccl:all_gather", ...).
_COLLECTIVE_WORDS = {
    "allreduce": "all-reduce",
    "allgather": "all-gather",
    "reducescatter": "reduce-scatter",
    "alltoall": "all-to-all",
}
_COMM_PREFIXES = ("gloo:", "c10d::", "nccl:", "record_param_comms")


def op_color_key(op: OpEvent, phases: Sequence[Span] = ()) -> str:
    """The entry of SPAN_COLORS a torch operator is drawn in: its collective for
    communication (gloo's, c10d's, NCCL's), else the phase of the innermost course span
    among `phases` (forward, backward, optimizer) that contains it, else compute."""
    name = op.name.lower()
    if name.startswith(_COMM_PREFIXES):
        words = name.replace("_", "")
        return next((c for w, c in _COLLECTIVE_WORDS.items() if w in words), "comm")
    inside = [s for s in phases if s.start_ns <= op.start_ns and op.end_ns <= s.end_ns]
    return span_color_key(max(inside, key=lambda s: s.depth)) if inside else "compute"


def _window_bars(
    ax: Axes, y: float, bars: Sequence[tuple[float, float]], key: str, depth: int, edge: float
) -> None:
    """The bars ((left, width) each) of one row of `operator_timeline`, one colour and
    depth, as one collection (a step has thousands of operators): waiting as an outline,
    hatched; work filled, its edge `edge` points of white (none for torch's many short
    operators)."""
    height = 0.8 * 0.75**depth
    style: dict[str, Any] = (
        {"facecolor": "none", "hatch": "////", "edgecolor": SPAN_COLORS["idle"], "linewidth": 0.5}
        if key == "idle"
        else {"facecolor": SPAN_COLORS[key], "edgecolor": "white", "linewidth": edge}
    )
    ax.broken_barh(bars, (y - height / 2, height), zorder=2 + depth, **style)


def _op_rows(profile: RankProfile, lo: int, hi: int) -> dict[int, list[tuple[OpEvent, int]]]:
    """The rank's operators that overlap [lo, hi], by thread (the rank's main thread
    first), each with its depth: how many of its thread's operators enclose it."""
    rows: dict[int, list[tuple[OpEvent, int]]] = {profile.main_thread: []}
    ends: dict[int, list[int]] = {}
    for op in profile.ops:  # in start order, the enclosing one first
        stack = ends.setdefault(op.thread, [])
        while stack and stack[-1] <= op.start_ns:
            stack.pop()
        if op.end_ns > lo and op.start_ns < hi:
            rows.setdefault(op.thread, []).append((op, len(stack)))
        stack.append(op.end_ns)
    return {t: ops for t, ops in rows.items() if ops or t == profile.main_thread}


def operator_timeline(
    trace: Trace,
    profile: RankProfile,
    ax: Axes | None = None,
    *,
    window: tuple[int, int] | None = None,
    title: str | None = None,
    max_depth: int = 3,
    unit: str = "ms",
) -> Figure | SubFigure:
    """One rank between `window`'s two times (ns on the course's clock; default all its
    spans): the course's spans above (compute with waiting hatched, then communication),
    torch.profiler's operators below, a row per thread that ran one (the main thread
    first; gloo's workers run the collectives), nested operators thinner, down to
    `max_depth`. The same clock for both (`parcourse.profiler`), so an operator sits under
    the span it ran in. Operators are coloured by their collective, else by the course's
    phase around them (`op_color_key`)."""
    scale = {"s": 1e9, "ms": 1e6, "us": 1e3}[unit]
    spans = [s for s in trace.spans if s.rank == profile.rank]
    if window is None:
        times = [t for s in spans for t in (s.start_ns, s.end_ns)] or [0, 1]
        window = (min(times), max(times))
    lo, hi = window
    if not hi > lo:
        raise ValueError(f"window must end after it starts, got {window}")
    rows = _op_rows(profile, lo, hi)
    fig, ax = _axes(ax, (11, 1.2 + 0.55 * (2 + len(rows))))
    used: set[str] = set()
    bars: list[tuple[float, float, float, float, str | None]] = []

    groups: dict[tuple[float, str, int], list[tuple[float, float]]] = {}

    def bar(y: float, start: int, end: int, key: str, depth: int, text: str) -> None:
        left, right = (max(start, lo) - lo) / scale, (min(end, hi) - lo) / scale
        if right <= left:
            return
        groups.setdefault((y, key, depth), []).append((left, right - left))
        used.add(key)
        bars.append((y, left, right, 0.8 * 0.75**depth, None if key == "idle" else text))

    phases = [s for s in spans if s.kind == "compute"]
    for s in sorted(spans, key=lambda s: s.depth):
        comm = s.kind == "comm"  # row 1; compute and waiting in row 0
        bar(int(comm), s.start_ns, s.end_ns, span_color_key(s), 0 if comm else s.depth, s.name)
    for row, ops in enumerate(rows.values(), start=2):
        for op, depth in ops:
            if depth <= max_depth:
                key, short = op_color_key(op, phases), op.name.split("::")[-1]
                bar(row, op.start_ns, op.end_ns, key, depth, short)
    for (at, key, depth), drawn in groups.items():
        _window_bars(ax, at, drawn, key, depth, 0.5 if at < 2 else 0.0)
    labels = BarLabels()  # each where its own bar shows, not under the ones nested in it
    room = 0.02 * (hi - lo) / scale  # a bar narrower has no room for a word
    wide = [(at, a, b, h, text if b - a > room else None) for at, a, b, h, text in bars]
    for at, left, width, height, text in _visible_parts(wide):
        labels.add(left, width, at, height, text)
    ax.add_artist(labels)
    names = [
        "main thread" if t == profile.main_thread else profile.threads.get(t, f"thread {t}")
        for t in rows
    ]
    ticks = ["course: compute", "course: comm", *(f"torch: {n}" for n in names)]
    ax.set_yticks(range(len(ticks)), ticks)
    ax.set_ylim(len(ticks) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) / scale)
    ax.set_xlabel(f"time ({unit}) from {(lo - trace.t0_ns) / scale:.3g} {unit} into the run")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(facecolor="none", edgecolor=c, hatch="////", label="idle (waiting)")
        if k == "idle"
        else Patch(color=c, label=k)
        for k, c in SPAN_COLORS.items()
        if k in used
    ]
    ax.legend(handles=handles, frameon=False, **LEGEND_OUTSIDE)
    default = f"rank {profile.rank}: the course's spans above, torch's operators below"
    ax.set_title(title or default, loc="left")
    return fig
