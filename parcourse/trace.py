"""Per-rank tracing: spans, counters and memory samples on one host clock.

Every rank gets a `Tracer` (as `ctx.tracer`). Spans are timed with
`time.perf_counter_ns()`, which on Linux reads CLOCK_MONOTONIC: one clock for
every process on the machine, so spans from different ranks line up without
any clock synchronisation. (Across nodes under torchrun they do not; a trace
from several nodes is only aligned per node.)

The launcher merges the tracers of all ranks into one `Trace`, which the plots
draw and `Trace.to_chrome` exports for Perfetto (https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from parcourse.memory import SavedActivations
    from parcourse.profiler import RankProfile

SpanKind = Literal["compute", "comm", "idle", "other"]
SPAN_KINDS: tuple[str, ...] = ("compute", "comm", "idle", "other")


@dataclass(frozen=True)
class Span:
    """One timed interval on one rank. `depth` is how many spans enclose it."""

    rank: int
    name: str
    kind: str
    start_ns: int
    end_ns: int
    depth: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True)
class CounterEvent:
    """`value` added to counter `name` on `rank` at time `t_ns` (e.g. bytes sent)."""

    rank: int
    name: str
    t_ns: int
    value: float
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemorySample:
    """Live bytes by category on one rank at a named point.

    `bytes` maps a category (params, grads, optimizer, activations, other) to
    bytes counted from live tensor storages; `cuda` holds
    torch.cuda.memory_allocated / max_memory_allocated when the rank uses a GPU.
    """

    rank: int
    label: str
    t_ns: int
    bytes: dict[str, int]
    cuda: dict[str, int] | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class TraceData:
    """What one rank's tracer recorded; plain data, cheap to pickle."""

    rank: int
    spans: list[Span] = field(default_factory=list)
    counters: list[CounterEvent] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)


