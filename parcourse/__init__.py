"""parcourse: distributed deep-learning training, built from scratch and measured.

The public API; everything else is importable from its module.
"""

from parcourse.launch import (
    LaunchError,
    Pool,
    RankContext,
    RankDied,
    RankError,
    RankTimeout,
    Run,
    SerializationError,
    close_pools,
    launch,
    limit_pools,
    live_pools,
)
from parcourse.trace import Span, Trace, Tracer

__version__ = "0.1.0"

__all__ = [
    "LaunchError",
    "Pool",
    "RankContext",
    "RankDied",
    "RankError",
    "RankTimeout",
    "Run",
    "SerializationError",
    "Span",
    "Trace",
    "Tracer",
    "close_pools",
    "launch",
    "limit_pools",
    "live_pools",
]
