"""A caching allocator from scratch, modelled on PyTorch's CUDA caching allocator
(c10/cuda/CUDACachingAllocator.cpp), and the replay of a real step's memory through it.

Read in this order: blocks.py (blocks, segments, pools), caching.py (the allocator),
trace.py (a step's allocations from torch.profiler or a CUDA snapshot), replay.py (a
trace through the allocator: bytes over time, fragmentation at the peak), plot.py.

    allocator = CachingAllocator(capacity=80 * GiB)
    block = allocator.malloc(3000)          # 3072 B from a new 2 MiB small segment
    allocator.free(block)                   # cached, merged with its free neighbours
    plain, grown = compare(from_profiler(prof))   # without, with expandable segments

As in torch:
- every size rounded up to a multiple of 512 B; requests up to 1 MiB from the small pool
  (2 MiB segments), larger ones from the large pool (20 MiB segments for requests under
  10 MiB, else the request rounded up to 2 MiB);
- best fit: the smallest free block that fits, the lowest address among equals; a block
  split when the remainder is at least 512 B (small pool) or more than 1 MiB (large
  pool), otherwise allocated whole, its slack counted as allocated;
- a freed block merged with free neighbours on both sides within its segment; segments
  cudaMalloc'ed only when no free block fits, given back only by `empty_cache()` (those
  wholly free), or when new memory would not fit: every cached segment goes back and
  the allocation is tried once more before "CUDA out of memory", in torch's words;
- `expandable_segments=True`: one address range per pool, pages mapped at its end (2 MiB
  in the small pool, 20 MiB in the large one, kSmallBuffer and kLargeBuffer), splits down
  to 512 B in both pools, best fit preferring a block without unmapped space after it,
  and `empty_cache()` unmapping the whole pages inside free blocks;
- the counters of torch.cuda.memory_stats(): allocated, reserved and requested bytes and
  their peaks, segments, allocation retries and OOMs.

Simplified: one device and one stream (no per-stream pools, no events or record_stream);
addresses are handed out in order and never reused; no max_split_size,
roundup_power2_divisions, garbage_collection_threshold, memory fraction or CUDA-graph
pools; the capacity is all the allocator's (no CUDA context or other processes); the
segment count includes each expandable segment with pages mapped (torch's stat counts
cudaMalloc'ed segments only). A CPU trace is what CPU kernels allocate: a GPU runs
other kernels with their own temporaries (cuBLAS workspaces among them), and memory
allocated on a communication thread is not in it (nor, on a GPU, NCCL's own buffers).
"""

from parcourse.allocator.blocks import Block, Pool, PoolName, Segment, State
from parcourse.allocator.caching import (
    CachingAllocator,
    GiB,
    KiB,
    MiB,
    OutOfMemoryError,
    allocation_size,
    format_size,
    pool_for,
    round_size,
)
from parcourse.allocator.plot import memory_over_time
from parcourse.allocator.replay import Peak, Replay, compare, replay
from parcourse.allocator.trace import (
    Alloc,
    Event,
    Free,
    Trace,
    from_profiler,
    from_snapshot,
    measured,
    parse_events,
    record,
)

__all__ = [
    "Alloc",
    "Block",
    "CachingAllocator",
    "Event",
    "Free",
    "GiB",
    "KiB",
    "MiB",
    "OutOfMemoryError",
    "Peak",
    "Pool",
    "PoolName",
    "Replay",
    "Segment",
    "State",
    "Trace",
    "allocation_size",
    "compare",
    "format_size",
    "from_profiler",
    "from_snapshot",
    "measured",
    "memory_over_time",
    "parse_events",
    "pool_for",
    "record",
    "replay",
    "round_size",
]
