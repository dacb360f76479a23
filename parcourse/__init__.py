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
    launch,
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
    "launch",
]
