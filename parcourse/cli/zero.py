"""`python -m parcourse zero`: bytes per rank by category under a ZeRO stage, measured
against the formula, and the bytes each rank sent in a step against data parallelism's."""

from __future__ import annotations

import argparse

from parcourse.cli.options import at_least_one, parse_count, ranks, ranks_option
from parcourse.launch import launch
from parcourse.theory import bytes_sent_per_rank

HELP = "memory per rank under ZeRO stages 0-3 vs the formula"


def add_arguments(p: argparse.ArgumentParser) -> None:
    ranks_option(p, 4)
    p.add_argument(
        "--stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=3,
        help="0: plain data parallel; 1: optimizer state, 2: + gradients, 3: + parameters sharded",
    )
    p.add_argument("--params", default="10M", help="model size, e.g. 500k, 10M (10M)")
    p.add_argument("--depth", type=int, default=4, help="layers of the MLP")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=25.0)


def check(args: argparse.Namespace) -> str | None:
    if problem := at_least_one(args, "world_size", "depth", "batch"):
        return problem
    if args.bucket_mb <= 0:
        return "--bucket-mb must be > 0"
    try:
        parse_count(args.params)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    """Bytes per rank by category under a ZeRO stage, measured against the formula,
    and the bytes each rank sent in a step against data parallelism's."""
    from parcourse.experiments.zero import measured_over_formula, memory_by_stage
    from parcourse.memory import format_bytes

    where = ranks(args)
    world_size = where.world_size
    measured = launch(
        memory_by_stage,
        world_size,
        args.stage,
        parse_count(args.params),
        depth=args.depth,
        batch=args.batch,
        bucket_mb=args.bucket_mb,
        timeout=args.timeout,
    )
    if where.quiet:
        return 0
    result = measured.results[0]
    print(
        f"zero        stage {args.stage}, {world_size} ranks, backend {measured.backend}, "
        f"{result['params'] / 1e6:.2f} M parameters, Adam, fp32"
    )
    theory = result["theory"]
    columns = ("params", "grads", "optimizer", "activations", "other")
    header = "".join(f"{c:>12}" for c in columns)
    for label in ("after forward", "peak in backward", "after step"):
        print(f"\n{label}, per rank:{header}")
        for rank, sample in sorted(measured.trace.memory_at(label).items()):
            cells = "".join(f"{format_bytes(sample.bytes[c]):>12}" for c in columns)
            print(f"  rank {rank:<13}{cells}")
    print(
        f"\ntheory, per rank:{''.join(f'{format_bytes(theory[c]):>12}' for c in theory)}"
        "   (params, grads, optimizer)"
    )
    for c, (mean, largest) in measured_over_formula(measured).items():
        print(
            f"  {c:<10} measured / formula {result['checked_at'][c]}: {mean:.3f} "
            f"(largest rank {largest:.3f})"
        )
    if world_size == 1:
        print("\none rank: nothing to communicate, nothing to shard")
    elif result["bytes_sent"] is not None:
        ddp = bytes_sent_per_rank("ring", result["params"] * 4, world_size)
        print(
            "\nsent in one step (counted message by message), per rank, against data "
            "parallelism's ring all-reduce of the gradients, 2(N-1)/N x S:"
        )
        for rank, r in enumerate(measured.results):
            print(
                f"  rank {rank:<4}{r['bytes_sent']:>14,.0f} B   / DDP's {ddp:,.0f} B = "
                f"{r['bytes_sent'] / ddp:.3f}"
            )
    return 0
