"""`python -m parcourse COMMAND`: what a workshop runs from a terminal.

Every command also runs under torchrun, e.g.
`torchrun --nproc-per-node 2 -m parcourse doctor`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from parcourse.launch import Pool, RankContext, _external_env, launch


_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "KIB": 1 << 10, "MB": 1 << 20, "MIB": 1 << 20,
          "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'64MB' -> 67108864. Sizes are binary (1 KB = 1024 B), as memory is counted."""
    number = text.strip().upper().rstrip("B") + ("B" if text.strip().upper().endswith("B") else "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if unit and number.endswith(unit):
            value = number[: -len(unit)]
            break
    else:
        unit, value = "", number
    try:
        size = int(float(value) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"cannot read a size from {text!r}; try 4KB, 64MB or 1GB") from None
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def _smoke_all_reduce(ctx: RankContext) -> float:
    t = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    with ctx.tracer.span("all_reduce", kind="comm"):
        dist.all_reduce(t, group=ctx.group)
    return t[0].item()


def doctor(args: argparse.Namespace) -> int:
    """Print versions, backends, cores and GPUs; run a 2-rank all_reduce."""
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"torch       {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    print(f"platform    {platform.platform()}")
    print(f"cpu cores   {os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"gpus        {gpus}{' - ' + ', '.join(names) if names else ''}")
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()),
                                ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    print(f"backends    {', '.join(backends) or 'none'}")
    external = _external_env()
    world_size = external[1] if external else args.world_size
    expected = world_size * (world_size + 1) / 2
    t0 = time.perf_counter()
    run = launch(_smoke_all_reduce, world_size, timeout=120)
    cold = time.perf_counter() - t0
    ok = all(r == expected for r in run.results)
    where = "under an external launcher" if external else "launched here"
    print(f"all_reduce  {world_size} ranks {where}, backend {run.backend}: "
          f"{'OK' if ok else 'WRONG ' + str(run.results)} in {cold * 1e3:.0f} ms (with start-up)")
    if not external:
        with Pool(world_size) as pool:
            pool.run(_smoke_all_reduce)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                pool.run(_smoke_all_reduce)
                times.append(time.perf_counter() - t0)
        print(f"warm pool   re-run {sorted(times)[2] * 1e3:.1f} ms (median of 5)")
    print("doctor      " + ("all good" if ok else "FAILED"))
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parcourse",
        description="parcourse: distributed training, built from scratch and measured.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = commands.add_parser("doctor", help="check this machine: versions, backends, a 2-rank run")
    p.add_argument("--world-size", type=int, default=2, help="ranks for the smoke run (2)")
    p.set_defaults(func=doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "world_size", 1) < 1:
        parser.error("--world-size must be >= 1")
    return args.func(args)
