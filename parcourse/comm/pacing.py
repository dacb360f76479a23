"""Simulated compute beside real collectives: an action padded to its simulated seconds,
its blocking collectives on top.

A rank that stands for a GPU on a laptop core runs its real math, then waits out the
rest of the seconds the simulator gives that action (`pipeline.simulate.SimulatedCompute`),
so that ranks sharing a few cores behave as separate devices would. Tensor parallelism's
collectives inside the action are not compute: the seconds this rank spends blocked in
them (`Comm.blocked_s`) come on top of the padding, as on a GPU that waits for them.

Padding only at the end would let a rank whose real math ran late on shared cores keep
the others waiting at each collective, and that wait would count as the collective's.
So `Pacer.pace` (which `Comm` calls before each blocking collective, through
`before_blocking`) waits until that collective's share of the action has passed: the
action's seconds cut evenly at its collectives, as many as the last action of the same
key had (none the first time). A group's ranks, each as fast as its simulated device,
then meet at each collective together.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from parcourse.comm.communicator import Comm


@dataclass
class _Padded:
    """An action under way: when it started, `blocked_s` then, its key, and how many
    collectives it has reached."""

    start: float
    blocked: float
    seconds: float
    key: Hashable
    done: int = 0


class Pacer:
    """`Pacer(comm)`: pads actions to simulated seconds, `comm`'s blocking collectives
    on top (None: no collectives inside the actions). It sets `comm.before_blocking`
    to its `pace`.

    `with pacer.padded(key, seconds):` runs an action; on leaving, the rank sleeps out
    what is left of `seconds` after its own math (the collectives' blocked seconds not
    counted). `key` names actions alike (a stage and a kind: F, B, I, W), whose
    collectives fall at the same points."""

    def __init__(self, comm: Comm | None = None) -> None:
        self.comm = comm
        self._now: _Padded | None = None
        self._collectives: dict[Hashable, int] = {}  # how many the last action of a key had
        if comm is not None:
            comm.before_blocking = self.pace

    def _blocked(self) -> float:
        return self.comm.blocked_s if self.comm is not None else 0.0

    @contextmanager
    def padded(self, key: Hashable, seconds: float) -> Iterator[None]:
        now = self._now = _Padded(time.perf_counter(), self._blocked(), seconds, key)
        try:
            yield
        finally:
            self._now = None
        self._collectives[key] = now.done
        rest = now.start + seconds + (self._blocked() - now.blocked) - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def pace(self) -> None:
        """Before a collective of the action under way: wait for its share of the
        action's seconds (see the module's docstring). A no-op outside `padded`."""
        now = self._now
        if now is None:
            return
        now.done += 1
        expected = self._collectives.get(now.key)
        if not expected or now.done > expected:
            return
        share = now.seconds * now.done / (expected + 1)
        rest = now.start + share + (self._blocked() - now.blocked) - time.perf_counter()
        if rest > 0:
            time.sleep(rest)
