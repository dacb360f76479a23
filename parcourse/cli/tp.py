"""`python -m parcourse tp`: train the GPT split over ranks; per-rank bytes and
collectives against the formulas, the loss beside one process's."""

from __future__ import annotations

import argparse

from parcourse.cli.options import at_least_one, ranks, ranks_option
from parcourse.launch import launch
from parcourse.models import GPTConfig

HELP = (
    "tensor parallelism: train a tiny GPT split over ranks; bytes and collectives vs the formulas"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    ranks_option(p, 2)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split LayerNorm, dropout and residual along the sequence",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32, help="tokens per sequence")


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab=args.vocab,
        block_size=args.block_size,
        n_layers=args.layers,
        n_heads=args.heads,
        d_model=args.width,
    )


def check(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, before any rank starts (None: they can)."""
    if problem := at_least_one(args, "world_size", "steps", "width", "batch", "layers"):
        return problem
    world_size = ranks(args).world_size
    try:
        config = _config(args)
    except ValueError as e:
        return str(e)
    if config.n_heads % world_size:
        return f"--heads ({config.n_heads}) must be divisible by --world-size ({world_size})"
    if args.sequence_parallel and config.block_size % world_size:
        return (
            f"--block-size ({config.block_size}) must be divisible by --world-size "
            f"({world_size}) under --sequence-parallel"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Train the GPT split over ranks; per-rank bytes and collectives against the
    formulas, the loss beside one process's."""
    from parcourse.experiments.tensor_parallel import one_process_losses, train
    from parcourse.memory import format_bytes
    from parcourse.models import gpt, param_count
    from parcourse.theory import tp_collective_counts, tp_ring_bytes_sent

    where = ranks(args)
    world_size = where.world_size
    config = _config(args)
    trained = launch(
        train,
        world_size,
        config,
        args.steps,
        args.batch,
        sequence_parallel=args.sequence_parallel,
        timeout=args.timeout,
    )
    if where.quiet:
        return 0
    first = trained.results[0]
    how = "sequence parallel" if args.sequence_parallel else "tensor parallel"
    print(
        f"tp          {world_size} ranks, {how}, backend {trained.backend}, collectives: "
        f"{first['algorithm']}"
    )
    print(
        f"model       GPT, {config.n_layers} layers, d_model {config.d_model}, "
        f"{config.n_heads} heads, vocab {config.vocab}, {config.block_size} tokens "
        f"({param_count(gpt(config)):,} parameters); batch {args.batch}, Adam, fp32"
    )
    print("\nper rank, measured / formula (activations: what one forward keeps for backward)")
    for rank, r in enumerate(trained.results):
        for what, label in (("param_bytes", "parameters "), ("activation_bytes", "activations")):
            got, want = r[what], r["theory"][what]
            print(
                f"  rank {rank:<3} {label} {format_bytes(got):>10}   formula "
                f"{format_bytes(want):>10}   measured / formula {got / want:.3f}"
            )
    counts = tp_collective_counts(first["collectives"])
    theory = tp_collective_counts(first["theory"]["collectives"])
    same = all(r["collectives"] == r["theory"]["collectives"] for r in trained.results)
    print(
        f"\ncollectives per step: {'as the formula' if same else 'NOT as the formula'} "
        "(each rank; bytes of the whole tensors)"
    )
    for (op, phase), (n, size) in counts.items():
        n_theory, size_theory = theory.get((op, phase), (0, 0))
        print(
            f"  {op:<15}{phase:<9}{n:>4} x  {format_bytes(size):>10}   formula {n_theory:>3} x "
            f"{format_bytes(size_theory):>10}"
        )
    if first["algorithm"] == "ring":
        sent = tp_ring_bytes_sent(first["theory"]["collectives"], world_size)
        print(
            f"  sent per rank (ring, counted message by message): {first['bytes_sent']:,.0f} B;"
            f" formula {sent:,.0f} B"
        )
    reference = one_process_losses(config, args.steps, args.batch)
    print(f"\nloss        step   {world_size} ranks    one process")
    for step, (ours, one) in enumerate(zip(first["losses"], reference)):
        print(f"            {step:>4}   {ours:>8.4f}    {one:>8.4f}")
    return 0
