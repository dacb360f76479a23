"""The caching allocator: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp)
on a simulated device, one stream.

`malloc(size)`, in torch's order (`DeviceCachingAllocator::malloc`):
1. round the size up to a multiple of 512 B (`round_size`);
2. pick the pool: small for at most 1 MiB, else large (`pool_for`);
3. best fit: the smallest free block of the pool that is large enough, the lowest
   address among equals (`get_free_block`);
4. none fits: new memory: a segment of `allocation_size(size)` bytes (cudaMalloc), or,
   with expandable segments, pages mapped at the end of the pool's segment
   (`try_allocate_expandable_block`);
5. that would pass the device's capacity: give back every cached segment
   (`release_cached_blocks`, as `empty_cache`) and try once more, else raise
   `OutOfMemoryError` with torch's message;
6. split the block when the remainder is worth keeping (`should_split`): small pool,
   or any pool with expandable segments, at least 512 B; large pool more than 1 MiB
   (else the whole block is allocated, and its slack counts as allocated, as in torch).

`free(block)` merges the block with a free neighbour on either side within its segment
and caches it; no memory goes back to the device until `empty_cache()`.
"""

from __future__ import annotations

from parcourse.allocator.blocks import Block, Pool, PoolName, Segment, State

KiB, MiB, GiB = 1024, 1024**2, 1024**3
MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 1 * MiB  # kSmallSize: requests up to this size use the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small pool segment (and expandable page)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: a large segment for requests under 10 MiB (and page)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a segment is the request itself...
ROUND_LARGE = 2 * MiB  # kRoundLarge: ...rounded up to a multiple of 2 MiB
NO_CAPACITY_ADDRESS_SPACE = 1 << 40  # an expandable segment's range without a capacity


