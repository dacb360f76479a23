"""`python -m parcourse checkpoint`: peak saved activations and step time of a chain of
layers under a checkpointing policy, against theory (one process)."""

from __future__ import annotations

import argparse

import torch

from parcourse.cli.options import at_least_one

HELP = "activation checkpointing: memory and time of a chain of layers under a policy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=64)
    p.add_argument(
        "--policy",
        choices=("none", "sqrt", "every", "nothing"),
        default="sqrt",
        help="keep everything, sqrt(n) segments, every layer, or only the input",
    )
    p.add_argument("--segments", type=int, default=None, help="segments for --policy sqrt")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)


def check(args: argparse.Namespace) -> str | None:
    if problem := at_least_one(args, "repeats", "width", "batch", "layers"):
        return problem
    if args.segments is not None and not 1 <= args.segments <= args.layers:
        return f"--segments must be between 1 and --layers ({args.layers})"
    return None


def run(args: argparse.Namespace) -> int:
    """Peak saved activations and step time of a chain of layers under a policy, vs theory."""
    from parcourse.experiments.checkpointing import measure_policy
    from parcourse.memory import format_bytes

    torch.set_num_threads(1)
    r = measure_policy(
        args.layers,
        args.policy,
        width=args.width,
        batch=args.batch,
        segments=args.segments,
        repeats=args.repeats,
    )
    one = r["activation_bytes"]
    print(
        f"checkpoint  {args.layers} layers Linear({args.width}) + Tanh, batch {args.batch}, "
        f"policy {args.policy}"
    )
    print(
        f"peak saved  {format_bytes(r['peak_bytes'])} = {r['peak_bytes'] / one:.0f} layer "
        f"outputs (theory {r['theory_bytes'] / one:.0f})"
    )
    print(
        f"step time   {r['step_s'] * 1e3:.1f} ms (median of {args.repeats}); backward "
        f"recomputes {r['extra_forwards']} layer forwards (theory)"
    )
    return 0
