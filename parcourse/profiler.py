"""torch.profiler on the ranks, beside the course's own spans, on the course's clock.

    run = launch(fn, 2, profile=True)        # or Profile(within="step"), Pool.run(...) alike
    print(run.profiles[0].table)             # torch's key_averages, by self CPU time
    run.to_chrome("run.json")                # one file: spans and operators of every rank

`launch` and `Pool.run` take `profile=`: True for `Profile()`, or a `Profile` saying what
to record. Each rank then runs its function under `torch.profiler.profile` (CPU activity,
input shapes, memory; CUDA activity too where the rank has a GPU) and sends back a
`RankProfile`: plain data, pickled, that holds torch's own Chrome export of the rank, the
events read from it (`OpEvent`, `MemoryEvent`) and torch's `key_averages()` (`OpAverage`
rows and its table).

The clocks. The course times its spans with `time.perf_counter_ns()`, CLOCK_MONOTONIC on
Linux. torch.profiler stamps events with the CPU's time-stamp counter and converts the
stamps to nanoseconds since the Unix epoch, CLOCK_REALTIME, when the profile ends
(`c10::getApproximateTime` and `ApproximateClockToUnixTimeConverter`,
c10/util/ApproximateClock.h); its Chrome export writes them as microseconds after
`baseTimeNanoseconds`. The two clocks differ by a constant (NTP slews both alike; only a
step of the wall clock, such as setting the date, changes it), which each rank measures
while its profile runs: `time.time_ns()` read between two `perf_counter_ns()` reads, the
tightest of 64 tries, at the start and at the end (`RankProfile.clock_offset_ns`,
`clock_spread_ns`). An event's time on the course's clock is then
`base + ts * 1000 - offset`: on this machine an `aten::mm` starts some microseconds after
the `perf_counter_ns()` read before it and ends before the read after it, every time.

Threads: torch.profiler records the thread that started it and the threads that carry its
state (gloo's and NCCL's workers: a bucket's `gloo:all_reduce` runs there); a Python
thread of its own (the course's ring, `algorithm="ring"`) is not recorded.

What torch prints. Each start and stop of a profile prints a line of libkineto's
("USDT: ... profiler_start"), and a tensor allocated before a memory profile began and
freed inside it prints c10's "Memory block of unknown size was allocated before the
profiling started" once a process: both on the process's own stderr, past Python, so that
in a notebook eight ranks print sixteen lines a cell. While a profile runs, `quiet_torch`
holds stderr back and prints it again afterwards without those two kinds of line (the
frees they speak of are counted: `allocator.Trace.unseen_frees`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from parcourse.trace import Span, Trace

__all__ = [
    "MemoryEvent",
    "OpAverage",
    "OpEvent",
    "Profile",
    "RankProfile",
    "Recorder",
    "check_profile",
    "chrome_events",
    "quiet_torch",
]

# What torch prints at every profile, not about the run (see the module's docstring).
TORCH_NOISE = re.compile(
    r"^(USDT:.*profiler_(start|stop)"
    r"|.*Memory block of unknown size was allocated before the profiling started.*)$"
)


@contextmanager
def quiet_torch() -> Iterator[None]:
    """The process's stderr (its file descriptor: C++ writes there too) held in a file
    while the block runs, then written back without the lines `TORCH_NOISE` matches."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not TORCH_NOISE.match(line.rstrip("\n"))
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@dataclass(frozen=True)
class Profile:
    """What torch.profiler records on each rank.

    `shapes`: the input shapes of each operator (`record_shapes`). `memory`: every
    allocation and free (`profile_memory`). `cuda`: the GPU's kernels and copies where the
    rank has a CUDA device (none on CPU). `within`: the name of a course span (e.g.
    "step"): the operator table counts only the operators that ran inside this rank's
    spans of that name (the timeline keeps everything); None counts the whole function.
    `top`: the rows of the table's text (the rows themselves are all kept).
    """

    shapes: bool = True
    memory: bool = True
    cuda: bool = True
    within: str | None = None
    top: int = 20

    def __post_init__(self) -> None:
        for name in ("shapes", "memory", "cuda"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"Profile.{name} must be True or False, got {value!r}")
        if self.within is not None and (not isinstance(self.within, str) or not self.within):
            raise ValueError(f"Profile.within must be a span's name or None, got {self.within!r}")
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise ValueError(f"Profile.top must be an int >= 1, got {self.top!r}")


