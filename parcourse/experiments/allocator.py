"""The allocator replays that lesson 12 and benchmarks/allocator.py launch: one rank's
training step of the course's GPT recorded (torch.profiler's memory events on CPU, the
CUDA allocator's snapshot on a GPU) and replayed through `parcourse.allocator`, without
and with expandable segments; and the lesson's exercise on best fit and coalescing.

    run = launch(zero3_step_trace, 2, microbatch=8, recompute=True)
    rows = replay_rows("ZeRO-3, recompute", [r for r in run.results])
    print(table(rows))                      # or peak_table(rows): narrower
    ramp = launch(ramp_step_trace, 2)       # batches that grow: what expandable segments fix
    check_best_fit(my_best_fit); check_coalesce(my_coalesce)

A trace runs from building the model (the setup, after which the replay empties the
cache, as a training script does before its loop) through two steps (or one a batch of
`per_step`): the first creates Adam's state, the second starts from what every later
step starts from, with the cache as the first left it. Peaks are over the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from parcourse.allocator import (
    Alloc,
    Block,
    CachingAllocator,
    Peak,
    PoolName,
    State,
    Trace,
    compare,
    from_snapshot,
    measured,
    record,
    replay,
)
from parcourse.checkpointing import checkpoint
from parcourse.data import progressions
from parcourse.data import shard as shard_rows
from parcourse.experiments.exercises import ask
from parcourse.hybrid import Hybrid
from parcourse.launch import RankContext
from parcourse.mesh import Mesh
from parcourse.models import GPT, GPTConfig, gpt
from parcourse.zero import shard as zero_shard

# Large enough that its tensors reach the large pool (a block's MLP activation at 8
# sequences is 4 MiB, a gathered block 3 MiB), small enough for a step in seconds on CPU.
CONFIG = GPTConfig(vocab=512, block_size=128, n_layers=4, n_heads=4, d_model=256)
# The 3D step's: d_model and heads divide by tp 2, four blocks cut into two stages.
HYBRID_CONFIG = GPTConfig(vocab=512, block_size=64, n_layers=4, n_heads=4, d_model=256)


class Recomputed(nn.Module):
    """A block whose forward keeps only its input; backward runs it again
    (`parcourse.checkpointing.checkpoint`), and ZeRO-3 gathers its weights again."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x)


def recompute_blocks(model: GPT) -> GPT:
    """`model` with every block checkpointed (activation checkpointing per block)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Recomputed(block)
    return model


def zero3_step_trace(
    ctx: RankContext,
    microbatch: int = 4,
    *,
    recompute: bool = False,
    steps: int = 2,
    per_step: Sequence[int] | None = None,
    config: GPTConfig = CONFIG,
) -> Trace:
    """This rank's allocation trace from building the GPT and sharding it (the setup)
    through `steps` Adam steps under ZeRO-3 over every rank (measured), `microbatch`
    sequences a rank, each block checkpointed with `recompute`. `per_step`: the
    microbatch of each step instead (batches that grow, as sequence lengths do).

    The collectives are torch's (algorithm="torch"): the course's ring runs on a
    thread of its own, whose allocations the profiler does not record."""

    def train() -> None:
        model = gpt(config)
        if recompute:
            recompute_blocks(model)
        zmodel, opt = zero_shard(
            model,
            lambda ps: torch.optim.Adam(ps, lr=1e-3),
            stage=3,
            group=ctx.group,
            algorithm="torch",
        )
        batches = [_batch(ctx, n, config) for n in (per_step or [microbatch] * steps)]
        with measured():
            for x, y in batches:
                loss = F.cross_entropy(zmodel(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()

    return _recorded(ctx, train)


def _batch(ctx: RankContext, microbatch: int, config: GPTConfig) -> tuple[torch.Tensor, ...]:
    """This rank's `microbatch` rows of a global batch."""
    x, y = progressions(microbatch * ctx.world_size, config.block_size, config.vocab)
    return shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)


def hybrid_step_trace(
    ctx: RankContext,
    shape: dict[str, int] | None = None,
    microbatches: int = 2,
    *,
    batch: int = 8,
    recompute: bool = False,
    steps: int = 2,
    config: GPTConfig = HYBRID_CONFIG,
) -> Trace:
    """This rank's allocation trace from building `parcourse.hybrid.Hybrid` on a mesh of
    `shape` (default dp 2, tp 2, pp 2) with ZeRO-3 over dp (the setup) through `steps`
    steps of 1F1B over `microbatches` (measured). The course's ring runs dp's collectives
    on a thread of its own: what it allocates is not in the trace (`Trace.unseen_frees`
    counts the frees the trace infers)."""

    def train() -> None:
        mesh = Mesh(shape or {"dp": 2, "tp": 2, "pp": 2}, ctx.group)
        model = Hybrid(gpt(config), mesh, microbatches=microbatches, zero=3, recompute=recompute)
        x, y = progressions(batch, config.block_size, config.vocab)
        with measured():
            for _ in range(steps):
                model.step(x, y)

    return _recorded(ctx, train)


