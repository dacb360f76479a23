"""`python -m parcourse pipeline`: a schedule's grid, its simulated and measured bubble
beside the formula, and the peak in-flight microbatches, from a real run of an MLP or a
GPT cut into stages."""

from __future__ import annotations

import argparse

from parcourse.cli.options import at_least_one, link_options
from parcourse.launch import launch
from parcourse.pipeline.schedule import SCHEDULES

HELP = "a pipeline schedule: grid, bubble vs formula, in-flight microbatches, measured"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="gpipe")
    p.add_argument(
        "--stages",
        type=int,
        default=4,
        help="ranks ("
        + "; ".join(
            f"{n}: {'--chunks' if e.chunks is None else e.chunks} stages each"
            for n, e in SCHEDULES.items()
            if e.chunks != 1
        )
        + ")",
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=2,
        help="stages per rank for "
        + ", ".join(n for n, e in SCHEDULES.items() if e.chunks is None),
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument(
        "--layers",
        type=int,
        default=8,
        help="layers cut into stages (gpt: embedding, layers - 2 blocks, head)",
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--forward-ms",
        type=float,
        default=20.0,
        help="simulated forward time of one rank's layers (0 with --backward-ms 0: real compute)",
    )
    p.add_argument("--backward-ms", type=float, default=40.0)
    p.add_argument(
        "--weight-ms",
        type=float,
        default=None,
        help="W's part of --backward-ms when a schedule splits it (default: half)",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    link_options(p)


def check(args: argparse.Namespace) -> str | None:
    if problem := at_least_one(args, "batch", "layers"):
        return problem
    if args.stages < 1 or args.microbatches < 1:
        return "--stages and --microbatches must be >= 1"
    if args.stages > args.layers:
        return f"{args.stages} stages need at least {args.stages} layers (--layers)"
    if args.batch % (args.microbatches if SCHEDULES[args.schedule].microbatched else 1):
        return f"{args.microbatches} microbatches do not divide --batch {args.batch}"
    return None


def _formula(
    name: str, p: int, m: int, chunks: int, f: float, b: float, w: float
) -> tuple[str, float | None]:
    """(the formula's text, its bubble) for a schedule; None where none applies."""
    entry = SCHEDULES[name]
    return entry.formula, None if entry.bubble is None else entry.bubble(p, m, chunks, f, b, w)


def run(args: argparse.Namespace) -> int:
    """A schedule's grid, its simulated and measured bubble beside the formula, and the
    peak in-flight microbatches, from a real run of an MLP or a GPT cut into stages."""
    from parcourse.experiments.pipeline import bubble_of, make_schedule, train
    from parcourse.pipeline import Costs, simulate

    p, m = args.stages, args.microbatches
    try:  # bad sizes are refused here, before any process starts
        schedule = make_schedule(args.schedule, p, m, args.chunks)
    except ValueError as e:
        raise SystemExit(f"pipeline: {e}") from None
    layers = args.layers
    if schedule.model_stages > layers:
        raise SystemExit(
            f"pipeline: {schedule.name} on {p} ranks has "
            f"{schedule.model_stages} stages; "
            f"--layers {layers} cannot fill them"
        )
    if args.batch % schedule.microbatches:
        raise SystemExit(
            f"pipeline: {schedule.microbatches} microbatches do not divide --batch {args.batch}"
        )
    m = schedule.microbatches  # naive runs one
    per_rank = schedule.model_stages // p
    weight_ms = args.backward_ms / 2 if args.weight_ms is None else args.weight_ms
    f, b, w = args.forward_ms / 1e3, args.backward_ms / 1e3, weight_ms / 1e3
    predicted = simulate(
        schedule, Costs(forward=f / per_rank, backward=b / per_rank, weight=w / per_rank)
    )
    simulated = bool(f or b)
    trained = launch(
        train,
        p,
        schedule,
        1,
        model=args.model,
        depth=layers,
        batch=args.batch,
        forward_ms=args.forward_ms,
        backward_ms=args.backward_ms,
        weight_ms=weight_ms,
        latency_us=args.latency_us,
        bandwidth_gbps=args.bandwidth_gbps,
        timeout=args.timeout,
    )
    print(
        f"pipeline    {schedule.name}, {p} ranks, {schedule.stages} stages, {m} microbatches, "
        f"{args.model} of {layers} layers, backend {trained.backend}"
    )
    print(schedule)
    text, formula = _formula(args.schedule, p, m, args.chunks, f, b, w)
    shown = f"{formula:.3f}" if formula is not None else ""
    print(
        f"\nbubble      formula {text} {shown}   simulated {predicted.bubble:.3f}   "
        f"measured {bubble_of(trained):.3f}"
        + ("" if simulated else "   (real compute: ranks share cores)")
    )
    print(f"messages    between ranks per step (simulated): {predicted.messages}")
    print(
        f"in flight   peak microbatches per rank (simulated; per stage, a stage being "
        f"1/{per_rank} of a rank's layers): {predicted.peak_in_flight}"
    )
    for rank, result in enumerate(trained.results):
        print(
            f"  rank {rank}    peak in-flight activations {result['peak_in_flight_bytes']:,.0f} B"
        )
    return 0