def check_profile(profile: object) -> Profile | None:
    """`launch`'s and `Pool.run`'s `profile=` as options: True is `Profile()`, False none;
    anything else is refused before any rank runs."""
    if profile is True:
        return Profile()
    if profile is False:
        return None
    if isinstance(profile, Profile):
        return profile
    raise ValueError(f"profile must be True, False or a Profile(...), got {profile!r}")


@dataclass(frozen=True)
class OpEvent:
    """One operator (or a `record_function` region, or a GPU kernel) torch.profiler timed on
    one rank: `start_ns` on the course's clock (`time.perf_counter_ns()`), `thread` the
    OS thread id (a CUDA stream for GPU work), `category` torch's ("cpu_op",
    "user_annotation", "kernel", ...), `shapes` its inputs' (with `Profile.shapes`)."""

    name: str
    category: str
    thread: int
    start_ns: int
    duration_ns: int
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation (`bytes` > 0) or free (< 0) at `address` on `device`, at `t_ns` on the
    course's clock; `total_allocated`: the bytes the profiler counted live after it."""

    t_ns: int
    bytes: int
    total_allocated: int
    address: int
    device: str
    thread: int


@dataclass(frozen=True)
class OpAverage:
    """One row of torch's `key_averages()`: an operator's calls and times (microseconds)
    and memory (bytes), summed over its calls. Self excludes the operators it called."""

    name: str
    calls: int
    self_cpu_us: float
    cpu_total_us: float
    self_cpu_memory: int
    cpu_memory: int
    self_device_us: float = 0.0
    device_total_us: float = 0.0


@dataclass
class RankProfile:
    """What torch.profiler recorded on one rank, as plain data.

    `chrome`: the events of torch's own `export_chrome_trace`, as torch wrote them (its
    clock: `chrome_base_ns + ts * 1000` is CLOCK_REALTIME); `ops` and `memory`: the same
    events read into dataclasses, on the course's clock. `averages`: `key_averages()`,
    by self CPU time, most first; `table`: torch's text of it. `threads`: each thread's
    name in torch's export; `main_thread`: the one that ran the rank's function.
    """

    rank: int
    ops: list[OpEvent]
    memory: list[MemoryEvent]
    averages: list[OpAverage]
    table: str
    threads: dict[int, str]
    main_thread: int
    process: int
    clock_offset_ns: int
    clock_spread_ns: int
    chrome: list[dict[str, Any]] = field(repr=False, default_factory=list)
    chrome_base_ns: int = 0

    def course_ns(self, ts_us: float) -> int:
        """A timestamp of torch's export (microseconds after its base) on the course's clock."""
        return round(ts_us * 1000) + self.chrome_base_ns - self.clock_offset_ns

    def ops_named(self, name: str) -> list[OpEvent]:
        return [e for e in self.ops if e.name == name]


