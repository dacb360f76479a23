"""What the caller and the ranks say to each other over their pipes: small typed
messages, pickled by multiprocessing (so every one is a module-level dataclass).

caller -> rank: `Task` (run this pickled function), `Stop`.
rank -> caller: `Ready` (joined the process group), then for each task one of `Done`,
`Failed` (it raised) or `Unpicklable` (its result cannot be sent back).
"""

from __future__ import annotations

from dataclasses import dataclass

from parcourse.profiler import Profile, RankProfile
from parcourse.trace import TraceData


@dataclass(frozen=True)
class Task:
    """Run `fn(ctx, *args, **kwargs)`, pickled by value (cloudpickle) as `payload`; under
    torch.profiler when `profile` says what to record."""

    payload: bytes
    profile: Profile | None = None


@dataclass(frozen=True)
class Stop:
    """Leave the process group and exit."""


@dataclass(frozen=True)
class Ready:
    """This rank has joined the process group."""

    rank: int


@dataclass(frozen=True)
class Done:
    """The task returned: its value pickled (on the CPU), the rank's trace, its seconds,
    and what torch.profiler recorded (when the task asked for a profile)."""

    rank: int
    result: bytes
    trace: TraceData
    seconds: float
    profile: RankProfile | None = None


@dataclass(frozen=True)
class Failed:
    """The task (or joining the process group) raised. `at_ns` is when, on the host clock
    every local rank shares: the earliest failure is the cause, later ones are usually
    other ranks noticing that a peer has gone."""

    rank: int
    at_ns: int
    exc_type: str
    message: str
    traceback: str
    trace: TraceData

    @property
    def summary(self) -> str:
        return f"{self.exc_type}: {self.message}"


@dataclass(frozen=True)
class Unpicklable:
    """The task returned a value that cannot be pickled."""

    rank: int
    message: str

    @property
    def summary(self) -> str:
        return self.message


Answer = Ready | Done | Failed | Unpicklable
