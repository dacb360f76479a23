"""One device's compute taken in turns by two threads of a rank, each handing it to the
other while it waits for a message: how DualPipe hides one microbatch's all-to-all behind
another's compute.

A GPU runs one microbatch's kernels while its network moves another's tokens; DeepSeek-V3
cuts the forward of one microbatch and the backward of another into chunks and orders
them by hand so that each chunk's communication runs beside the other's compute. Here the
two run as two threads of the rank's process, and `Turns` is the device: a thread computes
only while it holds the turn (`held`), and gives it up while it waits for a message
(`handed_on`), so that the other thread computes meanwhile. Compute never runs twice at
once, as on one device; the messages' time is hidden when the other thread has compute to
run, and exposed when it has none.

On a laptop, ranks share a few cores: `paced(key, seconds)` makes an action's compute last
its simulated seconds, as `pipeline.simulate.SimulatedCompute` does for a whole action,
but piece by piece: the action's seconds are cut evenly at its waits (as many as the last
action of the same key had), and each piece, holding the turn, sleeps out what its real
math left of its share. The device is then busy for those seconds, whichever thread
holds it, and the cores stay free for the other ranks.

What a message needs beside its wait (posting it, a simulated link's stamp, a copy through
host memory) runs without the turn, beside the other thread's compute: small next to it.

`Turns` also keeps the record that says what was hidden: every interval in which a thread
held the turn, and every wait, named by its reason ("all-to-all", "receive"). A wait's
time in which no thread held the turn is exposed (`exposed`).

Two threads' all-to-alls with the same peers at once need their own tags: each thread has a
`lane` (0 outside the pairs, 1 for the forward's thread, 2 for the backward's), the same on
every rank of a group when they run the same schedule, and `comm.all_to_all` tags its
messages by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from parcourse.comm.link import sleep_until

_thread = threading.local()


def lane() -> int:
    """This thread's lane: 0 unless a pair of overlapped actions runs in it (`in_lane`)."""
    return getattr(_thread, "lane", 0)


@contextmanager
def in_lane(number: int) -> Iterator[None]:
    """Run this thread's messages in lane `number` (their tags apart from other lanes')."""
    before = lane()
    _thread.lane = number
    try:
        yield
    finally:
        _thread.lane = before


@dataclass
class Interval:
    """From `start` to `end` (`time.perf_counter()` seconds): the turn held by `label`'s
    thread (what it runs: the runtime gives the action), or a wait of that thread for
    `reason`."""

    label: Hashable
    start: float
    end: float
    reason: str = ""


@dataclass
class _Paced:
    """An action's compute under way, padded to `seconds`: its `key`, the waits the last
    action of that key had (None: not known yet), those reached so far, when its current
    piece began, and the compute of its pieces before it."""

    key: Hashable
    seconds: float
    expected: int | None
    done: int = 0
    piece: float = field(default_factory=time.perf_counter)
    computed: float = 0.0


@dataclass
class Turns:
    """The rank's one device. `with turns.held(label):` computes (blocks until no other
    thread does); inside it, `with turns.handed_on(reason):` around a wait lets the other
    thread compute meanwhile, and takes the turn back after."""

    held_intervals: list[Interval] = field(default_factory=list)
    waits: list[Interval] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._waits_of: dict[Hashable, int] = {}  # how many waits the last action of a key had

    def holding(self) -> bool:
        """Whether this thread holds the turn now."""
        return getattr(_thread, "holds", None) is self

    @contextmanager
    def held(self, label: Hashable) -> Iterator[None]:
        if self.holding():
            raise RuntimeError("this thread holds the turn already")
        self._take(label)
        try:
            yield
        finally:
            self._give()

    @contextmanager
    def handed_on(self, reason: str) -> Iterator[None]:
        """Around a wait: the turn goes to whichever thread wants it, and comes back after
        (a no-op for a thread that does not hold it)."""
        if not self.holding():
            yield
            return
        label, paced = _thread.label, getattr(_thread, "paced", None)
        if paced is not None:  # this piece's share of the action's seconds first
            paced.done += 1
            if paced.expected and paced.done <= paced.expected:
                sleep_until(paced.piece + paced.seconds / (paced.expected + 1))
            paced.computed += time.perf_counter() - paced.piece
        self._give()
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._take(label)
            if paced is not None:
                paced.piece = time.perf_counter()
            self.waits.append(Interval(label, start, end, reason))

    @contextmanager
    def paced(self, key: Hashable, seconds: float) -> Iterator[None]:
        """Inside `held`: the compute in it lasts `seconds` (the module's docstring), its
        waits not counted. `key` names actions alike (a stage and a kind), whose waits
        fall at the same points."""
        if not self.holding():
            raise RuntimeError("paced compute needs the turn: run it inside held()")
        now = _thread.paced = _Paced(key, seconds, self._waits_of.get(key))
        try:
            yield
        finally:
            _thread.paced = None
        self._waits_of[key] = now.done
        computed = now.computed + time.perf_counter() - now.piece
        sleep_until(time.perf_counter() + seconds - computed)

    def _take(self, label: Hashable) -> None:
        self._lock.acquire()
        _thread.holds, _thread.label = self, label
        _thread.since = time.perf_counter()

    def _give(self) -> None:
        self.held_intervals.append(Interval(_thread.label, _thread.since, time.perf_counter()))
        _thread.holds = None
        self._lock.release()

    def clear(self) -> None:
        """Forget the intervals recorded so far (a new step's)."""
        self.held_intervals.clear()
        self.waits.clear()

    def exposed(self, reason: str = "all-to-all") -> float:
        """Seconds of the waits for `reason` in which no thread held the turn: the device
        idle for those messages."""
        return _length(
            uncovered(
                [(w.start, w.end) for w in self.waits if w.reason == reason],
                [(h.start, h.end) for h in self.held_intervals],
            )
        )

    def waited(self, reason: str = "all-to-all") -> float:
        """Seconds of the waits for `reason`, hidden or not (overlapping waits once)."""
        return _length(_union([(w.start, w.end) for w in self.waits if w.reason == reason]))

    def busy(self) -> float:
        """Seconds the turn was held."""
        return sum(h.end - h.start for h in self.held_intervals)


def uncovered(
    waits: list[tuple[float, float]], held: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The parts of the (start, end) `waits` that no (start, end) of `held` covers, in
    order, overlapping waits once: where the device sat idle for them."""
    return _subtract(_union(waits), _union(held))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def _subtract(
    spans: list[tuple[float, float]], minus: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """`spans` less `minus` (both sorted and disjoint, as `_union` returns them)."""
    out, j = [], 0
    for start, end in spans:
        while j < len(minus) and minus[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(minus) and minus[k][0] < end:
            if minus[k][0] > at:
                out.append((at, minus[k][0]))
            at = max(at, minus[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
