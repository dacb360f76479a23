"""Lesson 01's runs, and what the CLI and benchmarks/collectives.py time: all-reduce by
ring, parameter server, hierarchical and torch, timed, traced and checked; the ring step
exercise."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.comm import (
    Network,
    SimulatedLink,
    Topology,
    bytes_by_level,
    chunk_bounds,
    hierarchical_all_reduce,
    naive_all_reduce,
    ring_all_reduce,
    simulated_link,
)
from parcourse.experiments.exercises import run_exercise
from parcourse.launch import Pool, RankContext

Algo = Literal["ring", "naive", "torch", "hierarchical"]


ALGOS: tuple[str, ...] = ("ring", "naive", "torch", "hierarchical")


def all_reduce_with(
    algo: Algo,
    t: torch.Tensor,
    ctx: RankContext,
    *,
    link: Network | None = None,
    traced: bool = False,
) -> None:
    """One all-reduce of `t` with the chosen algorithm (torch's ignores the link; the
    hierarchical one takes its nodes from the link, a `Topology`)."""
    tracer = ctx.tracer if traced else None
    if algo == "hierarchical":
        if not isinstance(link, Topology):
            raise ValueError("the hierarchical all-reduce needs nodes: a Topology as its link")
        hierarchical_all_reduce(t, link.ranks_per_node, tracer=tracer, link=link)
    elif algo == "ring":
        ring_all_reduce(t, ctx.group, tracer=tracer, link=link)
    elif algo == "naive":
        naive_all_reduce(t, ctx.group, tracer=tracer, link=link)
    elif algo == "torch":
        with ctx.tracer.span("torch all_reduce", kind="comm") if traced else nullcontext():
            dist.all_reduce(t, group=ctx.group)
    else:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGOS)}")


def check_all_reduced(ctx: RankContext, algo: str, t: torch.Tensor, expected: float) -> None:
    """Raise, naming this rank, unless every element of `t` equals `expected`."""
    if not bool(t.eq(expected).all()):
        raise AssertionError(
            f"rank {ctx.rank}: {algo} all-reduce of {t.nbytes} bytes gave "
            f"{t.view(-1)[:4].tolist()}…, expected {expected}"
        )


_EXACT_UP_TO = {
    "float16": 1 << 11,
    "bfloat16": 1 << 8,
    "float32": 1 << 24,
    "float64": 1 << 53,
    "int32": (1 << 31) - 1,
    "int64": (1 << 63) - 1,
}


def max_batch(world_size: int, dtype: str = "float32") -> int:
    """The most all-reduces `time_all_reduce` may run back to back from ones:
    world_size ** batch must stay exact in the dtype (any number with one rank)."""
    if world_size == 1:
        return sys.maxsize
    batch = 0
    while world_size ** (batch + 1) <= _EXACT_UP_TO[dtype]:
        batch += 1
    return batch


def _timed(ctx: RankContext, algo: str, t: torch.Tensor, ops: int, link: Network | None) -> float:
    """Seconds per all-reduce of `ops` run back to back from ones after a barrier;
    the result is checked afterwards (untimed)."""
    t.fill_(1)
    dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    for _ in range(ops):
        all_reduce_with(algo, t, ctx, link=link)  # type: ignore[arg-type]  # callers name algorithms as str; all_reduce_with refuses unknown ones
    if t.is_cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / ops
    check_all_reduced(ctx, algo, t, ctx.world_size**ops)
    return seconds


def time_all_reduce(
    ctx: RankContext,
    algos: list[str],
    sizes: list[int],
    repeats: int,
    dtype: str = "float32",
    link: Network | None = None,
    batch: int = 1,
) -> dict[tuple[str, int], list[float]]:
    """Seconds per all-reduce on this rank, for each (algorithm, size in bytes).

    Each of the `repeats` samples times `batch` all-reduces run back to back
    after a barrier and divides by `batch`. batch=1 times one all-reduce that
    starts on every rank at the same moment; a larger batch times the steady
    state of one all-reduce after another, as nccl-tests does (and as a
    stream of gradient buckets runs). Algorithms alternate (and swap order
    every sample) so that a change in the machine's load hits all of them
    alike. One warm-up each, untimed.

    Every sample starts from ones and its result is checked, untimed: world
    size ** batch everywhere. (Summing the same tensor without refilling it
    would reach inf after 128 rounds with two ranks.)
    """
    torch_dtype = getattr(torch, dtype)
    if not 1 <= batch <= max_batch(ctx.world_size, dtype):
        raise ValueError(
            f"batch={batch} with {ctx.world_size} ranks sums to "
            f"{ctx.world_size}**{batch}, more than {dtype} holds exactly; "
            "use a smaller batch"
        )
    out: dict[tuple[str, int], list[float]] = {}
    for size in sizes:
        t = torch.ones(max(1, size // torch_dtype.itemsize), dtype=torch_dtype, device=ctx.device)
        for algo in algos:
            _timed(ctx, algo, t, 1, link)  # warm-up
        for i in range(repeats):
            for algo in algos if i % 2 == 0 else algos[::-1]:
                out.setdefault((algo, size), []).append(_timed(ctx, algo, t, batch, link))
    return out


def time_over_links(
    ctx: RankContext,
    algos: list[str],
    nbytes: int,
    links: Mapping[str, SimulatedLink | None],
    repeats: int,
) -> dict[tuple[str, str], list[float]]:
    """Seconds per all-reduce of `nbytes` floats' bytes on this rank, for each
    (algorithm, name of a link in `links`), every combination alternating (and
    swapping order every sample) as in `time_all_reduce`, so that they can be
    compared with each other. One warm-up each, untimed; results checked."""
    t = torch.ones(max(1, nbytes // 4), device=ctx.device)
    combos = [(algo, name) for algo in algos for name in links]
    for algo, name in combos:
        _timed(ctx, algo, t, 1, links[name])  # warm-up
    out: dict[tuple[str, str], list[float]] = {}
    for i in range(repeats):
        for algo, name in combos if i % 2 == 0 else combos[::-1]:
            out.setdefault((algo, name), []).append(_timed(ctx, algo, t, 1, links[name]))
    return out


def traced_all_reduce(
    ctx: RankContext,
    algo: Algo,
    numel: int,
    latency_us: float = 0.0,
    bandwidth_gbps: float | None = None,
) -> float:
    """One traced all-reduce of `numel` floats (rank r holds r + 1); returns bytes sent.

    The spans (one per ring step, coloured by chunk) and the bytes_sent counter
    land in the run's trace.
    """
    link = simulated_link(latency_us, bandwidth_gbps)
    t = torch.full((numel,), float(ctx.rank + 1), device=ctx.device)
    dist.barrier(group=ctx.group)
    all_reduce_with(algo, t, ctx, link=link, traced=True)
    check_all_reduced(ctx, algo, t, ctx.world_size * (ctx.world_size + 1) / 2)
    return ctx.tracer.total("bytes_sent")


def _ring_steps_with(
    ctx: RankContext, step_fn: Callable[..., Any], numel: int
) -> tuple[list[float], list[float]]:
    """Run a learner's reduce-scatter step n - 1 times; return (my chunk, expected)."""
    n, rank = ctx.world_size, ctx.rank
    flat = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    expected = torch.arange(numel, dtype=torch.float32) * (n * (n + 1) / 2)
    bounds = chunk_bounds(numel, n)
    for step in range(n - 1):
        step_fn(flat, bounds, step, rank, n, ctx.group)
    start, end = bounds[rank]
    return flat[start:end].tolist(), expected[start:end].tolist()


