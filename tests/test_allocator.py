"""The caching allocator against hand-worked traces: the block layout after each event,
and torch's out-of-memory message."""

import pytest

from parcourse.allocator import (
    CachingAllocator,
    KiB,
    MiB,
    OutOfMemoryError,
    allocation_size,
    round_size,
)


def A(n):
    return ("allocated", n)


def F_(n):
    return ("free", n)


SEGMENT = 2 * MiB  # a small pool segment


# -- sizes and pools


def test_sizes_round_up_to_a_multiple_of_512_bytes():
    a = CachingAllocator()
    for n in (1, 512, 513, 1536):
        a.malloc(n)
    assert a.layout() == [("small", [A(512), A(512), A(1024), A(1536), F_(SEGMENT - 3584)])]
    assert a.memory_allocated() == 3584
    assert a.memory_requested() == 1 + 512 + 513 + 1536  # torch's requested_bytes
    assert [round_size(n) for n in (1, 511, 512, 513, 1024)] == [512, 512, 512, 1024, 1024]


def test_up_to_one_mib_is_the_small_pool_and_larger_requests_the_large():
    a = CachingAllocator()
    a.malloc(MiB)  # small: a 2 MiB segment
    a.malloc(MiB + 1)  # rounded to 1 MiB + 512: large, a 20 MiB segment
    assert a.layout() == [
        ("small", [A(MiB), F_(MiB)]),
        ("large", [A(MiB + 512), F_(19 * MiB - 512)]),
    ]
    assert a.memory_reserved() == 22 * MiB
    sizes = (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 10 * MiB + 512)
    assert [allocation_size(n) // MiB for n in sizes] == [2, 2, 20, 20, 10, 12]


def test_a_split_keeps_the_remainder_by_each_pools_rule():
    small = CachingAllocator()
    small.malloc(MiB)
    small.malloc(MiB - 512)  # the remainder is exactly 512 B: split (small pool: >= 512 B)
    assert small.layout() == [("small", [A(MiB), A(MiB - 512), F_(512)])]

    large = CachingAllocator()
    b = large.malloc(5 * MiB)  # a 20 MiB segment, split: 15 MiB stay cached
    assert large.layout() == [("large", [A(5 * MiB), F_(15 * MiB)])]
    large.free(b)
    c = large.malloc(19 * MiB)  # 1 MiB would remain: not split (large pool: > 1 MiB)
    assert large.layout() == [("large", [A(20 * MiB)])]
    assert (large.memory_allocated(), large.memory_requested()) == (20 * MiB, 19 * MiB)
    large.free(c)
    large.malloc(19 * MiB - 512)  # 1 MiB + 512 B remain: split
    assert large.layout() == [("large", [A(19 * MiB - 512), F_(MiB + 512)])]


# -- free, coalescing, best fit


def test_a_free_in_the_middle_of_a_segment_leaves_a_hole_between_live_blocks():
    a = CachingAllocator()
    _, middle, _ = (a.malloc(4 * KiB) for _ in range(3))
    a.free(middle)
    assert a.layout() == [("small", [A(4 * KiB), F_(4 * KiB), A(4 * KiB), F_(SEGMENT - 12 * KiB)])]
    a.malloc(8 * KiB)  # too large for the hole: from the free end
    assert a.layout() == [
        ("small", [A(4 * KiB), F_(4 * KiB), A(4 * KiB), A(8 * KiB), F_(SEGMENT - 20 * KiB)])
    ]
    assert a.memory_reserved() == SEGMENT


REST = SEGMENT - 16 * KiB  # after four blocks of 4 KiB


@pytest.mark.parametrize(
    "frees, expected",
    [
        ([0, 1], [F_(8 * KiB), A(4 * KiB), A(4 * KiB), F_(REST)]),  # with the left one
        ([2, 1], [A(4 * KiB), F_(8 * KiB), A(4 * KiB), F_(REST)]),  # with the right one
        ([0, 2, 1], [F_(12 * KiB), A(4 * KiB), F_(REST)]),  # with both
        ([3], [A(4 * KiB), A(4 * KiB), A(4 * KiB), F_(REST + 4 * KiB)]),  # into the free end
        ([1, 3, 0, 2], [F_(SEGMENT)]),  # all of it
    ],
    ids=["left", "right", "both", "end", "all"],
)
def test_a_freed_block_merges_with_free_neighbours_on_both_sides(frees, expected):
    a = CachingAllocator()
    blocks = [a.malloc(4 * KiB) for _ in range(4)]
    for i in frees:
        a.free(blocks[i])
    assert a.layout() == [("small", expected)]


def test_best_fit_takes_the_smallest_block_that_fits_not_the_first():
    a = CachingAllocator()
    blocks = [a.malloc(n * KiB) for n in (8, 4, 4, 4, 4)]
    a.free(blocks[0])  # an 8 KiB hole at the start
    a.free(blocks[2])  # a 4 KiB hole after it
    rest = SEGMENT - 24 * KiB
    a.malloc(4 * KiB)
    assert a.layout() == [
        ("small", [F_(8 * KiB), A(4 * KiB), A(4 * KiB), A(4 * KiB), A(4 * KiB), F_(rest)])
    ]


def test_best_fit_among_equal_blocks_takes_the_lowest_address():
    a = CachingAllocator()
    blocks = [a.malloc(4 * KiB) for _ in range(5)]
    a.free(blocks[3])
    a.free(blocks[1])
    a.malloc(4 * KiB)
    four = 4 * KiB
    assert a.layout() == [
        ("small", [A(four), A(four), A(four), F_(four), A(four), F_(SEGMENT - 20 * KiB)])
    ]


def test_a_new_segment_only_when_no_free_block_fits():
    a = CachingAllocator()
    first = a.malloc(MiB)
    a.malloc(MiB)  # the 2 MiB segment is full
    a.free(first)
    a.malloc(MiB)  # exactly the freed block: no new segment
    assert a.layout() == [("small", [A(MiB), A(MiB)])]
    assert a.memory_reserved() == SEGMENT
    a.malloc(512)  # nothing free: a second segment
    assert a.layout() == [("small", [A(MiB), A(MiB)]), ("small", [A(512), F_(SEGMENT - 512)])]
    assert (a.memory_reserved(), a.segment_count()) == (2 * SEGMENT, 2)


def test_empty_cache_gives_back_only_segments_with_nothing_allocated():
    a = CachingAllocator()
    freed = a.malloc(4 * KiB)
    a.malloc(4 * KiB)  # keeps the small segment, whose first block is free
    big = a.malloc(5 * MiB)  # a 20 MiB segment, freed whole below
    a.malloc(16 * MiB)  # its own 16 MiB segment (15 MiB free in the other: too small)
    a.free(freed)
    a.free(big)
    assert a.memory_reserved() == (2 + 20 + 16) * MiB
    a.empty_cache()
    assert a.layout() == [
        ("small", [F_(4 * KiB), A(4 * KiB), F_(SEGMENT - 8 * KiB)]),
        ("large", [A(16 * MiB)]),
    ]
    assert a.memory_reserved() == 18 * MiB


# -- expandable segments


def test_expandable_segments_grow_the_free_end_where_plain_ones_add_a_segment():
    plain, grown = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for a in (plain, grown):
        a.free(a.malloc(5 * MiB))  # a 20 MiB segment, or one 20 MiB page, free again
        a.malloc(30 * MiB)
    assert plain.layout() == [("large", [F_(20 * MiB)]), ("large", [A(30 * MiB)])]
    assert plain.memory_reserved() == 50 * MiB
    # the free page grows by one more page at its end: 40 MiB, one segment
    assert grown.layout() == [("large", [A(30 * MiB), F_(10 * MiB)])]
    assert (grown.memory_reserved(), grown.segment_count()) == (40 * MiB, 1)


def test_expandable_segments_map_small_pages_at_the_end_and_unmap_free_pages():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(MiB)
    a.malloc(MiB)  # the first 2 MiB page is full
    a.malloc(512)  # a second page, in the same segment
    assert a.layout() == [("small", [A(MiB), A(MiB), A(512), F_(SEGMENT - 512)])]
    assert a.memory_reserved() == 2 * SEGMENT

    b = CachingAllocator(expandable_segments=True)
    b.malloc(5 * MiB)
    big = b.malloc(30 * MiB)  # the 15 MiB left of page 0 and 15 MiB of page 1
    assert b.layout() == [("large", [A(5 * MiB), A(30 * MiB), F_(5 * MiB)])]
    b.free(big)
    b.empty_cache()  # page 1 is wholly free: unmapped; page 0 holds the 5 MiB
    assert b.layout() == [("large", [A(5 * MiB), F_(15 * MiB)])]
    assert b.memory_reserved() == 20 * MiB


# -- running out


OOM = (
    "CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of "
    "30.00 MiB of which 10.00 MiB is free. Of the allocated memory 5.00 MiB is allocated by "
    "PyTorch, and 15.00 MiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation."
)


def test_out_of_memory_says_what_torch_says():
    a = CachingAllocator(capacity=30 * MiB)
    a.malloc(5 * MiB)  # a 20 MiB segment, 15 MiB of it free
    with pytest.raises(OutOfMemoryError) as error:
        a.malloc(16 * MiB)  # a 16 MiB segment would make 36 MiB
    assert str(error.value) == OOM
    assert (a.num_ooms, a.memory_reserved()) == (1, 20 * MiB)
    full = CachingAllocator(capacity=30 * MiB)
    full.malloc(5 * MiB)
    full.malloc(15 * MiB)  # the 20 MiB segment, full
    with pytest.raises(OutOfMemoryError, match="Tried to allocate 20.00 MiB. .* 0 bytes is re"):
        full.malloc(3 * MiB)  # torch names the segment it tried for, not the request


def test_before_running_out_the_cache_goes_back_and_the_allocation_is_tried_again():
    a = CachingAllocator(capacity=40 * MiB)
    a.malloc(5 * MiB)
    a.malloc(15 * MiB)  # the first 20 MiB segment, full
    a.free(a.malloc(12 * MiB))  # a 12 MiB segment, cached
    a.malloc(14 * MiB)  # 20 + 12 + 14 > 40: the cached segment goes back, then it fits
    assert a.layout() == [("large", [A(5 * MiB), A(15 * MiB)]), ("large", [A(14 * MiB)])]
    assert (a.num_alloc_retries, a.memory_reserved()) == (1, 34 * MiB)
