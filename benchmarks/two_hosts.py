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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
    args = p.parse_args(argv)
    if why := why_not():
        print(f"two_hosts: {why}", file=sys.stderr)
        return 2
    n, size = 4, size_bytes(args.size)
    crossing = 2 * (n - 1) / n * size  # bytes each host sends across
    print(f"all-reduce of {args.size} float32, 2 hosts x 2 ranks, the link a tbf queue\n")
    print(
        f"{'link':>12} {'algorithm':>10} {'time':>10} {'busbw':>11} {'of the link':>12}"
        f" {'against torch':>14}"
    )
    for rate in args.rates:
        link = rate * 1e6 / 8  # bytes/s
        with Hosts(2, rate_mbit=rate) as hosts:
            times = {a: all_reduce_ms(hosts, a, args.size, args.repeats) for a in ("torch", "ring")}
        for algo, ms in times.items():
            busbw = crossing / (ms / 1e3)
            print(
                f"{rate:>7g} Mb/s {algo:>10} {ms:>7.1f} ms {busbw / 1e6:>6.1f} MB/s "
                f"{busbw / link:>11.1%} {times['torch'] / ms:>13.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