class Tracer:
    """Records spans, counters and memory samples for one rank.

    >>> with ctx.tracer.span("forward", kind="compute", microbatch=3):
    ...     y = model(x)

    For asynchronous communication, time from launch to the end of `wait()`:

    >>> start = ctx.tracer.now()
    >>> work = dist.all_reduce(t, async_op=True)
    >>> ...  # overlapped compute
    >>> work.wait()
    >>> ctx.tracer.add_span("all_reduce", start, ctx.tracer.now(), kind="comm", bucket=0)

    `status`, when given, is a shared byte buffer that the launcher reads to say
    which span a hung rank was in.
    """

    def __init__(self, rank: int = 0, status: Any = None, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self._status = status
        self._threads = threading.local()  # each thread's own stack of open spans
        self._data = TraceData(rank)
        self._tags: dict[str, Any] = {}

    def tagged(self, **meta: Any) -> Tracer:
        """A view of this tracer that adds `meta` to every span and counter it records,
        into the same trace: e.g. `tracer.tagged(axis="tp")` for a mesh's tensor-parallel
        communication, so that a step's time and bytes can be read per axis."""
        view = Tracer.__new__(Tracer)
        view.__dict__.update(self.__dict__)  # the same data, stack and status
        view._tags = {**self._tags, **meta}
        return view

    @property
    def _stack(self) -> list[str]:
        """This thread's open spans (a span opened in one thread closes in it)."""
        stack = getattr(self._threads, "stack", None)
        if stack is None:
            stack = self._threads.stack = []
        return stack

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    @contextmanager
    def span(self, name: str, kind: SpanKind = "compute", **meta: Any) -> Iterator[None]:
        _check_kind(kind)
        start = time.perf_counter_ns()
        depth = len(self._stack)
        self._stack.append(f"{name!r} ({kind})")
        self._set_status("in " + self._stack[-1])
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            label = self._stack.pop()
            self._set_status("in " + self._stack[-1] if self._stack else "after " + label)
            if self.enabled:
                self._data.spans.append(
                    Span(self.rank, name, kind, start, end, depth, {**self._tags, **meta})
                )

    def add_span(
        self, name: str, start_ns: int, end_ns: int, kind: SpanKind = "comm", **meta: Any
    ) -> None:
        """Record a span measured by hand (e.g. an async op from launch to wait)."""
        _check_kind(kind)
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends ({end_ns}) before it starts ({start_ns})")
        if self.enabled:
            span = Span(
                self.rank, name, kind, start_ns, end_ns, len(self._stack), {**self._tags, **meta}
            )
            self._data.spans.append(span)

    def count(self, name: str, value: float, **meta: Any) -> None:
        """Add `value` to counter `name` (e.g. `count("bytes_sent", t.nbytes)`)."""
        if self.enabled:
            event = CounterEvent(
                self.rank, name, time.perf_counter_ns(), value, {**self._tags, **meta}
            )
            self._data.counters.append(event)

    def total(self, name: str) -> float:
        """Sum of counter `name` on this rank so far."""
        return sum(e.value for e in self._data.counters if e.name == name)

    def memory(
        self,
        label: str,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        activations: SavedActivations | None = None,
        other: Any = None,
    ) -> MemorySample:
        """Sample live bytes by category now (see `parcourse.memory.live_bytes`)."""
        from parcourse.memory import cuda_figures, live_bytes

        by_category = live_bytes(model, optimizer, activations, other)
        sample = MemorySample(self.rank, label, time.perf_counter_ns(), by_category, cuda_figures())
        if self.enabled:
            self._data.memory.append(sample)
        return sample

    def data(self) -> TraceData:
        return self._data

    def set_status(self, text: str) -> None:
        """Say what this rank is doing outside any span, e.g. "building the model": the
        launcher shows it while the caller waits (a panel's status, a notebook's live line)
        and names it if the run hangs. Records nothing in the trace."""
        self._set_status(text)

    def _set_status(self, text: str) -> None:
        if self._status is not None:
            self._status.value = text.encode("utf-8", "replace")[: len(self._status) - 1]


def _check_kind(kind: str) -> None:
    if kind not in SPAN_KINDS:
        raise ValueError(f"unknown span kind {kind!r}; use one of {', '.join(SPAN_KINDS)}")


@dataclass
class Trace:
    """The merged record of every rank of one run."""

    world_size: int
    spans: list[Span] = field(default_factory=list)
    counters: list[CounterEvent] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)

    @classmethod
    def merge(cls, world_size: int, parts: list[TraceData]) -> Trace:
        trace = cls(world_size)
        for part in parts:
            trace.spans.extend(part.spans)
            trace.counters.extend(part.counters)
            trace.memory.extend(part.memory)
        trace.spans.sort(key=lambda s: (s.start_ns, s.rank, s.depth))
        trace.counters.sort(key=lambda e: (e.t_ns, e.rank))
        trace.memory.sort(key=lambda m: (m.t_ns, m.rank))
        return trace

    @property
    def t0_ns(self) -> int:
        """The earliest timestamp in the trace; plots count time from here."""
        times = [s.start_ns for s in self.spans] + [e.t_ns for e in self.counters]
        times += [m.t_ns for m in self.memory]
        return min(times, default=0)

    def spans_of(
        self, rank: int | None = None, kind: str | None = None, name: str | None = None
    ) -> list[Span]:
        return [
            s
            for s in self.spans
            if (rank is None or s.rank == rank)
            and (kind is None or s.kind == kind)
            and (name is None or s.name == name)
        ]

    def total(self, counter: str, rank: int | None = None) -> float:
        """Sum of a counter over one rank, or over all ranks when rank is None."""
        return sum(
            e.value for e in self.counters if e.name == counter and (rank is None or e.rank == rank)
        )

    def memory_at(self, label: str) -> dict[int, MemorySample]:
        """The last memory sample named `label` on each rank."""
        return {m.rank: m for m in self.memory if m.label == label}

    def to_chrome(self, path: str | Path, profiles: Sequence[RankProfile] | None = None) -> Path:
        """Write a Chrome trace-event file; open it at https://ui.perfetto.dev.

        Without `profiles`, one process with a thread per rank. With them (a profiled
        run's `Run.profiles`), a process per rank holding the course's spans and
        torch.profiler's events on one clock (`parcourse.profiler.chrome_events`)."""
        path = Path(path)
        if profiles:
            from parcourse.profiler import chrome_events

            document = {"traceEvents": chrome_events(self, profiles), "displayTimeUnit": "ms"}
            path.write_text(json.dumps(document))
            return path
        t0 = self.t0_ns
        us = lambda ns: (ns - t0) / 1e3  # noqa: E731
        events: list[dict[str, Any]] = []
        for rank in range(self.world_size):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 0,
                    "tid": rank,
                    "args": {"name": f"rank {rank}"},
                }
            )
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.kind,
                    "pid": 0,
                    "tid": s.rank,
                    "ts": us(s.start_ns),
                    "dur": (s.end_ns - s.start_ns) / 1e3,
                    "args": _jsonable(s.meta),
                }
            )
        running: dict[tuple[int, str], float] = {}
        for e in self.counters:
            key = (e.rank, e.name)
            running[key] = running.get(key, 0.0) + e.value
            events.append(
                {
                    "ph": "C",
                    "name": f"{e.name} (rank {e.rank})",
                    "pid": 0,
                    "tid": e.rank,
                    "ts": us(e.t_ns),
                    "args": {e.name: running[key]},
                }
            )
        for m in self.memory:
            events.append(
                {
                    "ph": "C",
                    "name": f"memory (rank {m.rank})",
                    "pid": 0,
                    "tid": m.rank,
                    "ts": us(m.t_ns),
                    "args": dict(m.bytes),
                }
            )
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path