def round_size(size: int) -> int:
    """`size` rounded up to a multiple of 512 B, at least 512 B (torch's `round_size`)."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def pool_for(size: int) -> PoolName:
    """The pool a rounded size is served from: "small" up to 1 MiB, else "large"."""
    return "small" if size <= SMALL_SIZE else "large"


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'ed for a rounded `size` that no free block fits (torch's
    `get_allocation_size`): 2 MiB for the small pool, 20 MiB for a request under 10 MiB,
    else the request rounded up to 2 MiB."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def format_size(n: int) -> str:
    """Bytes as torch's messages write them (c10's `format_size`): '512 bytes',
    '1.50 KiB', '20.00 MiB', '1.25 GiB'."""
    if n <= KiB:
        return f"{n} bytes"
    if n <= MiB:
        return f"{n / KiB:.2f} KiB"
    if n <= GiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / GiB:.2f} GiB"


class OutOfMemoryError(RuntimeError):
    """No block fits, and new memory would pass the device's capacity even after every
    cached segment went back. The message is torch's (torch.OutOfMemoryError)."""

    def __init__(self, size: int, alloc_size: int, allocated: int, reserved: int, capacity: int):
        self.size, self.alloc_size, self.capacity = size, alloc_size, capacity
        self.allocated, self.reserved = allocated, reserved
        super().__init__(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a "
            f"total capacity of {format_size(capacity)} of which "
            f"{format_size(capacity - reserved)} is free. Of the allocated memory "
            f"{format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, int, int, int]]:  # crosses processes
        return type(self), (
            self.size,
            self.alloc_size,
            self.allocated,
            self.reserved,
            self.capacity,
        )


class CachingAllocator:
    """A device's caching allocator: `malloc(size) -> Block`, `free(block)`,
    `empty_cache()`, and torch's counters (`memory_allocated()`, `memory_reserved()`,
    their `max_` peaks, `memory_stats()`).

    `capacity`: the device's bytes (None: unlimited); reserved bytes never pass it.
    `expandable_segments=True`: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: each
    pool keeps one segment, an address range of 9/8 of the capacity (1 TiB without one),
    into which pages (2 MiB small, 20 MiB large) are mapped as needed, so a free block at
    the end grows into a larger request instead of a new segment beside it.
    """

    def __init__(self, capacity: int | None = None, *, expandable_segments: bool = False) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes, got {capacity}")
        self.capacity = capacity
        self.expandable_segments = expandable_segments
        self.pools: dict[PoolName, Pool] = {"small": Pool("small"), "large": Pool("large")}
        self._next_address = 0  # where the next segment starts; addresses are never reused
        self._allocated = self._reserved = self._requested = 0
        self._max_allocated = self._max_reserved = self._max_requested = 0
        self.num_alloc_retries = 0  # times malloc gave the cache back and tried again
        self.num_ooms = 0

    # -- torch's counters

    def memory_allocated(self) -> int:
        """Bytes in allocated blocks (torch's allocated_bytes): requests rounded to 512 B,
        plus the slack of a large block too small to split."""
        return self._allocated

    def memory_reserved(self) -> int:
        """Bytes of device memory held: segments, or mapped pages (reserved_bytes)."""
        return self._reserved

    def memory_requested(self) -> int:
        """Bytes the live requests asked for, unrounded (torch's requested_bytes)."""
        return self._requested

    def max_memory_allocated(self) -> int:
        """The peak of `memory_allocated()` since the start or `reset_peak_memory_stats()`."""
        return self._max_allocated

    def max_memory_reserved(self) -> int:
        """The peak of `memory_reserved()`."""
        return self._max_reserved

    def reset_peak_memory_stats(self) -> None:
        """Peaks from now on (torch.cuda.reset_peak_memory_stats)."""
        self._max_allocated, self._max_reserved = self._allocated, self._reserved
        self._max_requested = self._requested

    def largest_free_block(self) -> int:
        """The largest request that fits without new memory, in bytes."""
        return max(pool.largest() for pool in self.pools.values())

    def segment_count(self) -> int:
        """Segments holding device memory: each cudaMalloc'ed one, and each expandable
        segment with pages mapped (`layout()` shows the latter's mapped ranges apart)."""
        return sum(1 for pool in self.pools.values() for s in pool.segments if s.mapped)

    def memory_stats(self) -> dict[str, int]:
        """The counters under torch.cuda.memory_stats()'s names ("all" pools)."""
        free_in_split = [
            b
            for pool in self.pools.values()
            for b in pool.free_blocks()
            if not b.segment.expandable and (b.prev is not None or b.next is not None)
        ]
        return {
            "allocated_bytes.all.current": self._allocated,
            "allocated_bytes.all.peak": self._max_allocated,
            "reserved_bytes.all.current": self._reserved,
            "reserved_bytes.all.peak": self._max_reserved,
            "requested_bytes.all.current": self._requested,
            "requested_bytes.all.peak": self._max_requested,
            "segment.all.current": self.segment_count(),
            "inactive_split_bytes.all.current": sum(b.size for b in free_in_split),
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }

    def layout(self) -> list[tuple[PoolName, list[tuple[State, int]]]]:
        """Every segment in address order: its pool and its blocks' (state, size), e.g.
        `[("small", [("allocated", 512), ("free", 2096640)])]`. An expandable segment
        appears as its mapped ranges, as in torch's snapshot."""
        segments = sorted(
            (s for pool in self.pools.values() for s in pool.segments), key=lambda s: s.address
        )
        return [
            (s.pool.name, [(b.state, b.size) for b in blocks])
            for s in segments
            for blocks in s.mapped_ranges()
        ]

    # -- malloc and free

    def malloc(self, size: int) -> Block:
        """A block for `size` bytes (> 0), from the cache if one fits, else new memory."""
        if size <= 0:
            raise ValueError(
                f"malloc needs a positive size, got {size} (torch gives 0 bytes no block)"
            )
        rounded = round_size(size)
        pool = self.pools[pool_for(rounded)]
        block = self._best_fit(pool, rounded)
        if block is not None:
            pool.remove(block)
        else:
            block = self._new_memory(pool, rounded)
            if block is None:  # torch: release_cached_blocks, then alloc_block once more
                self.empty_cache()
                self.num_alloc_retries += 1
                block = self._new_memory(pool, rounded)
            if block is None:
                self.num_ooms += 1
                capacity = self.capacity or 0
                alloc = allocation_size(rounded)
                raise OutOfMemoryError(size, alloc, self._allocated, self._reserved, capacity)
        if self._should_split(block, rounded):  # the remainder stays cached, after it
            remainder = Block(block.address + rounded, block.size - rounded, block.segment)
            block.insert_after(remainder)
            block.size = rounded
            pool.insert(remainder)
        block.allocated, block.requested = True, size
        self._count(allocated=block.size, requested=size)
        return block

    def free(self, block: Block) -> None:
        """Give `block` back to its pool, merged with free neighbours on both sides."""
        if not block.allocated:
            raise ValueError(f"block at {block.address:#x} is not allocated")
        self._count(allocated=-block.size, requested=-block.requested)
        block.allocated, block.requested = False, 0
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour)
        block.pool.insert(block)

    def empty_cache(self) -> None:
        """Give back every segment with no allocated block (torch.cuda.empty_cache); of an
        expandable segment, unmap every whole page inside a free block."""
        for pool in self.pools.values():
            unmap = []
            for block in pool.free_blocks():
                if block.segment.expandable:
                    unmap.append(block)
                elif block.prev is None and block.next is None:
                    pool.remove(block)
                    self._release(block.segment)
            for block in unmap:
                self._unmap(block)
                if block.prev is None and block.next is None:  # nothing mapped in it now
                    pool.segments.remove(block.segment)

    # -- the steps of malloc

    def _best_fit(self, pool: Pool, size: int) -> Block | None:
        """The smallest free block of at least `size`; with expandable segments, among
        blocks that size and up, the one whose unmapped tail adds least (torch's
        `expandable_size`), so a block before unmapped space is kept for larger ones."""
        fitting = pool.fitting(size)
        best = next(fitting, None)
        if best is None or not best.segment.expandable:
            return best
        for block in fitting:
            if _expandable_size(block) >= _expandable_size(best):
                break
            best = block
        return best

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small or self.expandable_segments:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _new_memory(self, pool: Pool, size: int) -> Block | None:
        """A free block of at least `size` bytes made from new device memory, outside the
        pool's free blocks; None if the device has no room."""
        if self.expandable_segments:
            return self._expand(pool, size)
        alloc = allocation_size(size)
        if self.capacity is not None and self._reserved + alloc > self.capacity:
            return None
        segment = Segment(self._next_address, alloc, pool)
        self._next_address += alloc
        pool.segments.append(segment)
        self._count(reserved=alloc)
        return segment.first

    def _release(self, segment: Segment) -> None:
        """cudaFree: the segment, wholly free, goes back to the device."""
        segment.pool.segments.remove(segment)
        self._count(reserved=-segment.size)

    def _merge(self, block: Block, neighbour: Block | None) -> None:
        """`block` takes in `neighbour` (its prev or next) if that is neither allocated
        nor of the other mapping (torch's `try_merge_blocks`)."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return
        if neighbour in neighbour.pool:
            neighbour.pool.remove(neighbour)
        if neighbour is block.prev:
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                block.segment.first = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    def _count(self, *, allocated: int = 0, reserved: int = 0, requested: int = 0) -> None:
        self._allocated += allocated
        self._reserved += reserved
        self._requested += requested
        self._max_allocated = max(self._max_allocated, self._allocated)
        self._max_reserved = max(self._max_reserved, self._reserved)
        self._max_requested = max(self._max_requested, self._requested)

    # -- expandable segments: pages mapped into one address range per pool

    def _expand(self, pool: Pool, size: int) -> Block | None:
        """A free block of `size` at the first place with room: a free block followed by
        unmapped space, or unmapped space, mapped page by page (torch's
        `try_allocate_expandable_block`)."""
        start = self._room_for(pool, size)
        candidate = start if start.mapped else self._map(start, min(start.size, size))
        while candidate is not None and candidate.size < size:
            after = candidate.next  # free -> unmapped: map some of it onto candidate
            assert after is not None and not after.mapped
            candidate = self._map(after, min(size - candidate.size, after.size))
        if candidate is not None:
            pool.remove(candidate)
        return candidate

    def _room_for(self, pool: Pool, size: int) -> Block:
        """The lowest unmapped block (or the free block right before it) starting `size`
        bytes of free and unmapped blocks; a new segment's range if there is none
        (torch's `find_expandable_block`)."""
        for segment in sorted(pool.segments, key=lambda s: s.address):
            for block in segment.blocks():
                if block.mapped:
                    continue
                start = block.prev if block.prev is not None and not block.prev.allocated else block
                room = 0
                after: Block | None = start
                while room < size and after is not None and not after.allocated:
                    room += after.size
                    after = after.next
                if room >= size:
                    return start
        page = SMALL_BUFFER if pool.is_small else LARGE_BUFFER
        space = self.capacity + self.capacity // 8 if self.capacity else NO_CAPACITY_ADDRESS_SPACE
        segment = Segment(self._next_address, -(-space // page) * page, pool, page=page)
        self._next_address += segment.size
        pool.segments.append(segment)
        return segment.first

    def _map(self, block: Block, size: int) -> Block | None:
        """Map whole pages from the start of unmapped `block` to cover `size` bytes; the
        mapped part merges with free neighbours and is returned, free and cached. None if
        the device has no room (torch's `map_block`)."""
        page = block.segment.page
        assert (
            page is not None
            and not block.mapped
            and (block.address - block.segment.address) % page == 0
        )
        nbytes = -(-size // page) * page
        if self.capacity is not None and self._reserved + nbytes > self.capacity:
            return None
        if nbytes < block.size:
            block.insert_after(
                Block(block.address + nbytes, block.size - nbytes, block.segment, mapped=False)
            )
            block.size = nbytes
        block.mapped = True
        block.segment.mapped += nbytes
        self._count(reserved=nbytes)
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour)
        block.pool.insert(block)
        return block

    def _unmap(self, block: Block) -> None:
        """Unmap the whole pages inside free `block`; the parts of a page before and after
        stay free blocks (torch's `unmap_block`)."""
        segment, page = block.segment, block.segment.page
        assert page is not None
        first = -(-(block.address - segment.address) // page)
        last = (block.end - segment.address) // page
        if first >= last:
            return
        start, stop = segment.address + first * page, segment.address + last * page
        block.pool.remove(block)
        if start > block.address:
            before = Block(block.address, start - block.address, segment)
            block.insert_before(before)
            block.pool.insert(before)
        if stop < block.end:
            after = Block(stop, block.end - stop, segment)
            block.insert_after(after)
            block.pool.insert(after)
        block.address, block.size, block.mapped = start, stop - start, False
        segment.mapped -= stop - start
        self._count(reserved=-(stop - start))
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour)


def _expandable_size(block: Block) -> int:
    """A free block's size with the unmapped space right after it, which it can grow into."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
