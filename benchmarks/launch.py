"""How long it takes to get N ranks to run a function, ours vs torch.multiprocessing.spawn.

    python benchmarks/launch.py [--repeats 5] [--pool-repeats 20]

Each measurement starts ranks, joins them into a gloo process group, runs one
all_reduce of 1024 floats and brings the result back. Ours and spawn are
alternated in one run; medians are reported.

- cold launch: `launch()` in a fresh Python process (starts the forkserver,
  which imports torch once);
- warm launch: `launch()` once the forkserver is running (new ranks every time);
- Pool.run: ranks and process group kept alive, re-run only.

Targets on a 2-core laptop: warm launch of 4 ranks <= 0.3 s, Pool.run <= 20 ms,
both >= 10x faster than spawn.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from parcourse import Pool, launch


def smoke(ctx) -> float:
    t = torch.full((1024,), float(ctx.rank + 1))
    dist.all_reduce(t, group=ctx.group)
    return t[0].item()


def _spawned(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()


def time_spawn(world_size: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    tmp.spawn(_spawned, args=(world_size, port), nprocs=world_size, join=True)
    return time.perf_counter() - t0


def time_warm_launch(world_size: int) -> float:
    t0 = time.perf_counter()
    run = launch(smoke, world_size)
    assert run.results == [world_size * (world_size + 1) / 2] * world_size
    return time.perf_counter() - t0


def time_cold_launch(world_size: int) -> float:
    code = (
        "import time, sys; sys.path.insert(0, sys.argv[1]); from launch import smoke;"
        "from parcourse import launch; t = time.perf_counter();"
        f"launch(smoke, {world_size}); print(time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool-repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo on CPU, one thread per rank")
    launch(smoke, 1)  # start the forkserver once, so "warm" below means warm
    rows = []
    for world_size in (2, 4):
        spawn, warm, cold = [], [], []
        for _ in range(args.repeats):  # alternate, so machine noise hits both alike
            spawn.append(time_spawn(world_size))
            warm.append(time_warm_launch(world_size))
        for _ in range(min(3, args.repeats)):
            cold.append(time_cold_launch(world_size))
        with Pool(world_size) as pool:
            pool.run(smoke)
            reruns = []
            for _ in range(args.pool_repeats):
                t0 = time.perf_counter()
                pool.run(smoke)
                reruns.append(time.perf_counter() - t0)
        s = statistics.median(spawn)
        rows += [
            (world_size, "torch.multiprocessing.spawn", s, s, ""),
            (world_size, "launch, cold (fresh process)", statistics.median(cold), s, ""),
            (
                world_size,
                "launch, warm forkserver",
                statistics.median(warm),
                s,
                "<= 0.3 s" if world_size == 4 else "",
            ),
            (world_size, "Pool.run re-run", statistics.median(reruns), s, "<= 20 ms"),
        ]
    print(f"\n{'ranks':>5}  {'what':<30} {'median':>10}  {'spawn / this':>12}  target")
    for world_size, what, t, s, target in rows:
        met = ""
        if target:
            limit = 0.3 if "0.3" in target else 0.020
            met = "met" if t <= limit and s / t >= 10 else "MISSED"
            met = f"{target}, >= 10x: {met}"
        print(f"{world_size:>5}  {what:<30} {t * 1e3:>8.1f} ms  {s / t:>11.1f}x  {met}")


if __name__ == "__main__":
    main()
