"""Zoom into a run's timeline, read each span, and export the run for Perfetto.

A panel's figure is a static image (it must print and render the same in CI,
in exports and in a browser), so reading a narrow span's name is done here: a
time range redraws the timeline within it, and a table lists every span that
overlaps the range (rank, name, start, duration, bytes). "Export for Perfetto"
writes the run as a Chrome trace-event file, which https://ui.perfetto.dev opens
with full zoom and search.
"""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import ipywidgets as W
from parcourse.widgets.outputs import show

from parcourse import plots
from parcourse.trace import Trace

MAX_ROWS = 200  # rows of the span table; the rest are counted


class SpanExplorer:
    """`explorer.show(trace, title)` after each run; `explorer.widget` starts collapsed."""

    def __init__(self, folder: str | Path = "traces") -> None:
        self.folder = Path(folder)
        self.trace: Trace | None = None
        self.title = ""
        self.range = W.FloatRangeSlider(
            value=(0.0, 1.0),
            min=0.0,
            max=1.0,
            step=0.01,
            description="zoom (ms)",
            continuous_update=False,
            readout_format=".2f",
            layout=W.Layout(width="95%"),
        )
        self.rank = W.Dropdown(options=[("all ranks", -1)], value=-1, description="rank")
        self.figure = W.Output()
        self.table = W.HTML()
        self.export = W.Button(
            description="Export for Perfetto", icon="download", layout=W.Layout(width="max-content")
        )
        self.exported = W.HTML()
        self.range.observe(lambda _: self.draw(), names="value")
        self.rank.observe(lambda _: self.draw(), names="value")
        self.export.on_click(lambda _: self.write())
        # No box of its own around the button: a panel is found in a page as a box holding
        # a row with a button (the browser test's selector), and this is not a panel.
        body = W.VBox([self.rank, self.export, self.exported, self.range, self.figure, self.table])
        self.widget = W.Accordion(
            children=[body], titles=("Zoom into the timeline, read each span, export",)
        )
        self.widget.selected_index = None
        self.widget.layout.display = "none"  # until a run with spans
        # Drawn when opened: a panel's run does not pay for a figure nobody looks at.
        self.widget.observe(lambda _: self.draw(), names="selected_index")

    def show(self, trace: Trace, title: str = "") -> None:
        """A new run: the whole step in range, every rank."""
        self.trace, self.title = trace, title
        if not trace.spans:
            self.widget.layout.display = "none"
            return
        self.widget.layout.display = ""
        end = max(s.end_ns for s in trace.spans)
        length = max((end - trace.t0_ns) / 1e6, 0.01)
        with self.range.hold_trait_notifications():
            self.range.max = length
            self.range.min = 0.0
            self.range.step = max(length / 1000, 0.001)
            self.range.value = (0.0, length)
        with self.rank.hold_trait_notifications():
            self.rank.options = [("all ranks", -1)] + [
                (f"rank {r}", r) for r in range(trace.world_size)
            ]
            self.rank.value = -1
        self.exported.value = ""
        self.draw()

    def spans_in_range(self) -> list:
        """Spans overlapping the range (and of the rank chosen), by start time."""
        if self.trace is None:
            return []
        t0 = self.trace.t0_ns
        lo, hi = (t0 + v * 1e6 for v in self.range.value)
        return sorted(
            (
                s
                for s in self.trace.spans
                if s.end_ns >= lo and s.start_ns <= hi and self.rank.value in (-1, s.rank)
            ),
            key=lambda s: (s.start_ns, s.rank),
        )

    def draw(self) -> None:
        """The zoomed timeline and the table, while the explorer is open."""
        if self.trace is None or not self.trace.spans:
            return
        if self.widget.selected_index is None:
            show(self.figure)
            self.table.value = ""
            return
        lo, hi = self.range.value
        fig = plots.timeline(self.trace, title=f"{self.title} ({lo:.2f}-{hi:.2f} ms)".strip())
        fig.axes[0].set_xlim(lo, hi)
        show(self.figure, fig)
        t0 = self.trace.t0_ns
        spans = self.spans_in_range()
        rows = "".join(
            f"<tr><td>{s.rank}</td><td>{html.escape(s.name)}</td><td>{s.kind}</td>"
            f"<td style='text-align:right'>{(s.start_ns - t0) / 1e6:.3f}</td>"
            f"<td style='text-align:right'>{(s.end_ns - s.start_ns) / 1e6:.3f}</td>"
            f"<td style='text-align:right'>{_bytes(s.meta.get('bytes'))}</td></tr>"
            for s in spans[:MAX_ROWS]
        )
        more = (
            f"<p>and {len(spans) - MAX_ROWS} more: narrow the range or pick a rank</p>"
            if len(spans) > MAX_ROWS
            else ""
        )
        self.table.value = (
            "<table style='font-family:monospace; font-size:12px'>"
            "<tr><th>rank</th><th>span</th><th>kind</th><th>start (ms)</th>"
            f"<th>duration (ms)</th><th>bytes</th></tr>{rows}</table>{more}"
        )

    def write(self) -> Path | None:
        """The run as a Chrome trace-event file under `folder`; a link and what to do."""
        if self.trace is None:
            return None
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.title).strip("-").lower() or "run"
        path = self.folder / f"{slug[:60]}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.trace.to_chrome(path)
        self.exported.value = (
            f"wrote <a href='{html.escape(path.as_posix())}' download>"
            f"{html.escape(path.as_posix())}</a> ({len(self.trace.spans)} spans): open "
            "<a href='https://ui.perfetto.dev' target='_blank'>ui.perfetto.dev</a> and drop "
            "the file on it"
        )
        return path


def _bytes(value: object) -> str:
    return f"{int(value):,}" if isinstance(value, (int, float)) else ""