def check_ring_step(
    step_fn: Callable[..., Any], pool: Pool, numel: int = 10, timeout: float = 30.0
) -> bool:
    """Exercise check for lesson 01: n - 1 of your steps must leave chunk r fully summed
    on rank r. Prints what it found (expected, got and a hint when wrong); True only
    when every rank owns its reduced chunk. Needs at least 2 ranks."""
    if pool.world_size < 2:
        print("One rank has no ring: run this check on a pool of 2 ranks or more.")
        return False
    run = run_exercise(
        pool,
        _ring_steps_with,
        step_fn,
        numel,
        timeout=timeout,
        died=". Hint: a message met a receive of another size, or none: does "
        "each step send to the right and receive from the left, the "
        "chunks the step names?",
    )
    if run is None:
        return False
    for rank, (got, expected) in enumerate(run.results):
        if got != expected:
            print(
                f"Not quite: rank {rank} ended with chunk {got}, expected {expected}. "
                "Hint: step s sends chunk (rank - s - 1) % n to the right and adds chunk "
                "(rank - s - 2) % n, received from the left, into its own copy."
            )
            return False
    steps = pool.world_size - 1
    print(
        f"Correct: after {steps} step{'s' * (steps > 1)} every rank owns its fully reduced chunk."
    )
    return True


def over_two_levels(
    ctx: RankContext, algos: list[str], nbytes: int, dtype: str, repeats: int, network: Topology
) -> dict[str, object]:
    """Each algorithm on the two-level network: the bytes this rank sent inside its node
    and across nodes in one traced all-reduce, then its timed ones (`time_all_reduce`)."""
    kind = getattr(torch, dtype)
    levels = {}
    for algo in algos:
        t = torch.ones(max(1, nbytes // kind.itemsize), dtype=kind, device=ctx.device)
        before = len(ctx.tracer.data().counters)
        all_reduce_with(algo, t, ctx, link=network, traced=True)  # type: ignore[arg-type]  # the CLI's choices
        sent = ctx.tracer.data().counters[before:]
        levels[algo] = bytes_by_level(sent, ctx.rank, network.ranks_per_node)
    times = time_all_reduce(ctx, algos, [nbytes], repeats, dtype, network)
    return {"levels": levels, "times": times}


def two_levels_table(pool: Pool, ranks_per_node: int, nbytes: int, repeats: int = 3) -> str:
    """Lesson 01's table: the hierarchical all-reduce beside the flat ring on the two-level
    network `Topology.of(ranks_per_node)`, each rank's bytes inside its node and across
    nodes (measured, and the formula's) and the slowest rank's median time."""
    from parcourse.theory import flat_ring_bytes_across, hierarchical_bytes

    n, world = ranks_per_node, pool.world_size
    done = pool.run(
        over_two_levels,
        ["hierarchical", "ring"],
        nbytes,
        "float32",
        repeats,
        Topology.of(n),
    )
    lines = [
        f"{world} ranks, {n} a node, {nbytes / 2**20:g} MiB: bytes each rank sent "
        "in KiB, inside its node / across nodes (the formula's across)"
    ]
    for algo in ("hierarchical", "ring"):
        seconds = statistics.median(
            max(r["times"][(algo, nbytes)][i] for r in done.results) for i in range(repeats)
        )
        if algo == "ring":
            theory = [flat_ring_bytes_across(nbytes, world, n, r, 4) for r in range(world)]
        else:
            theory = [hierarchical_bytes(nbytes, world, n, r, 4)[1] for r in range(world)]
        levels = [result["levels"][algo] for result in done.results]
        sent = "  ".join(
            f"{inside / 1024:.0f}/{across / 1024:.0f} ({theory[rank] / 1024:.0f})"
            for rank, (inside, across) in enumerate(levels)
        )
        lines.append(f"{algo:>12}: {seconds * 1e3:6.1f} ms   {sent}")
    return "\n".join(lines)
