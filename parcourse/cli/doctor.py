"""`python -m parcourse doctor`: versions, backends, cores and GPUs; a 2-rank all_reduce."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from parcourse.cli.options import at_least_one, ranks
from parcourse.launch import Pool, RankContext, launch, usable_cpus

HELP = "check this machine: versions, backends, a 2-rank run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks for the smoke run (2)")
    p.add_argument(
        "--class",
        dest="students",
        type=int,
        default=None,
        metavar="N",
        help="also size a class server for N students (cores, memory, sockets, "
        "from the lessons' measured peaks) and check this machine against it",
    )


def check(args: argparse.Namespace) -> str | None:
    if args.students is not None and args.students < 1:
        return f"--class needs 1 student or more, got {args.students}"
    return at_least_one(args, "world_size")


def _smoke_all_reduce(ctx: RankContext) -> float:
    t = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    with ctx.tracer.span("all_reduce", kind="comm"):
        dist.all_reduce(t, group=ctx.group)
    return t[0].item()


def run(args: argparse.Namespace) -> int:
    """Print versions, backends, cores and GPUs; run a 2-rank all_reduce."""
    where = ranks(args)

    def say(line: str) -> None:
        if not where.quiet:  # under torchrun, rank 0 reports
            print(line)

    say(f"python      {platform.python_version()} ({sys.executable})")
    say(f"torch       {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    say(f"platform    {platform.platform()}")
    say(f"cpu cores   {os.cpu_count()} (usable here: {usable_cpus()}: affinity and cgroup quota)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    say(f"gpus        {gpus}{' - ' + ', '.join(names) if names else ''}")
    backends = [
        b
        for b, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    say(f"backends    {', '.join(backends) or 'none'}")
    world_size = where.world_size
    expected = world_size * (world_size + 1) / 2
    t0 = time.perf_counter()
    smoke = launch(_smoke_all_reduce, world_size, timeout=120)
    cold = time.perf_counter() - t0
    ok = all(r == expected for r in smoke.results)
    how = "under an external launcher" if where.external else "launched here"
    say(
        f"all_reduce  {world_size} ranks {how}, backend {smoke.backend}: "
        f"{'OK' if ok else 'WRONG ' + str(smoke.results)} in {cold * 1e3:.0f} ms (with start-up)"
    )
    if not where.external:
        with Pool(world_size) as pool:
            pool.run(_smoke_all_reduce)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                pool.run(_smoke_all_reduce)
                times.append(time.perf_counter() - t0)
        say(f"warm pool   re-run {statistics.median(times) * 1e3:.1f} ms (median of 5)")
    if args.students is not None:
        from parcourse.classroom import class_sizing

        text, enough = class_sizing(args.students)
        say(f"class       {args.students} students")
        say(text)
        ok = ok and enough
    say("doctor      " + ("all good" if ok else "FAILED"))
    return 0 if ok else 1
