"""`python -m parcourse ddp`: time training steps under one data-parallel implementation."""

from __future__ import annotations

import argparse
import statistics

from parcourse.cli.options import at_least_one, link_options, ranks, ranks_option
from parcourse.launch import launch

HELP = "time data-parallel training: naive, bucketed, torch"


def add_arguments(p: argparse.ArgumentParser) -> None:
    ranks_option(p, 2)
    link_options(p)
    p.add_argument("--impl", choices=("naive", "bucketed", "torch"), default="bucketed")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--no-overlap", action="store_true", help="start buckets after backward")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=256, help="global batch, split over ranks")


def check(args: argparse.Namespace) -> str | None:
    if problem := at_least_one(args, "world_size", "steps", "width", "depth", "batch"):
        return problem
    if args.bucket_mb <= 0:
        return "--bucket-mb must be > 0"
    if args.impl == "torch" and (args.latency_us or args.bandwidth_gbps):
        return "torch's DDP cannot use the simulated link; use --impl naive or bucketed"
    return None


def run(args: argparse.Namespace) -> int:
    """Time training steps under one data-parallel implementation."""
    from parcourse.experiments.data_parallel import train_steps

    where = ranks(args)
    world_size = where.world_size
    trained = launch(
        train_steps,
        world_size,
        args.impl,
        args.steps + 1,
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        bucket_mb=args.bucket_mb,
        overlap=not args.no_overlap,
        latency_us=args.latency_us,
        bandwidth_gbps=args.bandwidth_gbps,
        traced=False,
        timeout=args.timeout,
    )
    if where.quiet:
        return 0
    # Each step lasts as long as its slowest rank; the first step warms up.
    steps = [max(ts) for ts in zip(*(r["step_s"] for r in trained.results))][1:]
    first = trained.results[0]
    print(
        f"ddp         {args.impl}, {world_size} ranks, backend {trained.backend}, "
        f"MLP {args.depth} x {args.width} ({first['params'] / 1e6:.2f} M parameters, "
        f"{first['params'] * 4 / 2**20:.1f} MiB of gradients)"
    )
    overlap = "off" if args.no_overlap else "on"
    print(
        f"buckets     {args.bucket_mb:g} MB, overlap {overlap}"
        if args.impl != "naive"
        else "buckets     none: one all-reduce per parameter, after backward"
    )
    if args.latency_us or args.bandwidth_gbps:
        print(f"link        simulated: {args.latency_us:g} us, {args.bandwidth_gbps or 'inf'} GB/s")
    print(f"step time   {statistics.median(steps) * 1e3:.1f} ms (median of {len(steps)})")
    print(f"loss        {first['loss'][0]:.4f} -> {first['loss'][-1]:.4f}")
    return 0
