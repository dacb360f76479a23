"""`python -m parcourse allreduce`: time one all-reduce algorithm; time, algbw, busbw and
the bytes each rank sent against theory."""

from __future__ import annotations

import argparse

import torch

from parcourse.cli.options import at_least_one, link_options, parse_size, ranks, ranks_option
from parcourse.comm import SimulatedLink, simulated_link
from parcourse.experiments.all_reduce import all_reduce_with, time_all_reduce
from parcourse.experiments.timing import median_of_slowest
from parcourse.launch import RankContext, launch
from parcourse.theory import CostModel, bus_bandwidth, bytes_sent_per_rank

HELP = "time ring, naive or torch all-reduce"


def add_arguments(p: argparse.ArgumentParser) -> None:
    ranks_option(p, 2)
    link_options(p)
    p.add_argument("--size", default="64MB", help="tensor size, e.g. 4KB, 64MB (64MB)")
    p.add_argument("--algo", choices=("ring", "naive", "torch"), default="ring")
    p.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16", "int64"), default="float32"
    )
    p.add_argument("--repeats", type=int, default=10)


def check(args: argparse.Namespace) -> str | None:
    if problem := at_least_one(args, "world_size", "repeats"):
        return problem
    try:
        parse_size(args.size)
    except ValueError as e:
        return str(e)
    return None


def _traced_then_timed(
    ctx: RankContext, algo: str, nbytes: int, dtype: str, repeats: int, link: SimulatedLink | None
) -> dict[str, object]:
    """One traced all-reduce (its bytes), then `repeats` timed ones."""
    t = torch.ones(
        nbytes // getattr(torch, dtype).itemsize, dtype=getattr(torch, dtype), device=ctx.device
    )
    all_reduce_with(algo, t, ctx, link=link, traced=True)  # type: ignore[arg-type]  # argparse's choices
    return {
        "bytes_sent": ctx.tracer.total("bytes_sent"),
        "times": time_all_reduce(ctx, [algo], [nbytes], repeats, dtype, link),
    }


def run(args: argparse.Namespace) -> int:
    """Time one all-reduce algorithm; print time, algbw, busbw and bytes against theory."""
    where = ranks(args)
    world_size = where.world_size
    dtype = getattr(torch, args.dtype)
    nbytes = parse_size(args.size)
    numel = max(1, nbytes // dtype.itemsize)
    nbytes = numel * dtype.itemsize
    link = simulated_link(args.latency_us, args.bandwidth_gbps)
    timed = launch(
        _traced_then_timed,
        world_size,
        args.algo,
        nbytes,
        args.dtype,
        args.repeats,
        link,
        timeout=args.timeout,
    )
    if where.quiet:
        return 0  # every rank has the results; rank 0 prints them
    t = median_of_slowest([r["times"] for r in timed.results], (args.algo, nbytes))
    algbw, busbw = bus_bandwidth(nbytes, t, world_size)
    print(
        f"all-reduce  {args.algo}, {world_size} ranks, backend {timed.backend}, "
        f"{nbytes / 2**20:g} MiB of {args.dtype}, median of {args.repeats}"
    )
    on_link = ""
    if link is not None:
        on_link = (
            f" (simulated link: {link.latency_s * 1e6:g} us, {link.bandwidth_Bps / 1e9:g} GB/s)"
        )
    print(f"time        {t * 1e3:.3f} ms{on_link}")
    if link is not None and args.algo != "torch":
        model = CostModel(link.latency_s, link.bandwidth_Bps).all_reduce_s(
            args.algo, nbytes, world_size
        )
        print(
            f"model       {model * 1e3:.3f} ms   (alpha-beta: the link's time; the time above "
            "also holds this machine's own)"
        )
    print(f"algbw       {algbw / 1e9:.3f} GB/s   (size / time)")
    print(f"busbw       {busbw / 1e9:.3f} GB/s   (algbw x 2(N-1)/N)")
    if args.algo != "torch":
        for rank, r in enumerate(timed.results):
            theory = bytes_sent_per_rank(
                args.algo, nbytes, world_size, rank, itemsize=dtype.itemsize
            )
            print(f"rank {rank}      sent {r['bytes_sent']:.0f} B (theory {theory:.0f} B)")
    return 0
