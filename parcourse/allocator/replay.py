"""A trace replayed through the caching allocator: what it held after every event.

trace = parse_events("alloc 1 3000000\\nalloc 2 1000\\nfree 1\\nalloc 3 5000000")
plain, grown = compare(trace)
plain.at_peak()      # allocated, reserved, reserved - allocated, largest free block
grown.at_peak()      # the same with expandable segments
"""

from __future__ import annotations

from dataclasses import dataclass

from parcourse.allocator.blocks import Block
from parcourse.allocator.caching import CachingAllocator, OutOfMemoryError
from parcourse.allocator.trace import Alloc, Trace


@dataclass(frozen=True)
class Peak:
    """The allocator at the measured event where allocated bytes peak: `allocated`,
    `reserved`, `unallocated` (reserved - allocated: the cache, fragments included), the
    `largest_free` block; and `max_reserved`, the most reserved over the measured events."""

    allocated: int
    reserved: int
    unallocated: int
    largest_free: int
    max_reserved: int


@dataclass(frozen=True)
class Replay:
    """After each event of a trace: `allocated`, `reserved` and `requested` bytes, the
    `largest_free` block and the `segments` held (torch's counters of the same names).

    `start`: the trace's first measured event (before it, setup; the cache was emptied
    there); peaks are over the events from it. `oom`: torch's message if an allocation
    did not fit the capacity, at event `len(allocated)` (the replay stops there).
    `retries`: how often new memory would have passed the capacity and every cached
    segment went back before trying again (torch's num_alloc_retries: each a device
    synchronisation, and cudaMalloc again for what was given back)."""

    expandable_segments: bool
    allocated: tuple[int, ...]
    reserved: tuple[int, ...]
    requested: tuple[int, ...]
    largest_free: tuple[int, ...]
    segments: tuple[int, ...]
    start: int = 0
    oom: str | None = None
    retries: int = 0

    @property
    def peak(self) -> int:
        """The index of the first measured event at which allocated bytes are highest."""
        measured = range(self.start, len(self.allocated))
        return max(measured, key=self.allocated.__getitem__, default=self.start)

    def at_peak(self) -> Peak:
        """The allocator's state at `peak`."""
        if len(self.allocated) <= self.start:
            return Peak(0, 0, 0, 0, 0)
        i = self.peak
        allocated, reserved = self.allocated[i], self.reserved[i]
        highest = max(self.reserved[self.start :])
        return Peak(allocated, reserved, reserved - allocated, self.largest_free[i], highest)


def replay(
    trace: Trace, *, expandable_segments: bool = False, capacity: int | None = None
) -> Replay:
    """`trace` through a `CachingAllocator(capacity, expandable_segments=...)`.

    A request of 0 bytes takes no block (torch returns no memory for it). Before the
    trace's `start` event (after its setup) the cache is emptied. An `OutOfMemoryError`
    ends the replay; its message is the replay's `oom`."""
    allocator = CachingAllocator(capacity, expandable_segments=expandable_segments)
    blocks: dict[int, Block | None] = {}
    counters: tuple[list[int], ...] = ([], [], [], [], [])
    oom = None
    for i, event in enumerate(trace.events):
        if i == trace.start and i > 0:
            allocator.empty_cache()
        try:
            if isinstance(event, Alloc):
                if event.id in blocks:
                    raise ValueError(f"request {event.id} allocated twice without a free")
                blocks[event.id] = allocator.malloc(event.size) if event.size else None
            else:
                if event.id not in blocks:
                    raise ValueError(f"request {event.id} freed but never allocated")
                block = blocks.pop(event.id)
                if block is not None:
                    allocator.free(block)
        except OutOfMemoryError as error:
            oom = str(error)
            break
        for values, now in zip(counters, _counters(allocator)):
            values.append(now)
    allocated, reserved, requested, largest, segments = (tuple(c) for c in counters)
    return Replay(
        expandable_segments,
        allocated,
        reserved,
        requested,
        largest,
        segments,
        trace.start,
        oom,
        allocator.num_alloc_retries,
    )


def _counters(allocator: CachingAllocator) -> tuple[int, int, int, int, int]:
    return (
        allocator.memory_allocated(),
        allocator.memory_reserved(),
        allocator.memory_requested(),
        allocator.largest_free_block(),
        allocator.segment_count(),
    )


def compare(trace: Trace, capacity: int | None = None) -> tuple[Replay, Replay]:
    """`trace` replayed without and with expandable segments."""
    return (
        replay(trace, capacity=capacity),
        replay(trace, expandable_segments=True, capacity=capacity),
    )
