"""`python -m parcourse allreduce`: time one all-reduce algorithm; time, algbw, busbw and
the bytes each rank sent against theory."""

from __future__ import annotations

import argparse

import torch

from parcourse.cli.options import at_least_one, link_options, parse_size, ranks, ranks_option
from parcourse.comm import SimulatedLink, Topology, simulated_link
from parcourse.experiments.all_reduce import all_reduce_with, over_two_levels, time_all_reduce
from parcourse.experiments.timing import median_of_slowest
from parcourse.launch import RankContext, launch
from parcourse.theory import (
    CostModel,
    bus_bandwidth,
    bytes_sent_per_rank,
    flat_ring_bytes_across,
    hierarchical_bytes,
)

HELP = "time ring, naive, hierarchical or torch all-reduce"


def add_arguments(p: argparse.ArgumentParser) -> None:
    ranks_option(p, 2)
    link_options(p)
    p.add_argument("--size", default="64MB", help="tensor size, e.g. 4KB, 64MB (64MB)")
    p.add_argument("--algo", choices=("ring", "naive", "torch", "hierarchical"), default="ring")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        metavar="N",
        help="run on the two-level simulated network (Topology.of(N): consecutive ranks a "
        "node) beside the flat ring, printing the bytes inside and across nodes; "
        "--algo hierarchical needs it",
    )
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
    n = args.ranks_per_node
    if args.algo == "hierarchical" and n is None:
        return "--algo hierarchical needs --ranks-per-node (its nodes)"
    if n is not None and (n < 1 or args.world_size % n):
        return f"--ranks-per-node {n} must be >= 1 and divide --world-size {args.world_size}"
    if n is not None and (args.latency_us or args.bandwidth_gbps):
        return (
            "--ranks-per-node sets the links (Topology.of): "
            "leave out --latency-us and --bandwidth-gbps"
        )
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


def two_levels(args: argparse.Namespace, world_size: int, nbytes: int) -> int:
    """The algorithm beside the flat ring on a two-level network: time, and the bytes
    inside and across nodes against theory."""
    network = Topology.of(args.ranks_per_node)
    algos = list(dict.fromkeys([args.algo, "ring"]))
    itemsize = getattr(torch, args.dtype).itemsize
    done = launch(
        over_two_levels,
        world_size,
        algos,
        nbytes,
        args.dtype,
        args.repeats,
        network,
        timeout=args.timeout,
    )
    n, (inside, between) = args.ranks_per_node, (network.inside, network.between)
    print(
        f"all-reduce on two levels: {world_size} ranks, {n} a node; inside "
        f"{inside.latency_s * 1e6:g} us, {inside.bandwidth_Bps / 1e9:g} GB/s; between nodes "
        f"{between.latency_s * 1e6:g} us, {between.bandwidth_Bps / 1e9:g} GB/s; "
        f"{nbytes / 2**20:g} MiB of {args.dtype}, median of {args.repeats}"
    )
    print(
        f"{'algorithm':<13} {'time ms':>9} {'inside, a rank':>15} {'across, a rank':>15} "
        f"{'across, a node':>15} {'theory across':>14}"
    )
    for algo in algos:
        t = median_of_slowest([r["times"] for r in done.results], (algo, nbytes))
        levels = [r["levels"][algo] for r in done.results]
        if algo == "hierarchical":
            theory = max(
                hierarchical_bytes(nbytes, world_size, n, r, itemsize)[1] for r in range(world_size)
            )
        elif algo == "ring":
            theory = max(
                flat_ring_bytes_across(nbytes, world_size, n, r, itemsize)
                for r in range(world_size)
            )
        else:
            theory = float("nan")
        node0 = sum(across for _, across in levels[:n])
        print(
            f"{algo:<13} {t * 1e3:9.2f} {max(i for i, _ in levels):15.0f} "
            f"{max(a for _, a in levels):15.0f} {node0:15.0f} {theory:14.0f}"
        )
    print(
        "(bytes sent, the most of any rank; 'across, a node' is what node 0's ranks send to "
        "other nodes; theory: the most a rank sends across)"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Time one all-reduce algorithm; print time, algbw, busbw and bytes against theory."""
    where = ranks(args)
    world_size = where.world_size
    dtype = getattr(torch, args.dtype)
    nbytes = parse_size(args.size)
    numel = max(1, nbytes // dtype.itemsize)
    nbytes = numel * dtype.itemsize
    if args.ranks_per_node is not None:
        return 0 if where.quiet else two_levels(args, world_size, nbytes)
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