def _recorded(ctx: RankContext, train: Any) -> Trace:
    ctx.tracer.set_status("recording")
    _, trace = record(train)
    return trace


@dataclass(frozen=True)
class CudaStep:
    """A step on a GPU: its trace from the snapshot, and torch's own peaks."""

    trace: Trace
    max_reserved: int
    max_allocated: int
    expandable_segments: bool


def cuda_step_trace(
    ctx: RankContext,
    microbatch: int = 4,
    *,
    expandable_segments: bool = False,
    recompute: bool = False,
    steps: int = 2,
    config: GPTConfig = CONFIG,
) -> CudaStep:
    """The GPT's Adam steps on this rank's GPU, alone (no collectives: what the allocator
    sees of one device), recorded by `torch.cuda.memory._record_memory_history` from
    before the model's first allocation, beside torch.cuda.max_memory_reserved() and
    max_memory_allocated() over the steps. Between the setup (the model moved to the GPU)
    and the steps, torch.cuda.empty_cache() and the peaks reset, as the replay does."""
    device = ctx.device
    torch.cuda.memory._set_allocator_settings(
        f"expandable_segments:{'True' if expandable_segments else 'False'}"
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(context=None, max_entries=1_000_000, device=device)
    model = gpt(config)
    if recompute:
        recompute_blocks(model)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = (t.to(device) for t in progressions(microbatch, config.block_size, config.vocab))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    index = device.index or 0
    start = len(torch.cuda.memory._snapshot(device)["device_traces"][index])
    for _ in range(steps):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(device)
    snapshot = torch.cuda.memory._snapshot(device)
    torch.cuda.memory._record_memory_history(enabled=None, device=device)
    return CudaStep(
        from_snapshot(snapshot, index, start),
        torch.cuda.max_memory_reserved(device),
        torch.cuda.max_memory_allocated(device),
        expandable_segments,
    )


@dataclass(frozen=True)
class ReplayRow:
    """One rank's steps replayed: at the peak of allocated bytes, without (`plain`) and
    with expandable segments (`expandable`); the trace's length and its unseen frees."""

    case: str
    rank: int
    plain: Peak
    expandable: Peak
    events: int
    unseen_frees: int


def replay_rows(case: str, traces: list[Trace]) -> list[ReplayRow]:
    """Each rank's trace (a run's results, in rank order) replayed both ways."""
    rows = []
    for rank, trace in enumerate(traces):
        plain, grown = compare(trace)
        rows.append(
            ReplayRow(case, rank, plain.at_peak(), grown.at_peak(), len(trace), trace.unseen_frees)
        )
    return rows


def peak_reserved(trace: Trace, expandable_segments: bool) -> int:
    """The most bytes the replay of `trace` reserved over its measured steps."""
    return replay(trace, expandable_segments=expandable_segments).at_peak().max_reserved


def table(rows: list[ReplayRow]) -> str:
    """The rows as a text table, in MiB: per case and rank, at the peak of allocated
    bytes, what is allocated, reserved, reserved but unallocated and the largest free
    block, and the most reserved over the steps; without and with expandable segments.
    `unseen`: frees inferred where an address came back (freed on a thread not
    recorded)."""
    cells = ("reserved", "unalloc.", "largest", "max res.")
    head = (
        f"{'':<38}{'':>10} | {'plain segments':^43} | {'expandable segments':^43} |\n"
        f"{'case':<32}{'rank':>6}{'allocated':>10} | "
        + " ".join(f"{c:>10}" for c in cells)
        + " | "
        + " ".join(f"{c:>10}" for c in cells)
        + f" | {'events':>7}{'unseen':>7}"
    )
    lines = [head, "-" * len(head.splitlines()[1])]
    for r in rows:
        p, e = r.plain, r.expandable
        lines.append(
            f"{r.case:<32}{r.rank:>6}{_mib(p.allocated)} | "
            + " ".join(_mib(n) for n in (p.reserved, p.unallocated, p.largest_free, p.max_reserved))
            + " | "
            + " ".join(_mib(n) for n in (e.reserved, e.unallocated, e.largest_free, e.max_reserved))
            + f" | {r.events:>7}{r.unseen_frees:>7}"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:>10.1f}"


# -- batches that grow: the case expandable segments exist for

# The logits, (B, 256, 8192) fp32, are B x 8 MiB: from 2 sequences a rank on, above the
# 10 MiB from which a request gets a segment of its own size. Each step's batch is larger
# than the last, so its logits and their gradients fit none of the segments the last
# step freed (torch's Note [Expandable Segments]: "the batch size changes slightly from
# one iteration to the next"); in one expandable range those freed blocks merge and
# serve the larger requests. Two blocks keep a step to a second or two on one CPU core.
RAMP_CONFIG = GPTConfig(vocab=8192, block_size=256, n_layers=2, n_heads=4, d_model=256)
RAMP_BATCHES = (2, 3, 4, 5, 6)  # sequences a rank, step by step (a batch-size ramp)
RAMP_DEVICE = 384 * 2**20  # a device between the ramp's expandable and plain reserved bytes


def ramp_step_trace(
    ctx: RankContext,
    batches: Sequence[int] = RAMP_BATCHES,
    *,
    config: GPTConfig = RAMP_CONFIG,
) -> Trace:
    """This rank's allocation trace of ZeRO-3 steps whose microbatch grows step by step
    (`batches`, sequences a rank), as a batch-size ramp does or batches of sequences
    whose length varies: `zero3_step_trace` with `per_step=batches`."""
    return zero3_step_trace(ctx, per_step=list(batches), config=config)


def peak_table(rows: list[ReplayRow]) -> str:
    """The rows as a narrow text table, in MiB: per rank, at the peak of allocated bytes,
    what is allocated and reserved, reserved - allocated (the cache, fragments
    included) and the largest free block; then reserved and reserved - allocated with
    expandable segments."""
    head = (
        f"{'rank':>4} {'allocated':>10} {'reserved':>9} {'res.-alloc.':>12} "
        f"{'largest free':>13} | {'expandable: reserved':>21} {'res.-alloc.':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p, e = r.plain, r.expandable
        lines.append(
            f"{r.rank:>4} {p.allocated / 2**20:>10.1f} {p.reserved / 2**20:>9.1f} "
            f"{p.unallocated / 2**20:>12.1f} {p.largest_free / 2**20:>13.1f} | "
            f"{e.reserved / 2**20:>21.1f} {e.unallocated / 2**20:>12.1f}"
        )
    return "\n".join(lines)


# -- lesson 12's exercise: which block best fit takes, what a free merges

# Six requests in one 2 MiB segment of the small pool (sizes in bytes: 100, 300, 50,
# 200 and 100 KiB), two of them freed: the lesson asks which block request 6 gets,
# then what the frees of requests 3 and 6 merge.
EXERCISE_EVENTS = """\
alloc 1 102400
alloc 2 307200
alloc 3 51200
alloc 4 204800
alloc 5 102400
free 2
free 4
alloc 6 153600
free 3
free 6
"""

Layout = list[tuple[State, int]]


def segment_layouts(trace: Trace, *, expandable_segments: bool = False) -> list[Layout]:
    """The allocator's blocks after each event of `trace`, every segment's in address
    order, one list: [("allocated", 102400), ("free", 1994752)] after `alloc 1 102400`."""
    return [
        [b for _, blocks in segments for b in blocks]
        for _, segments in _walk(trace, expandable_segments)
    ]


def layout_walk(trace: Trace, *, expandable_segments: bool = False) -> str:
    """One line an event: the event, then every block after it (A: allocated, F: free;
    K = KiB, M = MiB), segments apart:

        alloc 1 102400    | A 100K F 1948K |"""
    lines = []
    for said, segments in _walk(trace, expandable_segments):
        shown = (
            " ".join(f"{s[0].upper()} {_short(n)}" for s, n in blocks) for _, blocks in segments
        )
        lines.append(f"{said:<18}| " + " | ".join(shown) + " |")
    return "\n".join(lines)


def _walk(
    trace: Trace, expandable_segments: bool
) -> Iterator[tuple[str, list[tuple[PoolName, Layout]]]]:
    """Each event of `trace` through a fresh allocator: the event, as written, and the
    allocator's `layout()` after it."""
    allocator = CachingAllocator(expandable_segments=expandable_segments)
    blocks: dict[int, Block] = {}
    for event in trace.events:
        if isinstance(event, Alloc):
            blocks[event.id] = allocator.malloc(event.size)
            yield f"alloc {event.id} {event.size}", allocator.layout()
        else:
            allocator.free(blocks.pop(event.id))
            yield f"free {event.id}", allocator.layout()


def _short(n: int) -> str:
    if n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n}B"


def _segment(sizes: Sequence[int], free: set[int]) -> CachingAllocator:
    """An allocator with one small-pool segment: blocks of `sizes` (KiB, each at most
    1 MiB) in address order, the rest of its 2 MiB free after them, and the blocks at
    the indices in `free` freed."""
    allocator = CachingAllocator()
    blocks = [allocator.malloc(n * 1024) for n in sizes]
    for i in sorted(free):
        allocator.free(blocks[i])
    return allocator


# (blocks in KiB, the indices freed, a request in KiB): what best fit is asked. A
# segment's blocks that do not fill its 2 MiB leave its end free.
BEST_FIT_CASES: tuple[tuple[tuple[int, ...], frozenset[int], int], ...] = (
    ((100, 300, 50, 200, 100), frozenset({1, 3}), 150),  # EXERCISE_EVENTS at alloc 6
    ((64, 100, 64, 100, 64), frozenset({1, 3}), 100),  # two equal holes
    ((64, 32, 64, 100, 64), frozenset({1, 3}), 48),  # the smallest hole is too small
    ((8, 16, 8, 32, 1024, 960), frozenset({1, 3}), 24),  # the segment full but for holes
    ((8, 16, 8, 32, 1024, 960), frozenset({1, 3}), 64),  # nothing fits: a new segment
)


def _best_fit_case(
    case: tuple[tuple[int, ...], frozenset[int], int],
) -> tuple[list[int], int, int | None]:
    """The free blocks' sizes (bytes, address order), the request (bytes), and the index
    of the block the allocator itself gives it (None: a new segment)."""
    blocks, freed, request = case
    allocator = _segment(blocks, set(freed))
    free = sorted(allocator.pools["small"].free_blocks(), key=lambda b: b.address)
    sizes, starts = [b.size for b in free], [b.address for b in free]  # before the split
    got = allocator.malloc(request * 1024)
    return sizes, request * 1024, starts.index(got.address) if got.address in starts else None


def check_best_fit(fn: Callable[[list[int], int], int | None]) -> bool:
    """Lesson 12's exercise: `fn(free, size)` gets the sizes of a pool's free blocks in
    address order and a request's size (bytes, rounded) and returns the index of the
    block best fit gives it, or None when none is large enough (a new segment). Checked
    against the allocator itself on the lesson's sequence and four more; prints one short
    verdict, naming the mistake when it is a common one."""
    for case in BEST_FIT_CASES:
        free, size, want = _best_fit_case(case)
        ok, got = ask(fn, list(free), size, where=f"with free {free} and size {size}, ")
        if not ok:
            return False
        if problem := _best_fit_mistake(free, size, want, got):
            shown = ", ".join(map(_short, free))
            print(f"Not yet (free blocks [{shown}], a request of {_short(size)}): {problem}.")
            return False
    print(
        "Correct: the smallest free block that fits, the lowest address among equals, and "
        "none (a new segment) when no block is large enough."
    )
    return True


def _best_fit_mistake(free: list[int], size: int, want: int | None, got: object) -> str | None:
    """What is wrong with a best-fit answer, in one phrase (None: nothing)."""
    if got is not None and not (
        isinstance(got, int) and not isinstance(got, bool) and 0 <= got < len(free)
    ):
        return f"return an index into free (0 to {len(free) - 1}) or None; got {got!r}"
    if got == want:
        return None
    if want is None:
        return (
            f"block {got} holds {_short(free[cast(int, got)])}, less than {_short(size)}; no "
            "block is large enough, so best fit finds none (None): a new segment"
        )
    if got is None:
        return f"block {want} ({_short(free[want])}) is large enough"
    return _wrong_block(free, size, want, cast(int, got))


def _wrong_block(free: list[int], size: int, want: int, got: int) -> str:
    """Why block `got` is not best fit's `want`."""
    if free[got] < size:
        return f"block {got} holds only {_short(free[got])}; the request needs {_short(size)}"
    if free[got] == free[want]:
        return f"blocks {want} and {got} are the same size: best fit takes the lowest address"
    if got == next(i for i, n in enumerate(free) if n >= size):
        return (
            f"block {got} is the first that fits (first fit); best fit takes the smallest "
            f"that fits, block {want}"
        )
    if free[got] == max(free):
        return "that is the largest block (worst fit); best fit takes the smallest that fits"
    return f"best fit takes the smallest block that fits: block {want}, {_short(free[want])}"


# (blocks in KiB, the indices freed, the index of the block to free next).
COALESCE_CASES: tuple[tuple[tuple[int, ...], frozenset[int], int], ...] = (
    ((100, 300, 50, 150, 50, 100), frozenset({1, 4}), 2),  # EXERCISE_EVENTS: free 3
    ((100, 350, 150, 50, 100), frozenset({1, 3}), 2),  # ...then free 6
    ((100, 200), frozenset(), 1),  # into the free end
    ((100, 200, 300, 1024, 424), frozenset(), 1),  # between two allocated blocks
    ((100, 200), frozenset({0}), 1),  # the segment whole again
)


def _coalesce_case(case: tuple[tuple[int, ...], frozenset[int], int]) -> tuple[Layout, int, Layout]:
    """The segment's blocks before the free, the index freed, and the blocks after it
    (the allocator's own)."""
    sizes, freed, index = case
    allocator = _segment(sizes, set(freed))
    segment = allocator.pools["small"].segments[0]
    before = [(b.state, b.size) for b in segment.blocks()]
    allocator.free(list(segment.blocks())[index])
    return before, index, [(b.state, b.size) for b in segment.blocks()]


def _merged(blocks: Layout, index: int, left: bool, right: bool) -> Layout:
    """`blocks` with block `index` freed and merged with the free neighbours on the sides
    asked (the hints' wrong answers: one side, or none)."""
    lo, hi = index, index + 1
    if left and lo > 0 and blocks[lo - 1][0] == "free":
        lo -= 1
    if right and hi < len(blocks) and blocks[hi][0] == "free":
        hi += 1
    merged: Layout = [("free", sum(n for _, n in blocks[lo:hi]))]
    return blocks[:lo] + merged + blocks[hi:]


def check_coalesce(fn: Callable[[Layout, int], Layout]) -> bool:
    """Lesson 12's exercise: `fn(blocks, index)` gets one segment's blocks in address
    order, as ("allocated" or "free", size in bytes), and returns them after block `index`
    is freed. Checked against the allocator itself on the lesson's two frees and three
    more; prints one short verdict, naming the mistake when it is a common one."""
    for case in COALESCE_CASES:
        before, index, want = _coalesce_case(case)
        ok, got = ask(fn, list(before), index, where=f"with block {index} of {before}, ")
        if not ok:
            return False
        answer = _as_layout(got)
        if answer is None:
            print(
                'Not yet: return the blocks as a list of (state, size) pairs, state "allocated" '
                f'or "free", e.g. {want[:2]}'
                + (". Hint: a missing `return`?" if got is None else "")
            )
            return False
        if answer != want:
            mistake = _coalesce_mistake(before, index, want, answer)
            print(f"Not yet (freeing block {index} of {_shown(before)}): {mistake}.")
            return False
    print(
        "Correct: a freed block merges with the free blocks right before and after it, "
        "never across an allocated one."
    )
    return True


def _as_layout(got: object) -> Layout | None:
    """A learner's blocks as (state, size) tuples, None when they are not that."""
    if not isinstance(got, list | tuple):
        return None
    blocks: Layout = []
    for block in got:
        if not (isinstance(block, list | tuple) and len(block) == 2):
            return None
        state, size = block
        if (
            state not in ("allocated", "free")
            or isinstance(size, bool)
            or not isinstance(size, int)
        ):
            return None
        blocks.append((state, size))
    return blocks


def _coalesce_mistake(before: Layout, index: int, want: Layout, got: Layout) -> str:
    """What a wrong answer to a free shows, in one phrase."""
    total = sum(n for _, n in before)
    if sum(n for _, n in got) != total:
        return (
            f"the sizes add up to {sum(n for _, n in got)} bytes, not the segment's {total}: "
            "a free moves no bytes, it only joins blocks"
        )
    if got == _merged(before, index, False, False):
        return "a freed block next to a free one merges with it into one block"
    if got == _merged(before, index, True, False):
        return "merged with the free block before it; the one after it merges too"
    if got == _merged(before, index, False, True):
        return "merged with the free block after it; the one before it merges too"
    if sum(s == "free" for s, _ in got) < sum(s == "free" for s, _ in want):
        return "only neighbours merge: a free block beyond an allocated one stays apart"
    return f"expected {_shown(want)}"


def _shown(blocks: Layout) -> str:
    """Blocks as the lesson prints them: [A 100K, F 300K]."""
    return "[" + ", ".join(f"{state[0].upper()} {_short(n)}" for state, n in blocks) + "]"
