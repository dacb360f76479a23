"""What a panel shows under its controls, set as the Output widget's `outputs`.

`show(output, fig, "text", HTML(...))` replaces what `output` shows. It sets the widget's
`outputs` trait (one comm message from the kernel with the new state) instead of capturing
the cell's display messages with `with output:` and `output.clear_output()`.

Why not capture: a headless client (nbclient, which papermill and nbval run on) stands
in for the browser's Output widget, and for every output the kernel routes into one
while a cell runs, it sends the widget's new state back to the kernel on its shell
socket. That send races with the cell's execute_reply arriving on the same socket: the
socket's file descriptor signals readiness on an edge, a send can consume the edge of a
message that has just arrived, and the client then waits for a reply it already holds
until its cell timeout (measured: the kernel's reply stamped 1.1 s into a panel cell,
nbclient taking it in 298.9 s later, at its 300 s timeout;
`python benchmarks/panel_stall.py`). Set directly, the outputs never pass through that
emulation, and the client never sends during a cell.

Upstream: jupyter/nbclient#312 (a cell with an ipywidget that sometimes blocks until its
timeout, with nbclient's Output-widget emulation in the picture) and, for the same edge
swallowed by a send on a socket being polled, on the kernel's side, ipython/ipykernel#1554
(fixed for replies by ipykernel#1529, which the pinned ipykernel has).
"""

from __future__ import annotations

import base64
import io
from typing import Any

import ipywidgets as W
import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def _figure(fig: Figure) -> dict[str, Any]:
    """A figure as the inline backend shows it: a PNG of its tight bounding box."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight", dpi=fig.dpi)
    plt.close(fig)
    width, height = fig.get_size_inches() * fig.dpi
    return {
        "output_type": "display_data",
        "data": {
            "image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
            "text/plain": f"<Figure size {width:.0f}x{height:.0f} with {len(fig.axes)} Axes>",
        },
        "metadata": {},
    }


def output_of(item: Any) -> dict[str, Any]:
    """One output (nbformat's dict) for a figure, an object with `_repr_html_` (e.g.
    IPython's HTML) or anything else, printed."""
    if isinstance(item, Figure):
        return _figure(item)
    if hasattr(item, "_repr_html_"):
        return {
            "output_type": "display_data",
            "data": {"text/html": item._repr_html_(), "text/plain": repr(item)},
            "metadata": {},
        }
    text = str(item)
    return {
        "output_type": "stream",
        "name": "stdout",
        "text": text if text.endswith("\n") else text + "\n",
    }


def show(output: W.Output, *items: Any) -> None:
    """Replace what `output` shows with `items` (none: clear it)."""
    output.outputs = tuple(output_of(item) for item in items if item is not None)