def with_collective_waits(trace: Trace) -> Trace:
    """`trace` with each traced collective's wait for its partners drawn apart.

    A collective cannot move its data before every rank of its group has entered it; a
    rank that entered early spends the time until the last one came waiting, not
    communicating. Collectives whose spans say their group (`meta["group"]`: the global
    ranks, as tensor parallelism's do) are matched across the group in the order each
    rank ran them (every rank runs its group's collectives in the same order, or the
    run would hang); each is cut at the latest entry into an idle span ("wait for
    partners") and the communication after it, and the spans nested in it (the steps of
    the course's ring) start no earlier than that cut (one wholly before it is part of the
    wait, and left out). A group whose ranks traced different numbers of collectives is
    left as it was (nothing to match reliably).
    """
    runs: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # (rank, group): span indices
    for i, s in enumerate(trace.spans):
        group = s.meta.get("group")
        if s.kind == "comm" and group and len(group) > 1:
            runs.setdefault((s.rank, tuple(group)), []).append(i)
    cut: dict[int, int] = {}  # span index: when its last partner entered
    for group in {g for _, g in runs}:
        per_rank = [runs.get((r, group), []) for r in group]
        if len({len(x) for x in per_rank}) != 1:
            continue
        for matched in zip(*per_rank):
            last = max(trace.spans[i].start_ns for i in matched)
            for i in matched:
                if trace.spans[i].start_ns < last < trace.spans[i].end_ns:
                    cut[i] = last
    if not cut:
        return trace
    waits = [(trace.spans[i], at) for i, at in cut.items()]
    spans: list[Span] = []
    for i, s in enumerate(trace.spans):
        if i not in cut:
            inside = [
                at
                for outer, at in waits
                if outer.rank == s.rank
                and outer.depth < s.depth
                and outer.start_ns <= s.start_ns < at
                and s.end_ns <= outer.end_ns
            ]
            if not inside:
                spans.append(s)
            elif s.end_ns > max(inside):
                spans.append(replace(s, start_ns=max(inside)))
            continue
        spans.append(replace(s, name=f"wait for partners ({s.name})", kind="idle", end_ns=cut[i]))
        spans.append(replace(s, start_ns=cut[i]))
    return replace(trace, spans=spans)


def _jsonable(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        for k, v in meta.items()
    }


def bytes_by_axis(counters: Any) -> dict[str, float]:
    """Bytes sent per mesh axis, from a trace's counters (`bytes_sent`, counted message by
    message where the course's own ring and messenger carry them: pp and dp; tp's
    collectives are torch's and counted by their tensors' sizes in `tp_collective`)."""
    out: dict[str, float] = {}
    for c in counters:
        if c.name == "bytes_sent" and "axis" in c.meta:
            out[c.meta["axis"]] = out.get(c.meta["axis"], 0.0) + c.value
    return out
