"""torch.profiler beside the course's spans: how well the two clocks agree, and what
profiling costs lesson 12's step.

    python benchmarks/profiler.py [--world-size 4] [--matmuls 50] [--repeats 3]

1. Clocks: `--matmuls` matrix multiplies on each of `--world-size` ranks, each inside a
   course span (`time.perf_counter_ns()`), under torch.profiler. For each rank, how far
   the `aten::mm` torch recorded starts after its span starts (lead) and ends before its
   span ends (trail), on the course's clock: a negative one is an operator outside the
   span it ran in. And how tightly the rank read the offset between the two clocks.
2. Cost: lesson 12's step (`experiments.profiling.dp_step`, 2 ranks, one pool) run
   `--repeats` times unprofiled and profiled, alternating: the run's seconds (median), the
   events each rank sent back, the merged Perfetto file's size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from parcourse import Pool, launch
from parcourse.experiments.profiling import dp_step, profile_step


def matmuls(ctx, n: int) -> None:
    a = torch.randn(128, 128)
    for i in range(n):
        with ctx.tracer.span("matmul", i=i):
            a @ a


def clocks(world_size: int, n: int) -> None:
    run = launch(matmuls, world_size, n, profile=True)
    assert run.profiles is not None
    header = ("rank", "lead min", "median", "trail min", "median", "outside", "offset within")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (4, 9, 8, 10, 8, 8, 16))))
    for p in run.profiles:
        spans = run.trace.spans_of(rank=p.rank, name="matmul")
        mms = [o for o in p.ops_named("aten::mm") if o.thread == p.main_thread]
        lead = [(o.start_ns - s.start_ns) / 1e3 for s, o in zip(spans, mms, strict=True)]
        trail = [(s.end_ns - o.end_ns) / 1e3 for s, o in zip(spans, mms, strict=True)]
        outside = sum(x < 0 for x in lead + trail)
        print(
            f"{p.rank:>4} {min(lead):>7.1f}us {statistics.median(lead):>6.1f}us "
            f"{min(trail):>8.1f}us {statistics.median(trail):>6.1f}us {outside:>8} "
            f"{p.clock_spread_ns:>13} ns"
        )


def cost(repeats: int) -> None:
    plain, profiled = [], []
    with Pool(2) as pool:
        pool.run(dp_step)  # the ranks' first imports, outside the timing
        for _ in range(repeats):
            t = time.perf_counter()
            pool.run(dp_step)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            run = profile_step(pool=pool)
            profiled.append(time.perf_counter() - t)
    assert run.profiles is not None
    with tempfile.TemporaryDirectory() as folder:
        size = run.to_chrome(Path(folder) / "step.json").stat().st_size
    events = [len(p.chrome) for p in run.profiles]
    print(f"unprofiled run  {statistics.median(plain):6.2f} s (median of {repeats})")
    print(f"profiled run    {statistics.median(profiled):6.2f} s (median of {repeats})")
    print(f"events per rank {events}, the merged file {size / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--matmuls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"1. clocks: {args.matmuls} aten::mm per rank, each in a course span")
    clocks(args.world_size, args.matmuls)
    print("\n2. cost: lesson 12's step, 2 ranks on one pool")
    cost(args.repeats)


if __name__ == "__main__":
    main()