def clock_offset(tries: int = 64) -> tuple[int, int]:
    """CLOCK_REALTIME - CLOCK_MONOTONIC now, in ns, and the width of the tightest bracket
    it was read in (its uncertainty): `time.time_ns()` between two `perf_counter_ns()`."""
    best = (1 << 62, 0)
    for _ in range(tries):
        before = time.perf_counter_ns()
        real = time.time_ns()
        after = time.perf_counter_ns()
        if after - before < best[0]:
            best = (after - before, real - (before + after) // 2)
    return best[1], best[0]


class Recorder:
    """A rank's function under torch.profiler: `with recorder:` around it, then
    `recorder.result(spans)`, the spans its tracer recorded (for `Profile.within`)."""

    def __init__(self, options: Profile, rank: int, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if options.cuda and device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.options, self.rank = options, rank
        self.prof = profile(
            activities=activities, record_shapes=options.shapes, profile_memory=options.memory
        )
        self._offsets: list[tuple[int, int]] = []

    def __enter__(self) -> Recorder:
        self._quiet = quiet_torch()
        self._quiet.__enter__()
        self.prof.__enter__()
        self._offsets.append(clock_offset())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._offsets.append(clock_offset())
        try:
            self.prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def result(self, spans: Sequence[Span]) -> RankProfile:
        """The profile as plain data; torch's export goes through a temporary file."""
        (start, width0), (end, width1) = self._offsets
        offset = (start + end) // 2
        spread = abs(end - start) + max(width0, width1)
        handle, name = tempfile.mkstemp(prefix=f"parcourse-rank{self.rank}-", suffix=".json")
        os.close(handle)
        try:
            self.prof.export_chrome_trace(name)
            exported = json.loads(Path(name).read_text())
        finally:
            os.remove(name)
        averages, table = self._averages(spans, offset)
        profile = RankProfile(
            self.rank,
            [],
            [],
            averages,
            table,
            {},
            threading.get_native_id(),
            os.getpid(),
            offset,
            spread,
            exported["traceEvents"],
            int(exported.get("baseTimeNanoseconds", 0)),
        )
        read_events(profile)
        return profile

    def _averages(self, spans: Sequence[Span], offset: int) -> tuple[list[OpAverage], str]:
        """torch's key_averages over the whole function, or over the operators inside the
        course's spans named `Profile.within`, and its table by self CPU time."""
        from torch.autograd.profiler_util import EventList

        events = self.prof.events()
        within = self.options.within
        if within is not None:
            windows = [(s.start_ns, s.end_ns) for s in spans if s.name == within]
            if not windows:
                raise ValueError(f"Profile(within={within!r}): rank {self.rank} has no such span")
            # FunctionEvent times: microseconds after the profile's start, CLOCK_REALTIME.
            profiler = self.prof.profiler
            assert profiler is not None and profiler.kineto_results is not None  # it has run
            zero = profiler.kineto_results.trace_start_ns() - offset
            kept = [
                e
                for e in events
                if any(
                    a <= zero + e.time_range.start * 1000 and zero + e.time_range.end * 1000 <= b
                    for a, b in windows
                )
            ]
            events = EventList(
                kept, use_device=events._use_device, profile_memory=self.options.memory
            )
            # Each event's parent and children were linked when prof.events() built its
            # tree; building it again here would add every child a second time.
            events._tree_built = True
        averaged = events.key_averages()
        rows = sorted((_row(a) for a in averaged), key=lambda r: -r.self_cpu_us)
        return rows, averaged.table(sort_by="self_cpu_time_total", row_limit=self.options.top)


def _row(a: Any) -> OpAverage:
    return OpAverage(
        a.key,
        a.count,
        a.self_cpu_time_total,
        a.cpu_time_total,
        a.self_cpu_memory_usage,
        a.cpu_memory_usage,
        getattr(a, "self_device_time_total", 0.0),
        getattr(a, "device_time_total", 0.0),
    )


DEVICE_TYPES = {0: "cpu", 1: "cuda"}  # c10::DeviceType's numbers in a memory event


def read_events(profile: RankProfile) -> None:
    """Fill `profile`'s ops, memory and threads from its Chrome events (torch's export)."""
    names: dict[int, list[str]] = {}
    for e in profile.chrome:
        ph, args = e.get("ph"), e.get("args") or {}
        if not isinstance(e.get("pid"), int):
            continue  # the profiler's own bookkeeping (its window), not the rank's work
        if ph == "M" and e.get("name") == "thread_name":
            names.setdefault(e["tid"], []).append(args.get("name", str(e["tid"])))
        elif ph == "X" and isinstance(e.get("tid"), int):
            dims = args.get("Input Dims") or ()
            shapes = tuple(tuple(d) if isinstance(d, list) else () for d in dims)
            start = profile.course_ns(e["ts"])
            end = profile.course_ns(e["ts"] + e.get("dur", 0.0))
            op = OpEvent(e["name"], str(e.get("cat", "")), e["tid"], start, end - start, shapes)
            profile.ops.append(op)
        elif ph == "i" and e.get("name") == "[memory]":
            kind = DEVICE_TYPES.get(args.get("Device Type", 0), "device")
            device = kind if kind == "cpu" else f"{kind}:{args.get('Device Id')}"
            profile.memory.append(
                MemoryEvent(
                    profile.course_ns(e["ts"]),
                    int(args.get("Bytes", 0)),
                    int(args.get("Total Allocated", 0)),
                    int(args.get("Addr", 0)),
                    device,
                    int(e.get("tid", 0)),
                )
            )
    profile.ops.sort(key=lambda o: (o.start_ns, -o.duration_ns))
    profile.memory.sort(key=lambda m: m.t_ns)
    main = names.get(profile.process, [""])[0]
    generic = "(" + main.rsplit("(", 1)[-1] if "(" in main else None
    for tid, given in names.items():
        # torch names a worker thread by its own name ("thread 7 (pt_gloo_runloop)") and
        # also by the process's ("thread 7 (python)"): the worker's own is kept.
        own = [n for n in given if generic is None or not n.endswith(generic)]
        profile.threads[tid] = (own if own and tid != profile.process else given)[0]


# The course's spans of a profiled rank: one track per kind, above torch's threads.
COURSE_TRACKS = {"compute": 1, "comm": 2, "idle": 3, "other": 4}


def chrome_events(trace: Trace, profiles: Sequence[RankProfile]) -> list[dict[str, Any]]:
    """The trace-event list of one Perfetto file: a process per rank ("rank r"), the
    course's spans on tracks of their own ("course: compute", "course: comm", ...), torch's
    threads beside them with torch's events, every timestamp on the course's clock counted
    from the earliest event of either. A rank's GPU (torch's rows for a device) is a
    process of its own ("rank r: GPU ...")."""
    by_rank = {p.rank: p for p in profiles}
    starts = [trace.t0_ns] if trace.spans or trace.counters or trace.memory else []
    starts += [
        p.course_ns(e["ts"])
        for p in profiles
        for e in p.chrome
        if e.get("ph") != "M" and isinstance(e.get("pid"), int) and "ts" in e
    ]
    t0 = min(starts, default=0)
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    events = _course_events(trace, us)
    spare = [trace.world_size]  # the next free process id, for a GPU's rows
    for rank in range(trace.world_size):
        if rank in by_rank:
            events += _torch_events(by_rank[rank], us, spare)
    return events


def _course_events(trace: Trace, us: Any) -> list[dict[str, Any]]:
    from parcourse.trace import _jsonable

    events: list[dict[str, Any]] = []
    for rank in range(trace.world_size):
        events.append(_meta("process_name", rank, 0, name=f"rank {rank}"))
        events.append(_meta("process_sort_index", rank, 0, sort_index=rank))
        for kind, tid in COURSE_TRACKS.items():
            if any(s.rank == rank and s.kind == kind for s in trace.spans):
                events.append(_meta("thread_name", rank, tid, name=f"course: {kind}"))
                events.append(_meta("thread_sort_index", rank, tid, sort_index=tid - 10))
    for s in trace.spans:
        events.append(
            {
                "ph": "X",
                "name": s.name,
                "cat": s.kind,
                "pid": s.rank,
                "tid": COURSE_TRACKS.get(s.kind, COURSE_TRACKS["other"]),
                "ts": us(s.start_ns),
                "dur": (s.end_ns - s.start_ns) / 1e3,
                "args": _jsonable(s.meta),
            }
        )
    running: dict[tuple[int, str], float] = {}
    for c in trace.counters:
        running[c.rank, c.name] = running.get((c.rank, c.name), 0.0) + c.value
        value = {c.name: running[c.rank, c.name]}
        events.append({"ph": "C", "name": c.name, "pid": c.rank, "ts": us(c.t_ns), "args": value})
    for m in trace.memory:
        sample = {"ph": "C", "name": "memory", "pid": m.rank, "ts": us(m.t_ns)}
        events.append({**sample, "args": dict(m.bytes)})
    return events


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _torch_events(profile: RankProfile, us: Any, spare: list[int]) -> list[dict[str, Any]]:
    """torch's events of one rank, moved onto the course's clock and into the rank's
    process (its GPU into one of its own); flow ids made distinct between ranks."""
    pids: dict[int, int] = {profile.process: profile.rank}
    named: set[tuple[int, Any]] = set()
    out: list[dict[str, Any]] = []
    for e in profile.chrome:
        pid = e.get("pid")
        if not isinstance(pid, int):
            continue  # the profiler's own bookkeeping (its window), not the rank's work
        if pid not in pids:
            pids[pid] = spare[0]
            spare[0] += 1
        e = {**e, "pid": pids[pid]}
        if e.get("ph") == "M":
            e.pop("ts", None)  # metadata has no time
            if not _rename(e, profile.rank, pid, named):
                continue
        elif "ts" in e:
            e["ts"] = us(profile.course_ns(e["ts"]))
        if e.get("ph") in ("s", "f", "t") and isinstance(e.get("id"), int):
            e["id"] = e["id"] + (profile.rank << 40)
        out.append(e)
    return out


def _rename(e: dict[str, Any], rank: int, pid: int, named: set[tuple[int, Any]]) -> bool:
    """Name one of torch's metadata events for the merged file; False to leave it out: the
    rank's own process is named by the course's events, and torch names some threads
    twice (a gloo worker also as "python"), the first name kept."""
    kind = e.get("name")
    if kind in ("process_name", "process_sort_index") and e["pid"] == rank:
        return False
    if kind == "process_name":
        e["args"] = {"name": f"rank {rank}: {e['args'].get('name', pid)}"}
    elif kind == "process_sort_index":
        e["args"] = {"sort_index": e["pid"]}
    elif kind == "thread_name":
        if (e["pid"], e.get("tid")) in named:
            return False
        named.add((e["pid"], e.get("tid")))
        e["args"] = {"name": f"torch: {e['args'].get('name', e.get('tid'))}"}
    return True
