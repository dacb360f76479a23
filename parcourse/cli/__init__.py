"""`python -m parcourse COMMAND`: what a workshop runs from a terminal.

One module per command, each owning its arguments (`add_arguments`), its checks, made
before any rank starts (`check`, an error message or None), and its run (`run`). Every
command also runs under torchrun, e.g. `torchrun --nproc-per-node 2 -m parcourse doctor`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from parcourse.cli import (
    allreduce,
    checkpoint,
    ddp,
    doctor,
    mesh,
    pipeline,
    plan,
    roofline,
    tp,
    train,
    train3d,
    zero,
)
from parcourse.cli.classroom import BuildStudent, Grade
from parcourse.cli.options import parse_count, parse_size

# The order `--help` lists them in.
COMMANDS: dict[str, Any] = {
    "doctor": doctor,
    "allreduce": allreduce,
    "ddp": ddp,
    "zero": zero,
    "checkpoint": checkpoint,
    "pipeline": pipeline,
    "tp": tp,
    "mesh": mesh,
    "train3d": train3d,
    "plan": plan,
    "roofline": roofline,
    "train": train,
    "build-student": BuildStudent,
    "grade": Grade,
}

__all__ = ["COMMANDS", "build_parser", "main", "parse_count", "parse_size"]


def build_parser() -> argparse.ArgumentParser:
    """`python -m parcourse`'s parser: one subcommand per module of parcourse.cli, each
    adding its own arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m parcourse",
        description="parcourse: distributed training, built from scratch and measured.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = commands.add_parser(name, help=command.HELP)
        command.add_arguments(p)
        p.set_defaults(command_module=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `python -m parcourse ARGV` (the command line's words, default sys.argv): bad
    input is refused in one line before any rank starts; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command_module
    if problem := command.check(args):
        parser.error(problem)
    return command.run(args)
