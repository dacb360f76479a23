"""The allocator's bookkeeping: the blocks of a segment, linked in address order, and
each pool's free blocks, sorted for best fit.

A `Segment` is one piece of device memory (a cudaMalloc, or an expandable segment's
address range); its blocks tile it without gaps, from `Segment.first` through each
`Block.next`. A `Pool` holds the free (mapped, unallocated) blocks of its segments,
ordered by (size, address) as torch's `BlockPool.blocks` is: the first block at
least as large as a request is the best fit, the lowest address among equals.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

PoolName = Literal["small", "large"]
State = Literal["allocated", "free", "unmapped"]


@dataclass(eq=False)
class Block:
    """A run of bytes inside a segment: allocated to one request, free (cached, to be
    reused), or, in an expandable segment, unmapped (address space with no memory behind
    it). `requested` is what the request asked for, before rounding."""

    address: int
    size: int
    segment: Segment
    allocated: bool = False
    mapped: bool = True
    requested: int = 0
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    @property
    def state(self) -> State:
        """ "allocated", "free" or "unmapped"."""
        if self.allocated:
            return "allocated"
        return "free" if self.mapped else "unmapped"

    @property
    def end(self) -> int:
        """The first address after this block."""
        return self.address + self.size

    @property
    def pool(self) -> Pool:
        return self.segment.pool

    def insert_after(self, other: Block) -> None:
        """Link `other` into the segment right after this block."""
        other.prev, other.next = self, self.next
        if self.next is not None:
            self.next.prev = other
        self.next = other

    def insert_before(self, other: Block) -> None:
        """Link `other` into the segment right before this block."""
        other.prev, other.next = self.prev, self
        if self.prev is not None:
            self.prev.next = other
        else:
            self.segment.first = other
        self.prev = other


@dataclass(eq=False)
class Segment:
    """Device memory the allocator holds: `size` bytes from `address`, in `pool`.

    `page` is None for a segment from one cudaMalloc; for an expandable segment it is the
    size of the pages mapped into its address range (2 MiB in the small pool, 20 MiB in
    the large one), `size` is the whole address range, mapped or not, and `mapped` the
    bytes of its pages mapped now.
    """

    address: int
    size: int
    pool: Pool
    page: int | None = None
    first: Block = field(init=False, repr=False)
    mapped: int = field(init=False)

    def __post_init__(self) -> None:
        self.first = Block(self.address, self.size, self, mapped=self.page is None)
        self.mapped = self.size if self.page is None else 0

    @property
    def expandable(self) -> bool:
        return self.page is not None

    def blocks(self) -> Iterator[Block]:
        """Every block, in address order."""
        block: Block | None = self.first
        while block is not None:
            yield block
            block = block.next

    def mapped_ranges(self) -> list[list[Block]]:
        """The blocks of each contiguous mapped range, as torch's snapshot reports an
        expandable segment (a plain segment is one range)."""
        ranges: list[list[Block]] = []
        for block in self.blocks():
            if not block.mapped:
                continue
            if block.prev is None or not block.prev.mapped:
                ranges.append([])
            ranges[-1].append(block)
        return ranges


class Pool:
    """The free blocks of one pool ("small" or "large"), by (size, address)."""

    def __init__(self, name: PoolName) -> None:
        self.name: PoolName = name
        self.segments: list[Segment] = []
        self._keys: list[tuple[int, int]] = []  # sorted (size, address)
        self._free: dict[tuple[int, int], Block] = {}

    @property
    def is_small(self) -> bool:
        return self.name == "small"

    def __contains__(self, block: Block) -> bool:
        return self._free.get((block.size, block.address)) is block

    def __len__(self) -> int:
        return len(self._keys)

    def insert(self, block: Block) -> None:
        """`block` is free: cache it for reuse."""
        key = (block.size, block.address)
        bisect.insort(self._keys, key)
        self._free[key] = block

    def remove(self, block: Block) -> None:
        """`block` leaves the free blocks (allocated, merged or unmapped)."""
        key = (block.size, block.address)
        del self._free[key]
        del self._keys[bisect.bisect_left(self._keys, key)]

    def fitting(self, size: int) -> Iterator[Block]:
        """The free blocks of at least `size` bytes, smallest first (best fit first)."""
        for key in self._keys[bisect.bisect_left(self._keys, (size, -1)) :]:
            yield self._free[key]

    def free_blocks(self) -> list[Block]:
        """Every free block, smallest first."""
        return [self._free[key] for key in self._keys]

    def largest(self) -> int:
        """The size of the largest free block (0: none)."""
        return self._keys[-1][0] if self._keys else 0
