"""Memory over a replayed step: allocated bytes filled, reserved outlined, a device's
capacity as the line an out-of-memory error starts at (matplotlib, in parcourse.plots'
manner: a Figure back, an optional Axes in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parcourse.allocator.replay import Replay

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

ALLOCATED_COLOR = "#4C72B0"
RESERVED_COLOR = "#C44E52"
EXPANDABLE_COLOR = "#55A868"


def memory_over_time(
    replay: Replay,
    ax: Axes | None = None,
    *,
    expandable: Replay | None = None,
    capacity: int | None = None,
    device: str = "device",
    title: str | None = None,
) -> Figure | SubFigure:
    """Bytes after each event of a replay: allocated (filled) and reserved (outlined);
    `expandable`, the same trace's replay with expandable segments, adds its reserved
    bytes dashed; `capacity` draws a horizontal line named `device` at that many bytes
    (where reserved bytes would raise "CUDA out of memory"). A grey line parts the
    trace's setup from its measured steps."""
    import matplotlib.pyplot as plt

    from parcourse.memory import byte_unit
    from parcourse.plots import LEGEND_OUTSIDE

    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
    highest = max([*replay.reserved, *(expandable.reserved if expandable else ()), capacity or 0])
    unit, div = byte_unit(max(highest, 1))
    steps = range(len(replay.allocated))
    allocated = [b / div for b in replay.allocated]
    ax.fill_between(steps, allocated, step="post", color=ALLOCATED_COLOR, alpha=0.6, lw=0)
    # its edge too: a peak a few events wide (the logits and their gradient) is thinner
    # than a pixel filled, and would look lower than it is
    ax.step(steps, allocated, where="post", color=ALLOCATED_COLOR, lw=0.6)
    ax.plot([], [], color=ALLOCATED_COLOR, lw=6, alpha=0.6, label="allocated")
    ax.step(
        steps,
        [b / div for b in replay.reserved],
        where="post",
        color=RESERVED_COLOR,
        label="reserved",
    )
    if expandable is not None:
        ax.step(
            range(len(expandable.reserved)),
            [b / div for b in expandable.reserved],
            where="post",
            color=EXPANDABLE_COLOR,
            ls="--",
            label="reserved, expandable segments",
        )
    if capacity is not None:
        ax.axhline(capacity / div, color="black", lw=1, ls=":", label=f"{device}: out of memory")
    if replay.start:
        ax.axvline(replay.start, color="grey", lw=1, label="setup | steps (cache emptied)")
    ax.set_xlabel("allocator event")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, max(1, len(replay.allocated) - 1))
    if title:
        ax.set_title(title)
    ax.legend(**LEGEND_OUTSIDE)
    return ax.figure
