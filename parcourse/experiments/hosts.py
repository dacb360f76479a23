"""The course's 3D step across hosts for real (`parcourse.launch.hosts`: network
namespaces, a torchrun agent in each, the link between them a kernel rate limit): lesson
09's placements (tp and pp inside a host or across) measured on that link, and the step
`benchmarks/two_hosts.py` sets beside the planner. Needs root."""

from __future__ import annotations

import re
from collections.abc import Mapping

from parcourse.experiments.hybrid import PLACEMENTS
from parcourse.launch.hosts import Hosts

# A model whose tp activations weigh three times its gradients (train3d's flags): big
# enough that what crosses a 100 Mbit/s link shows, small enough for 4 ranks on 2 cores.
# (Lesson 09's simulated placements' model is a quarter of its width and sequence: there
# dp's gradients outweigh tp's activations, and only the simulated link's 5 ms a message
# makes tp pay.)
HOSTS_MODEL = {"layers": 4, "width": 128, "heads": 4, "block_size": 64, "batch": 16}
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def train3d_on_hosts(
    hosts: Hosts,
    shape: Mapping[str, int],
    order: str,
    steps: int,
    model: Mapping[str, int],
    timeout: float = 600.0,
) -> tuple[float, float]:
    """`train3d` on `shape` in `order` (a named order or the axes outermost first,
    "tp,dp") under one torchrun agent a host, 2 ranks each: the median step it prints
    (ms, the slowest rank's, after the first) and the bytes rank 0 sent on dp a step
    (counted by the course's ring)."""
    argv = ["-m", "parcourse", "train3d", "--order", order, "--steps", str(steps)]
    argv += [f"--{a}={shape.get(a, 1)}" for a in ("dp", "tp", "pp")]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]
    done = hosts.torchrun(argv, nproc_per_node=2, timeout=timeout)
    said = "".join(d.stdout for d in done)
    step = re.search(r"^step time\s+([\d.]+) ms", said, re.M)
    # rank 0's row: its coordinates, then "sent on pp" and "on dp"
    dp = re.search(r"^\s+0\s+0\s+0\s+0\s+\S+ \S+\s+([\d.]+) (B|KiB|MiB|GiB)", said, re.M)
    if any(d.returncode != 0 for d in done) or step is None or dp is None:
        failed = next((d for d in done if d.returncode != 0), done[0])
        raise RuntimeError(
            f"train3d failed across the hosts (on {failed.host.address}):\n" + failed.stderr[-3000:]
        )
    return float(step.group(1)), float(dp.group(1)) * _UNITS[dp.group(2)] / steps


def placements_on_hosts(
    rate_mbit: float = 100.0, steps: int = 4, model: Mapping[str, int] = HOSTS_MODEL
) -> dict[str, dict[str, float]]:
    """Lesson 09's four placements on 2 hosts x 2 ranks, the link between them at
    `rate_mbit` Mbit/s: {axis: {placement: the median step in seconds}}, dp 2 x tp 2 and
    dp 2 x pp 2 each with the axis inside a host and across (the other axis, dp, takes
    the other links)."""
    out: dict[str, dict[str, float]] = {}
    with Hosts(2, rate_mbit=rate_mbit) as hosts:
        for axis, placements in PLACEMENTS.items():
            out[axis] = {}
            for name, order in placements.items():
                shape = {"dp": 2, axis: 2}
                ms, _ = train3d_on_hosts(hosts, shape, ",".join(order), steps, model)
                out[axis][name] = ms / 1e3
    return out
