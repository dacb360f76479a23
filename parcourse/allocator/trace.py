"""Allocation traces: what a program asked its allocator for, in order, from three sources.

- `parse_events("alloc 1 4096\\nfree 1")`: written by hand (a lesson's exercise, a test).
- `from_profiler(prof)`: a step run under `torch.profiler.profile(profile_memory=True)`.
  Each memory event has an address and a signed byte count (positive allocates, negative
  frees). The `[memory]` events of `prof.events()` and `kineto_results.events()` carry the
  byte count only (`nbytes`, no address); the address is the `ptr` of the allocation's
  node in `kineto_results.experimental_event_tree()` (`_ExtraFields_Allocation`, with
  `alloc_size` and `total_allocated`), which torch's own memory timeline reads. On CPU
  the sizes are the storages' bytes exactly (CPU memory is not cached). Recorded are the
  thread that started the profiler and the threads that carry its state (gloo's workers,
  whose all-gathers allocate); a Python thread of its own (the course's ring) is not:
  memory allocated there is missing, memory allocated in the trace and freed there is
  freed in the trace when its address is allocated again (`unseen_frees`), and the free
  of memory from before the trace is left out (`untracked_frees`).
- `from_snapshot(torch.cuda.memory._snapshot())`: a GPU run under
  `torch.cuda.memory._record_memory_history()`; "alloc" entries carry the requested size,
  "free_completed" the moment the block went back to the pool, and the segment entries
  give torch's own reserved bytes, kept beside the trace to compare with.

`record(fn)` runs a function under the profiler and returns its trace; inside it,
`with measured():` marks the training steps, the setup before them (`Trace.start`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alloc:
    """A request for `size` bytes, called `id` until its `Free`."""

    id: int
    size: int


@dataclass(frozen=True)
class Free:
    """The memory of request `id` goes back to the allocator."""

    id: int


Event = Alloc | Free


@dataclass(frozen=True)
class Trace:
    """A program's allocation events, in order.

    `live`: the bytes the recorder itself counted live after each event (the profiler's
    `total_allocated`, less what it counted from before the trace), which a replay's
    requested bytes equal. `reserved`: torch's reserved bytes after each event (from a
    snapshot's segment entries). `untracked_frees`: frees of memory the trace never saw
    allocated, left out. `unseen_frees`: frees the recorder missed (memory freed on
    another thread), each put in the trace where its address was allocated again.
    `start`: the first event of the steps measured (inside `measured()`); what comes
    before is setup (building the model, sharding it), after which a replay empties the
    cache, as a training script calling torch.cuda.empty_cache() before its loop.
    """

    events: tuple[Event, ...]
    live: tuple[int, ...] | None = None
    reserved: tuple[int, ...] | None = None
    untracked_frees: int = 0
    unseen_frees: int = 0
    start: int = 0

    def __len__(self) -> int:
        return len(self.events)

    def peak_live(self) -> int:
        """The most bytes requested at once (0 for an empty trace)."""
        live = peak = 0
        sizes: dict[int, int] = {}
        for e in self.events:
            if isinstance(e, Alloc):
                sizes[e.id] = e.size
                live += e.size
                peak = max(peak, live)
            else:
                live -= sizes.pop(e.id)
        return peak


def parse_events(text: str) -> Trace:
    """A trace written one event a line: `alloc ID SIZE` or `free ID` (blank lines and
    `#` comments ignored)."""
    events: list[Event] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#")[0].split()
        if not words:
            continue
        if words[0] == "alloc" and len(words) == 3:
            events.append(Alloc(int(words[1]), int(words[2])))
        elif words[0] == "free" and len(words) == 2:
            events.append(Free(int(words[1])))
        else:
            raise ValueError(f"line {number}: {line!r} is neither 'alloc ID SIZE' nor 'free ID'")
    return Trace(tuple(events))


class _ByAddress:
    """Turns (address, signed bytes) records into events: an address names one request
    from its allocation to its free, then may be reused by the next."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.live_ids: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.untracked_frees = 0
        self.unseen_frees = 0
        self._next_id = 0

    def alloc(self, address: int, size: int) -> int:
        """Record the allocation; returns the bytes of an unseen free it implies: an
        address allocated again was freed in between where the recorder did not look
        (another thread), so the free goes into the trace here."""
        unseen = 0
        if address in self.live_ids:
            old = self.live_ids.pop(address)
            self.events.append(Free(old))
            unseen = self.sizes.pop(old)
            self.unseen_frees += 1
        self.live_ids[address] = self._next_id
        self.sizes[self._next_id] = size
        self.events.append(Alloc(self._next_id, size))
        self._next_id += 1
        return unseen

    def free(self, address: int) -> bool:
        """False for memory allocated before the trace (or on another thread)."""
        if address not in self.live_ids:
            self.untracked_frees += 1
            return False
        id = self.live_ids.pop(address)
        del self.sizes[id]
        self.events.append(Free(id))
        return True


STEPS = "parcourse.allocator.steps"  # the profiler's name for the region `measured()` marks


