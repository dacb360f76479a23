"""Moved to `parcourse.comm`. Kept, as names only, for the modules not yet switched
(zero/, experiments/zero.py, experiments/pipeline.py); delete once they import
`parcourse.comm`."""

from parcourse.comm import (
    SEGMENT_BYTES,
    SimulatedLink,
    chunk_bounds,
    global_rank,
    group_info,
    messenger,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_steps,
    simulated_link,
)

__all__ = [
    "SEGMENT_BYTES",
    "SimulatedLink",
    "chunk_bounds",
    "global_rank",
    "group_info",
    "messenger",
    "naive_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_steps",
    "simulated_link",
]
