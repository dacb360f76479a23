"""All-reduce across two hosts for real: two Linux network namespaces on one machine
(`parcourse.launch.hosts`), a torchrun agent in each with 2 ranks, the link out of each
host a kernel token bucket (`tbf`) at the rate given. `python -m parcourse allreduce`
runs unchanged under the agents, the course's ring and torch's (gloo's) in the same run,
and its bus bandwidth is set against the link's rate.

    sudo python benchmarks/two_hosts.py [--rates 1000 100] [--size 64MB] [--repeats 3]

Why busbw is the number to hold against the link: on two hosts the ring crosses between
them twice, and each host's one crossing carries what each rank sends, 2 (N-1)/N x S; so
busbw = algbw x 2 (N-1)/N is the rate across the link, and a saturated link gives busbw =
its rate. Needs root (it says so otherwise).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parcourse.experiments.hosts import HOSTS_MODEL, train3d_on_hosts  # noqa: E402
from parcourse.launch.hosts import Hosts, why_not  # noqa: E402


def all_reduce_ms(hosts: Hosts, algo: str, size: str, repeats: int) -> float:
    """The median all-reduce time `allreduce` prints, across the hosts."""
    argv = ["-m", "parcourse", "allreduce", "--algo", algo, "--size", size]
    done = hosts.torchrun([*argv, "--repeats", str(repeats)], nproc_per_node=2, timeout=600)
    said = "".join(d.stdout for d in done)
    found = re.search(r"^time\s+([\d.]+) ms", said, re.M)
    if any(d.returncode != 0 for d in done) or found is None:
        raise RuntimeError("allreduce failed across the hosts:\n" + done[0].stderr[-3000:])
    return float(found.group(1))


MODEL = HOSTS_MODEL  # tp's activations three times dp's gradients
STEPS = 6
ORDERS = {"inside": "megatron", "across": "tp,dp"}  # tp innermost; tp outermost


def train3d_step(hosts: Hosts, order: str) -> tuple[float, float]:
    """dp 2 x tp 2 across the hosts in `order`: the median step (ms) and the bytes rank
    0 sent on dp a step."""
    return train3d_on_hosts(hosts, {"dp": 2, "tp": 2}, order, STEPS, MODEL)


def predicted(order: str, rate_mbit: float | None, flops: float) -> float:
    """The planner's step (ms) for the same plan on this machine's 2 cores, the link
    between the hosts at `rate_mbit` (None: unlimited) shared by the host's 2 ranks (the
    planner gives each rank a link of its own, as a node's GPUs have a network card each:
    here each gets half the host's), the loopback inside a host free."""
    from parcourse.comm import SimulatedLink, Topology
    from parcourse.planner import Choice, Cluster, predict_time

    per_rank = rate_mbit * 1e6 / 8 / 2 if rate_mbit else float("inf")
    topology = Topology(2, SimulatedLink(), SimulatedLink(0.0, per_rank))
    cluster = Cluster.this_machine(4, flops=flops, topology=topology, cores=2)
    choice = Choice(dp=2, tp=2, microbatches=2, order=order, ranks_per_node=2)
    return 1e3 * predict_time(_config(), choice, MODEL["batch"], cluster)["step"]


def tp_bytes() -> int:
    """Bytes a rank sends on tp a step: every collective of `tp_collectives`, 2
    microbatches, each all-reduced tensor sent once on a ring of 2."""
    from parcourse.theory import tp_collectives

    micro = MODEL["batch"] // (2 * 2)
    return 2 * sum(c[3] for c in tp_collectives(_config(), micro, MODEL["block_size"], 2))


def _config() -> Any:
    from parcourse.models import GPTConfig

    return GPTConfig(
        vocab=64,
        block_size=MODEL["block_size"],
        n_layers=MODEL["layers"],
        n_heads=MODEL["heads"],
        d_model=MODEL["width"],
    )


def inside_against_across(rates: list[float]) -> None:
    """tp inside a host against tp across, on an unlimited link and at each rate: the
    step measured, and the planner's. The planner's own step for this machine is not
    calibrated here (its gloo and optimizer costs are measured by `benchmarks/
    planner.py`, not on these hosts): what is held against it is what the link adds,
    so its step is the unlimited link's measured step plus the planner's cost of the
    link (its step at the rate less its step unlimited)."""
    from parcourse.planner.costs import measure_flops

    flops = measure_flops(_config(), batch=MODEL["batch"] // 4)
    links: list[float | None] = [None, *rates]
    measured = {}
    for rate in links:
        with Hosts(2, rate_mbit=rate) as hosts:
            for where, order in ORDERS.items():
                measured[rate, where] = train3d_step(hosts, order)
    print(
        f"\ndp 2 x tp 2 across 2 hosts x 2 ranks, GPT {MODEL['layers']} blocks, d_model "
        f"{MODEL['width']}, {MODEL['block_size']} tokens, batch {MODEL['batch']}, "
        f"2 microbatches, {STEPS} steps (the median after the first)\n"
    )
    print(
        f"{'link':>12} {'tp':>7} {'across a step':>14} {'step':>9} {'link adds':>10} "
        f"{'planner':>9} {'ratio':>6}"
    )
    for rate in links:
        for where, order in ORDERS.items():
            ms, dp = measured[rate, where]
            # what each host sends across a step: both its ranks' dp or tp bytes
            crossing = 2 * (dp if where == "inside" else tp_bytes())
            base = measured[None, where][0]
            want = base + predicted(order, rate, flops) - predicted(order, None, flops)
            name = f"{rate:g} Mb/s" if rate else "unlimited"
            print(
                f"{name:>12} {where:>7} {crossing / 2**20:>10.1f} MiB {ms:>6.0f} ms "
                f"{ms - base:>7.0f} ms {want:>6.0f} ms {ms / want:>6.2f}"
            )


def size_bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)(KB|MB|GB)", size.upper())
    if m is None:
        raise SystemExit(f"--size like 64MB, got {size!r}")
    return int(m.group(1)) * 1024 ** {"KB": 1, "MB": 2, "GB": 3}[m.group(2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1000.0, 100.0], help="Mbit/s")
    p.add_argument("--size", default="64MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=["allreduce", "tp"], help="one of the two tables")
    args = p.parse_args(argv)
    if why := why_not():
        print(f"two_hosts: {why}", file=sys.stderr)
        return 2
    if args.only != "tp":
        all_reduce_table(args.rates, args.size, args.repeats)
    if args.only != "allreduce":
        inside_against_across(args.rates)
    return 0


def all_reduce_table(rates: list[float], size_text: str, repeats: int) -> None:
    n, size = 4, size_bytes(size_text)
    crossing = 2 * (n - 1) / n * size  # bytes each host sends across
    print(f"all-reduce of {size_text} float32, 2 hosts x 2 ranks, the link a tbf queue\n")
    print(
        f"{'link':>12} {'algorithm':>10} {'time':>10} {'busbw':>11} {'of the link':>12}"
        f" {'against torch':>14}"
    )
    for rate in rates:
        link = rate * 1e6 / 8  # bytes/s
        with Hosts(2, rate_mbit=rate) as hosts:
            times = {a: all_reduce_ms(hosts, a, size_text, repeats) for a in ("torch", "ring")}
        for algo, ms in times.items():
            busbw = crossing / (ms / 1e3)
            print(
                f"{rate:>7g} Mb/s {algo:>10} {ms:>7.1f} ms {busbw / 1e6:>6.1f} MB/s "
                f"{busbw / link:>11.1%} {times['torch'] / ms:>13.2f}x"
            )


if __name__ == "__main__":
    raise SystemExit(main())
