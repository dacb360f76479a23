"""Where tensor and pipeline parallelism belong on a two-level network, measured beside
the model.

    python benchmarks/hybrid.py [--steps 5] [--repeats 3] [--only tp|pp]

The GPT on dp x tp = 2 x 2, then on dp x pp = 2 x 2 (4 ranks, 2 a node; gloo, one thread
per rank) on a simulated Topology (inside a node: 20 us, 4 GB/s; between nodes: 5 ms,
0.1 GB/s), the same step with the tp (pp) group inside a node and across nodes (dp takes
the other links), taking turns in one run; the median of the slowest rank, beside the
alpha-beta model's communication time (the axis' messages plus dp's all-reduce, each on
its link). Target: TP across nodes clearly slower, by about what the model predicts; for
pp, the difference the model predicts, whichever way it goes.
"""

from __future__ import annotations

import argparse

from parcourse import Pool
from parcourse.comm import SimulatedLink, Topology
from parcourse.experiments.hybrid import (PLACEMENTS, placement_predictions,
                                          placement_step_times)
from parcourse.experiments.timing import median_of_slowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--between-latency-us", type=float, default=5000.0,
                        help="between nodes (5 ms: more than what 4 ranks sharing 2 cores "
                             "hide under each other's compute)")
    parser.add_argument("--only", choices=sorted(PLACEMENTS), default=None)
    args = parser.parse_args()
    topology = Topology.of(2, between=SimulatedLink.of(latency_us=args.between_latency_us,
                                                       bandwidth_GBps=0.1))
    print("GPT 2 blocks, d_model 64, 16 tokens, batch 8, one microbatch; 4 ranks, 2 a node; "
          f"inside {topology.inside.latency_s * 1e6:g} us, "
          f"{topology.inside.bandwidth_Bps / 1e9:g} GB/s; between "
          f"{topology.between.latency_s * 1e6:g} us, {topology.between.bandwidth_Bps / 1e9:g} "
          "GB/s")
    with Pool(4, timeout=600) as pool:
        for axis in [args.only] if args.only else list(PLACEMENTS):
            names = list(PLACEMENTS[axis])
            print(f"\ndp 2 x {axis} 2\n{'placement':<20}{'step (ms)':>12}"
                  f"{'model comm (ms)':>18}")
            for _ in range(args.repeats):
                results = pool.run(placement_step_times, topology, args.steps,
                                   axis=axis).results
                per_rank = [r["times"] for r in results]
                model = placement_predictions(
                    topology, max(r["param_bytes"] for r in results), axis=axis)
                med = {name: median_of_slowest(per_rank, name) for name in names}
                for name in names:
                    print(f"{name:<20}{med[name] * 1e3:>12.1f}{model[name] * 1e3:>18.1f}")
                gap = med[names[1]] - med[names[0]]
                predicted = model[names[1]] - model[names[0]]
                print(f"{'across - inside':<20}{gap * 1e3:>12.1f}{predicted * 1e3:>18.1f}")

if __name__ == "__main__":
    main()
