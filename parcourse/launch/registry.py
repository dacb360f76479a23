"""Every pool of this process that holds ranks, least recently used first.

Each rank is a process with its own copy of torch (~170 MB), so a notebook that keeps
starting pools of new sizes fills a laptop's memory; `limit_pools(n)` closes the oldest
instead. `live_pools()` lists them, `close_pools()` closes them all.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Protocol

from parcourse.launch.plan import Plan


class Pool(Protocol):
    """What the registry needs of a pool (parcourse.launch.pool.Pool)."""

    plan: Plan
    counts: bool  # against the limit; not the pools launch() makes for one run
    last_used: float

    @property
    def pids(self) -> list[int]: ...

    @property
    def holds_ranks(self) -> bool: ...

    def close(self) -> None: ...


_LIVE: dict[int, weakref.ref[Pool]] = {}
_LIMIT: list[int | None] = [None]


def limit_pools(n: int | None) -> int | None:
    """Keep at most `n` pools with live ranks in this process (None: no limit).

    Starting the ranks of one more pool closes the least recently used others; a
    closed pool starts fresh ranks at its next run (and counts again). Returns the
    previous limit. The course's panels set 2. Pools that `launch` makes for one run
    are closed right after it and close no others.
    """
    if n is not None and n < 1:
        raise ValueError(f"the limit must be >= 1 or None, got {n}")
    previous, _LIMIT[0] = _LIMIT[0], n
    pools = [p for p in live() if p.counts]
    if n is not None:
        for old in pools[: max(0, len(pools) - n)]:
            old.close()
    return previous


def live() -> list[Pool]:
    """The pools that hold ranks, least recently used first."""
    for key in [k for k, ref in _LIVE.items() if ref() is None]:
        del _LIVE[key]  # collected: its finalizer has stopped its ranks
    pools = [ref() for ref in _LIVE.values()]
    return [p for p in pools if p is not None and p.holds_ranks]


def register(pool: Pool) -> None:
    """`pool` has started ranks: it is now the most recently used."""
    _LIVE.pop(id(pool), None)
    _LIVE[id(pool)] = weakref.ref(pool)


def forget(pool: Pool) -> None:
    """`pool`'s ranks are gone."""
    _LIVE.pop(id(pool), None)


def touch(pool: Pool) -> None:
    """`pool` runs again: the most recently used, if it holds ranks."""
    if id(pool) in _LIVE:
        _LIVE[id(pool)] = _LIVE.pop(id(pool))


def make_room(pool: Pool) -> None:
    """Before `pool` starts ranks: close the least recently used others over the limit."""
    limit = _LIMIT[0]
    if limit is None or not pool.counts:
        return
    others = [p for p in live() if p is not pool and p.counts]
    for old in others[: max(0, len(others) - limit + 1)]:
        old.close()


@dataclass(frozen=True)
class PoolInfo:
    """One live pool: its ranks' process ids and the memory they hold."""

    pool: Pool
    pids: list[int]
    memory_bytes: int
    idle_s: float

    def __str__(self) -> str:
        n = len(self.pids)
        return (
            f"{n} rank{'s' * (n > 1)} ({self.pool.plan.backend}), pid{'s' * (n > 1)} "
            f"{', '.join(map(str, self.pids))}: {self.memory_bytes / 2**20:,.0f} MiB, "
            f"idle {self.idle_s:.0f} s"
        )


def live_pools() -> list[PoolInfo]:
    """The pools of this process that hold ranks, least recently used first.

    Memory is each rank's unique set size (what closing it frees; pages shared with
    the forkserver, such as torch's code, are not counted twice).
    """
    import psutil

    infos = []
    for pool in live():
        total = 0
        for pid in pool.pids:
            try:
                total += psutil.Process(pid).memory_full_info().uss
            except (psutil.Error, OSError):
                pass
        infos.append(PoolInfo(pool, pool.pids, total, time.monotonic() - pool.last_used))
    return infos


def close_pools() -> int:
    """Close every live pool of this process; returns how many were closed."""
    pools = live()
    for pool in pools:
        pool.close()
    return len(pools)
