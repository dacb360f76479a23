"""What a waiting caller sees: one line that says what every rank is doing, and, in a
notebook, that line kept up to date under the running cell."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from parcourse.launch.errors import group_ranks


class Pool(Protocol):
    """What a progress line needs of a pool: whether its ranks are still starting."""

    starting: bool


# on_progress(statuses, elapsed_s): each rank's status ("ready" or "done" once it has
# answered), about ten times a second while a pool starts its ranks or runs.
Progress = Callable[[list[str], float], None]


def describe_progress(pool: Pool, statuses: list[str]) -> str:
    """One line for a waiting caller: "starting 4 ranks: ranks 0, 1: joining the process
    group; ..." while ranks start, then "1 of 4 ranks done; ranks 0, 2: in 'forward'"."""
    n = len(statuses)
    if pool.starting:
        ready = statuses.count("ready")
        busy = {r: s for r, s in enumerate(statuses) if s != "ready"}
        return (
            f"starting {n} rank{'s' * (n > 1)} ({ready} ready; each imports torch and "
            f"joins the process group): " + "; ".join(group_ranks(busy))
        )
    done = statuses.count("done")
    busy = {r: s for r, s in enumerate(statuses) if s != "done"}
    return f"{done} of {n} ranks done; " + "; ".join(group_ranks(busy))


class LiveStatus:
    """A status line under the notebook cell that runs a pool, shown once a run has taken
    more than DELAY_S seconds, updated twice a second, removed when it ends.

    It is first shown empty and then updated (a display id): Jupyter shows the updates,
    and nbval, which ignores updates, sees one output with nothing in it to compare.
    """

    DELAY_S = 3.0

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.t0 = time.perf_counter()
        self.next = self.t0 + self.DELAY_S
        self.handle: Any = None

    @classmethod
    def in_notebook(cls, pool: Pool) -> LiveStatus | None:
        ipython = sys.modules.get("IPython")  # never imported here: only if already loaded
        shell = ipython.get_ipython() if ipython is not None else None
        return cls(pool) if getattr(shell, "kernel", None) is not None else None

    def __call__(self, statuses: list[str], _elapsed: float) -> None:
        now = time.perf_counter()
        if now < self.next:
            return
        self.next = now + 0.5
        from IPython.display import display

        text = f"{now - self.t0:.0f} s: " + describe_progress(self.pool, statuses)
        if self.handle is None:
            self.handle = display({}, raw=True, display_id=True)
        self.handle.update({"text/plain": text}, raw=True)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update({}, raw=True)
