"""Lesson 00's runs: the collectives of torch.distributed, seen from every rank.

Each function here is a rank function: `launch(show_collective, 4, "all_reduce")`
runs it on four ranks. Rank r starts with the values r*numel ... r*numel+numel-1,
so in a picture one can see which rank's numbers ended up where.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse._compat import reduce_scatter_single
from parcourse.experiments.exercises import run_exercise
from parcourse.launch import Pool, RankContext

Collective = Literal["broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter"]
COLLECTIVES: tuple[str, ...] = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")


def hello(ctx: RankContext) -> str:
    """Who am I? What a rank knows about itself."""
    return (
        f"rank {ctx.rank} of {ctx.world_size}, backend {ctx.backend}, device {ctx.device}, "
        f"{torch.get_num_threads()} thread(s)"
    )


def starting_tensor(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(rank * numel, (rank + 1) * numel, dtype=torch.int64)


def show_collective(
    ctx: RankContext, op: Collective, numel: int = 4, root: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one collective; return (this rank's tensor before, after).

    reduce_scatter needs numel divisible by world_size: each rank keeps
    numel / world_size of the summed tensor.
    """
    before = starting_tensor(ctx.rank, numel).to(ctx.device)
    with ctx.tracer.span(op, kind="comm"):
        if op == "broadcast":
            after = before.clone()
            dist.broadcast(after, src=root, group=ctx.group)
        elif op == "reduce":
            after = before.clone()
            dist.reduce(after, dst=root, group=ctx.group)
            if ctx.rank != root:
                after = after[:0]  # only the root's result is defined; show nothing elsewhere
        elif op == "all_reduce":
            after = before.clone()
            dist.all_reduce(after, group=ctx.group)
        elif op == "all_gather":
            parts = [torch.empty_like(before) for _ in range(ctx.world_size)]
            dist.all_gather(parts, before, group=ctx.group)
            after = torch.cat(parts)
        elif op == "reduce_scatter":
            after = torch.empty(numel // ctx.world_size, dtype=before.dtype, device=ctx.device)
            reduce_scatter_single(after, before, group=ctx.group)
        else:
            raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(COLLECTIVES)}")
    return before, after


def check_collective_args(op: str, numel: int, world_size: int) -> None:
    """Clear errors before any process starts."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(COLLECTIVES)}")
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if op == "reduce_scatter" and numel % world_size:
        raise ValueError(
            f"reduce_scatter splits the tensor into world_size parts: numel={numel} is not "
            f"divisible by world_size={world_size}"
        )


def barrier_then_all_reduce(ctx: RankContext, work_ms: float = 20.0, numel: int = 1 << 20) -> float:
    """Uneven work, a barrier, then an all_reduce: the waiting shows on the timeline.

    Rank r works (r + 1) * work_ms; the fast ranks wait in the barrier for the
    slowest. Returns the seconds this rank spent in the barrier.
    """
    # Warm up, untraced: the first all_reduce of a size allocates and connects, and the
    # first matmuls are slow; drawn, that first time spreads the exits over ~100 ms.
    t = torch.ones(numel, device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    _busy(seconds=0.005)
    dist.barrier(group=ctx.group)  # a common start, as the theory assumes
    with ctx.tracer.span("work", kind="compute", label=f"{(ctx.rank + 1) * work_ms:g} ms"):
        _busy(seconds=(ctx.rank + 1) * work_ms / 1e3)
    start = time.perf_counter()
    with ctx.tracer.span("barrier", kind="idle"):
        dist.barrier(group=ctx.group)
    waited = time.perf_counter() - start
    with ctx.tracer.span("all_reduce", kind="comm", label=f"{t.nbytes >> 20} MiB"):
        dist.all_reduce(t, group=ctx.group)
    with ctx.tracer.span("work", kind="compute"):
        _busy(seconds=work_ms / 1e3)
    return waited


def _busy(seconds: float) -> None:
    """Real work (a matmul loop) for about `seconds`, rather than sleeping."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def check_average(average_fn: Callable[..., Any], pool: Pool, timeout: float = 30.0) -> bool:
    """Exercise check: `average_fn(ctx)` must return the mean of (rank + 1) over ranks.

    Prints what it found (expected, got and a hint when wrong); True only when
    every rank returned the mean.
    """
    run = run_exercise(pool, average_fn, timeout=timeout)
    if run is None:
        return False
    expected = (pool.world_size + 1) / 2
    try:
        got = [float(r) for r in run.results]  # a one-element tensor is fine too
    except (TypeError, ValueError, RuntimeError):
        got = run.results
    if not all(isinstance(g, float) and abs(g - expected) < 1e-6 for g in got):
        print(
            f"Not quite: expected {expected:g} on every rank, got {got}. Hint: all_reduce "
            "sums in place; divide by ctx.world_size afterwards, and return a number."
        )
        return False
    who = "the only rank" if pool.world_size == 1 else f"every one of {pool.world_size} ranks"
    print(f"Correct: {who} got {expected:g}.")
    return True