def measured() -> AbstractContextManager[Any]:
    """Mark the steps a trace measures, inside a recorded function: `with measured():`
    around the training loop (a `torch.profiler.record_function` region), the setup
    before it."""
    from torch.profiler import record_function

    return record_function(STEPS)


def _allocation_nodes(prof: Any) -> tuple[list[Any], int | None]:
    """The profiler's allocation records, in time order (the tree holds them under the
    operators that allocated), and when the first `measured()` region began."""
    results = getattr(prof, "profiler", prof).kineto_results  # torch.profiler or autograd's
    found, stack, marks = [], list(reversed(results.experimental_event_tree())), []
    while stack:  # depth first, in the tree's order: records of one time stay in order
        node = stack.pop()
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            found.append(node)
        elif getattr(node, "name", None) == STEPS:
            marks.append(node.start_time_ns)
        stack.extend(reversed(node.children))
    return sorted(found, key=lambda n: n.start_time_ns), min(marks, default=None)


CROSSING_WINDOW = 64  # how far ahead a record counted earlier may have been stamped


def _in_counting_order(fields: list[Any]) -> list[int]:
    """The records' indices in the order the allocator counted them. Threads that allocate
    at once (the backend's workers record too) can be stamped in the other order than
    they were counted; each record's `total_allocated`, the running count after it, says
    the order: the next record is the first one, within a few, whose count continues the
    last."""
    pending = deque(range(len(fields)))
    ordered: list[int] = []
    total = fields[0].total_allocated - fields[0].alloc_size if fields else 0
    while pending:
        k = next(
            (
                k
                for k in range(min(len(pending), CROSSING_WINDOW))
                if fields[pending[k]].total_allocated - fields[pending[k]].alloc_size == total
            ),
            0,  # none continues it: time order
        )
        i = pending[k]
        del pending[k]
        ordered.append(i)
        total = fields[i].total_allocated
    return ordered


def from_profiler(prof: Any, device: str = "cpu") -> Trace:
    """The allocations and frees of `device` that `prof` (a finished
    `torch.profiler.profile(profile_memory=True)`) recorded, in the order the allocator
    counted them."""
    nodes, mark = _allocation_nodes(prof)
    nodes = [n for n in nodes if str(n.extra_fields.device) == device]
    fields = [n.extra_fields for n in nodes]
    trace = _ByAddress()
    live: list[int] = []
    start = 0
    before = None  # bytes the profiler counts that this trace does not hold
    for i in _in_counting_order(fields):
        f = fields[i]
        if before is None:
            before = f.total_allocated - f.alloc_size
        if f.alloc_size > 0:
            unseen = trace.alloc(f.ptr, f.alloc_size)
            if unseen:  # freed on a thread not recorded: the profiler still counts it
                live.append(live[-1] - unseen)
                before += unseen
            live.append(f.total_allocated - before)
        elif trace.free(f.ptr):
            live.append(f.total_allocated - before)
        else:  # its bytes leave the profiler's count, never ours
            before += f.alloc_size
        if mark is not None and nodes[i].start_time_ns < mark:  # setup
            start = len(trace.events)
    events = tuple(trace.events)
    return Trace(events, tuple(live), None, trace.untracked_frees, trace.unseen_frees, start)


def record(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Trace]:
    """`fn(*args, **kwargs)` under torch.profiler with memory profiling (CPU activity
    only): its result and its allocation trace."""
    from torch.profiler import ProfilerActivity, profile

    from parcourse.profiler import quiet_torch

    with quiet_torch(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    return result, from_profiler(prof)


SEGMENT_ACTIONS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def from_snapshot(snapshot: dict[str, Any], device: int = 0, start: int = 0) -> Trace:
    """The trace of `torch.cuda.memory._snapshot()` for GPU `device`: its "alloc" and
    "free_completed" entries, and torch's reserved bytes after each (from the segment
    entries; segments held before recording began are not in them). `start`: the
    index of the entry where the measured steps begin (the length of the device's trace
    in a snapshot taken then), the setup before it."""
    trace = _ByAddress()
    reserved, held, first = [], 0, 0
    for index, entry in enumerate(_device_trace(snapshot, device)):
        action = entry["action"]
        if action in SEGMENT_ACTIONS:
            held += SEGMENT_ACTIONS[action] * entry["size"]
        elif action == "alloc" and entry["size"] > 0:
            if trace.alloc(entry["addr"], entry["size"]):
                reserved.append(held)
            reserved.append(held)
        elif action == "free_completed" and trace.free(entry["addr"]):
            reserved.append(held)
        if index < start:  # setup
            first = len(trace.events)
    events = tuple(trace.events)
    return Trace(events, None, tuple(reserved), trace.untracked_frees, trace.unseen_frees, first)


def _device_trace(snapshot: dict[str, Any], device: int) -> Sequence[dict[str, Any]]:
    traces: Iterable[Sequence[dict[str, Any]]] = snapshot.get("device_traces", [])
    traces = list(traces)
    if device >= len(traces):
        raise ValueError(
            f"the snapshot has traces of {len(traces)} device(s), not of device {device}: "
            "record with torch.cuda.memory._record_memory_history() before the step"
        )
    return traces[device]
