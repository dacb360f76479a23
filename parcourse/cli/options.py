"""What several commands share: sizes and counts read from text, the options for ranks
and for a simulated link, and the world size under an external launcher."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from parcourse.launch import external_env
from parcourse.mesh import ORDERS
from parcourse.pipeline.schedule import SCHEDULES
from parcourse.plan import ZERO_STAGES, ParallelPlan

_UNITS = {
    "B": 1,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """'64MB' -> 67108864. Binary units (1 KB = 1024 B), as memory is counted; a bare
    number is bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(f"cannot read a size from {text!r}; try 4KB, 64MB or 1GB")
    size = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def parse_count(text: str) -> int:
    """'10M' -> 10_000_000, '500k' -> 500_000: decimal, as parameter counts are given."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBgG]?)\s*", text)
    if match is None:
        raise ValueError(f"cannot read a count from {text!r}; try 500k, 10M or 1B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}[match.group(2).upper()]
    count = int(float(match.group(1)) * scale)
    if count <= 0:
        raise ValueError(f"count must be positive, got {text!r}")
    return count


def ranks_option(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument(
        "--world-size",
        type=int,
        default=default,
        help=f"ranks ({default}; under torchrun, the launcher's)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")


def link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency-us", type=float, default=0.0, help="simulated link latency")
    p.add_argument(
        "--bandwidth-gbps", type=float, default=None, help="simulated link bandwidth in GB/s"
    )


def at_least_one(args: argparse.Namespace, *names: str) -> str | None:
    """The first of these options below 1, as an error message (None: all are >= 1)."""
    for name in names:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    return None


@dataclass(frozen=True)
class Ranks:
    """Where a command's ranks come from."""

    world_size: int
    external: bool  # started by torchrun or Slurm, not launched here
    quiet: bool  # a rank other than 0 of an external launcher: rank 0 prints


def ranks(args: argparse.Namespace) -> Ranks:
    """The world size: the external launcher's, or --world-size."""
    external = external_env()
    if external is None:
        return Ranks(args.world_size, external=False, quiet=False)
    return Ranks(external[1], external=True, quiet=external[0] != 0)


def mesh_against_launcher(plan: ParallelPlan) -> str | None:
    """Under torchrun or Slurm the launcher has already set the world size: a mesh of
    another size is refused here, in one line, rather than in every rank after the start
    (and again after each of torchrun's restarts)."""
    external = external_env()
    if external is None or plan.gpus == external[1]:
        return None
    axes = [a for a, n in plan.shape.items() if n > 1 or a in ("dp", "tp", "pp")]
    sizes = " x ".join(f"{a} {plan.shape[a]}" for a in axes)
    flags = ", ".join(f"--{a}" for a in axes[:-1]) + f" and --{axes[-1]}"
    return (
        f"the mesh {sizes} needs {plan.gpus} ranks, but the launcher started "
        f"{external[1]}: give {flags} whose product is {external[1]}"
    )


def plan_options(
    p: argparse.ArgumentParser, defaults: ParallelPlan, fields: Sequence[str] | None = None
) -> None:
    """`--plan LABEL` and one flag for each of the plan's `fields` (all by default), made
    from the dataclass' fields and types; `plan_from` reads them back."""
    hints = typing.get_type_hints(ParallelPlan)
    helps = {f.name: f.metadata.get("help", f.name) for f in dataclasses.fields(ParallelPlan)}
    names = list(helps)
    fields = names if fields is None else list(fields)
    p.add_argument(
        "--plan",
        default=None,
        metavar="LABEL",
        help=f'the whole plan in one line (e.g. "{defaults.label()}"), instead '
        f"of --{' --'.join(f.replace('_', '-') for f in fields)}",
    )
    for name in fields:
        kind, default = hints[name], getattr(defaults, name)
        flag = f"--{name.replace('_', '-')}"
        what = f"{helps[name]} ({default})"  # what the field means, from the plan
        if name == "dp":
            what += "; -1: what the launcher's world leaves (an elastic job's)"
        if kind is bool:
            p.add_argument(flag, action="store_true", default=None, help=what)
            continue
        # The choices are shown, not enforced by argparse: the plan's `problems()` refuses
        # a wrong one in the same words as everywhere else.
        options: dict[str, Any] = {"default": None, "help": what}
        choices = (
            typing.get_args(kind)
            if typing.get_origin(kind) is Literal
            else tuple(SCHEDULES)
            if name == "schedule"
            else ZERO_STAGES
            if name == "zero"
            else (*ORDERS, "a,b,..")
            if name == "order"
            else None
        )
        if choices is not None:
            options["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        if kind is int or name in ("zero", "ranks_per_node"):
            options["type"] = int
        p.add_argument(flag, **options)
    p.set_defaults(plan_defaults=defaults, plan_fields=tuple(fields))


def _launchers_node() -> int | None:
    """Under torchrun or Slurm across several nodes, the ranks each node holds (torchrun's
    local world size, Slurm's tasks per node: each numbers a node's ranks one after
    another, Slurm by its default block distribution); None on one node or none."""
    env, external = os.environ, external_env()
    local = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE")
    if external is None or local is None or not local.isdigit() or int(local) >= external[1]:
        return None
    return int(local)


def _dp_from_the_launcher(plan: ParallelPlan) -> int | str:
    """dp -1 (torchtitan's convention): the ranks the launcher started, over the other
    axes' product; what an elastic job (`torchrun --nnodes 1:2`) needs to fit whatever
    world a restart brings. A message where it cannot be read."""
    external = external_env()
    if external is None:
        return "--dp -1 takes dp from the launcher's world (torchrun, Slurm); give dp here"
    others = dataclasses.replace(plan, dp=1).gpus
    if external[1] % others:
        return (
            f"--dp -1: the launcher's {external[1]} ranks do not divide by the other axes' {others}"
        )
    return external[1] // others


def plan_from(args: argparse.Namespace) -> ParallelPlan | str:
    """The plan the flags (or `--plan`) give, also set on `args` field by field (so
    `args.dp` is the plan's dp); a message if they cannot be read or disagree."""
    defaults: ParallelPlan = args.plan_defaults
    given = {f: getattr(args, f) for f in args.plan_fields if getattr(args, f) is not None}
    if args.plan is not None:
        if given:
            return (
                f"--plan gives the whole layout: leave out "
                f"{', '.join('--' + f.replace('_', '-') for f in given)} or --plan"
            )
        try:
            plan = ParallelPlan.parse(args.plan)
        except ValueError as e:
            return str(e)
        fixed = [
            f.name
            for f in dataclasses.fields(ParallelPlan)
            if f.name not in args.plan_fields and getattr(plan, f.name) != getattr(defaults, f.name)
        ]
        if fixed:
            return (
                f"--plan {args.plan!r}: this command does not set "
                f"{', '.join(fixed)} (only {', '.join(args.plan_fields)})"
            )
    else:
        plan = dataclasses.replace(defaults, **given)
    if plan.dp == -1:
        found = _dp_from_the_launcher(plan)
        if isinstance(found, str):
            return found
        plan = dataclasses.replace(plan, dp=found)
    if "ranks_per_node" in args.plan_fields and plan.ranks_per_node is None:
        plan = dataclasses.replace(plan, ranks_per_node=_launchers_node())
    for f in args.plan_fields:
        setattr(args, f, getattr(plan, f))
    args.parallel_plan = plan
    return plan
