"""What several commands share: sizes and counts read from text, the options for ranks
and for a simulated link, and the world size under an external launcher."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from parcourse.launch import external_env

_UNITS = {"B": 1, "KB": 1 << 10, "KIB": 1 << 10, "MB": 1 << 20, "MIB": 1 << 20,
          "GB": 1 << 30, "GIB": 1 << 30}


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
    p.add_argument("--world-size", type=int, default=default,
                   help=f"ranks ({default}; under torchrun, the launcher's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")


def link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency-us", type=float, default=0.0, help="simulated link latency")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="simulated link bandwidth in GB/s")


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


def mesh_against_launcher(dp: int, tp: int, pp: int) -> str | None:
    """Under torchrun or Slurm the launcher has already set the world size: a mesh of
    another size is refused here, in one line, rather than in every rank after the start
    (and again after each of torchrun's restarts)."""
    external = external_env()
    if external is None or dp * tp * pp == external[1]:
        return None
    return (f"the mesh dp {dp} x tp {tp} x pp {pp} needs {dp * tp * pp} ranks, but the "
            f"launcher started {external[1]}: give --dp, --tp and --pp whose product is "
            f"{external[1]}")
