"""The allocator replays that lesson 12 and benchmarks/allocator.py launch: one rank's
training step of the course's GPT recorded (torch.profiler's memory events on CPU, the
CUDA allocator's snapshot on a GPU) and replayed through `parcourse.allocator`, without
and with expandable segments.

    run = launch(zero3_step_trace, 2, microbatch=8, recompute=True)
    rows = replay_rows("ZeRO-3, recompute", [r for r in run.results])
    print(table(rows))

A trace runs from building the model (the setup, after which the replay empties the
cache, as a training script does before its loop) through two steps: the first creates
Adam's state, the second starts from what every later step starts from, with the cache
as the first left it. Peaks are over the two steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parcourse.allocator import Peak, Trace, compare, from_snapshot, measured, record, replay
from parcourse.checkpointing import checkpoint
from parcourse.data import progressions
from parcourse.data import shard as shard_rows
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
