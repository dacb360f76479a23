"""Bus bandwidth of ring_all_reduce (and the parameter server) vs torch.distributed.all_reduce.

    python benchmarks/collectives.py [--world-sizes 2 4] [--max-size 256MB] [--repeats 10]
                                     [--pools 3] [--batch 8]

gloo on CPU, one thread per rank. As in nccl-tests, a sample times
all-reduces run back to back (8 after one barrier) and divides by their
number: the steady state of one all-reduce after another, as a stream of
gradient buckets runs. `--batch 1` times single all-reduces instead, each
started on every rank at the same moment. For each size, ours and torch's
alternate in the same run (so machine noise hits both alike); each sample's
time is the slowest rank's, and the table shows medians. The samples are
shared among a few pools (fresh sets of rank processes), because one set of
processes can sit 0.1 above or below another for its whole life; the table
shows each pool's ratio too. busbw = S/t x 2(N-1)/N (nccl-tests'
definition). The ceiling is the loopback point-to-point bandwidth measured
in the same run. Target: ring / torch >= 0.9 at every size >= 1 MB for world size 2.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from parcourse import Pool
from parcourse.cli import parse_size
from parcourse.experiments.all_reduce import max_batch, time_all_reduce
from parcourse.experiments.timing import slowest_rank
from parcourse.theory import bus_bandwidth

MAX_REPEATS = 1600  # all-reduces per size (200 samples of 8) up to 256 KB


def repeats_for(size: int, base: int) -> int:
    """About the same time for every size: base all-reduces at 64 MB and above,
    4x as many for each 4x smaller size, up to MAX_REPEATS.

    Single all-reduces on a busy machine vary a lot from one to the next, so a
    median of tens of them moves from run to run; hundreds pin it down (the
    table's 95% interval column shows how well, for every size).
    """
    return min(MAX_REPEATS, max(base, round(base * (64 << 20) / size)))


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval for the median of xs: the order
    statistics x(k) and x(n-1-k), counted from 0, for the largest k with P(B <= k) <=
    2.5%, B the number of values below the median (binomial, n and 1/2). The interval
    then holds the median with probability 1 - 2 P(B <= k) >= 95%. With fewer than six
    values no k reaches that: the whole range (with five, 94%)."""
    xs, n = sorted(xs), len(xs)
    k, below = 0, 1 / 2**n  # P(B <= k)
    while k + 1 < n // 2 and below + math.comb(n, k + 1) / 2**n <= 0.025:
        k += 1
        below += math.comb(n, k) / 2**n
    if below > 0.025:
        k = 0
    return xs[k], xs[n - 1 - k]


def timed_sizes(ctx, sizes, repeats, algos, pools, batch):
    """This pool's share of the all-reduces of every size, in samples of `batch`
    (fewer where the share is smaller than a batch)."""
    out = {}
    for size in sizes:
        share = -(-repeats_for(size, repeats) // pools)  # rounded up
        per_sample = min(batch, share)
        out.update(time_all_reduce(ctx, algos, [size], -(-share // per_sample), batch=per_sample))
    return out


def p2p_bandwidth(ctx, nbytes, repeats):
    """Rank 0 sends to rank 1 and back: one direction's bytes/s over loopback."""
    t = torch.ones(nbytes // 4)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        if ctx.rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif ctx.rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - t0) / 2)
    return nbytes / statistics.median(times[1:])


def fmt_size(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-size", default="4KB")
    parser.add_argument("--max-size", default="256MB")
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="all-reduces at 64 MB and above (more for smaller sizes)",
    )
    parser.add_argument(
        "--pools",
        type=int,
        default=3,
        help="fresh sets of rank processes per world size, sharing the samples",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=8,
        help="all-reduces back to back per timed sample (1: one at a time)",
    )
    parser.add_argument("--naive", action="store_true", help="also time the parameter server")
    args = parser.parse_args()
    if args.pools < 1:
        parser.error(f"--pools must be >= 1, got {args.pools}")
    if not 1 <= args.batch <= max_batch(max(args.world_sizes)):
        parser.error(
            f"--batch must be >= 1 and world_size ** batch <= 2**24 (exact in float32), "
            f"got {args.batch} with world size {max(args.world_sizes)}"
        )
    sizes, size = [], parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        sizes.append(size)
        size *= 4
    algos = ["ring", "torch"] + (["naive"] if args.naive else [])
    how = (
        "one all-reduce per sample"
        if args.batch == 1
        else f"up to {args.batch} all-reduces back to back per sample"
    )
    print(
        f"torch {torch.__version__}, gloo on CPU, one thread per rank; "
        f"{args.repeats}-{MAX_REPEATS} all-reduces per size and algorithm, {how}, "
        f"shared among {args.pools} pool{'s' * (args.pools > 1)}; medians of paired samples"
    )
    for world_size in args.world_sizes:
        ceilings, pooled = [], []  # pooled[p][algo, size]: slowest rank's times in pool p
        for p in range(args.pools):
            print(
                f"world size {world_size}: pool {p + 1}/{args.pools}...",
                end="\r",
                file=sys.stderr,
                flush=True,
            )
            with Pool(world_size, timeout=3600) as pool:
                if world_size > 1:
                    ceilings.append(pool.run(p2p_bandwidth, 64 << 20, 5).results[0])
                per_rank = pool.run(
                    timed_sizes, sizes, args.repeats, algos, args.pools, args.batch
                ).results
            pooled.append({(a, s): slowest_rank(per_rank, (a, s)) for a in algos for s in sizes})
        ceiling = statistics.median(ceilings) if ceilings else 0.0
        print(
            f"\nworld size {world_size}; loopback p2p ceiling "
            f"{ceiling / 1e9:.2f} GB/s per direction"
        )
        head = "".join(f"{a + ' busbw':>14}" for a in algos)
        print(
            f"{'size':>8}{head}{'ring / torch':>14}{'95% interval':>15}{'pairs':>7}"
            f"  {'each pool':<{5 * args.pools}}{'target':>7}"
        )
        for size in sizes:
            row = ""
            for algo in algos:
                times = [t for one in pooled for t in one[algo, size]]
                busbw = bus_bandwidth(size, statistics.median(times), world_size)[1]
                row += f"{busbw / 1e9:>10.2f} GB/s"
            # Ratio of bandwidths = inverse ratio of times, taken pair by pair (each pair
            # ran back to back) so drift in the machine's load cancels.
            each = [
                [t / r for r, t in zip(one["ring", size], one["torch", size])] for one in pooled
            ]
            ratios = [x for one in each for x in one]
            ratio, (lo, hi) = statistics.median(ratios), median_interval(ratios)
            per_pool = " ".join(f"{statistics.median(one):.2f}" for one in each)
            judged = world_size == 2 and size >= 1 << 20
            target = ("met" if ratio >= 0.9 else "MISSED") if judged else ""
            print(
                f"{fmt_size(size):>8}{row}{ratio:>14.2f}{f'{lo:.2f}-{hi:.2f}':>15}"
                f"{len(ratios):>7}  {per_pool:<{5 * args.pools}}{target:>7}"
            )


if __name__ == "__main__":
    main()
