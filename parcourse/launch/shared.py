"""The pools shared by size that the course's panels and cells reuse: one per world size
(and backend), so that a lesson's cells and panels start their ranks once."""

from __future__ import annotations

from parcourse.launch.plan import Backend
from parcourse.launch.pool import Pool
from parcourse.launch.registry import limit_pools

_SHARED: dict[tuple[int, str], Pool] = {}
_LIMITED = [False]  # shared_pool has set the limit once; a later limit_pools call stands
MAX_LIVE_POOLS = 2  # what shared_pool sets: each rank holds a copy of torch in memory


def shared_pool(world_size: int, backend: Backend = "auto") -> Pool:
    """A Pool shared by every panel (and cell) that asks for the same size.

    Its ranks start at its first run (a panel shows the start). The first call
    caps this process at MAX_LIVE_POOLS pools with live ranks, every pool
    counted, shared or not (`limit_pools`): starting one more closes the least
    recently used, which starts afresh when next run. `live_pools()` lists them,
    `close_pools()` closes all.
    """
    if not _LIMITED[0]:
        limit_pools(MAX_LIVE_POOLS)
        _LIMITED[0] = True
    key = (world_size, backend)
    if key not in _SHARED:
        _SHARED[key] = Pool(world_size, backend=backend, start=False)
    return _SHARED[key]


def close_shared_pools() -> None:
    """Close the shared pools and forget them."""
    while _SHARED:
        _SHARED.popitem()[1].close()
