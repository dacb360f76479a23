"""Where tensor parallelism belongs on a two-level network, measured beside the model.

    python benchmarks/hybrid.py [--steps 5] [--repeats 3]

The GPT on dp x tp = 2 x 2 (4 ranks, 2 a node; gloo, one thread per rank) on a simulated
Topology (inside a node: 20 us, 4 GB/s; between nodes: 5 ms, 0.1 GB/s), the same step
with the TP group inside a node and across nodes, taking turns in one run; the median of
the slowest rank, beside the alpha-beta model's communication time (tp's collectives
plus dp's all-reduce, each on its link). Target: TP across nodes clearly slower, by
about what the model predicts.
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
    args = parser.parse_args()
    topology = Topology.of(2, between=SimulatedLink.of(latency_us=args.between_latency_us,
                                                       bandwidth_GBps=0.1))
    print("GPT 2 blocks, d_model 64, 16 tokens, batch 8; dp 2 x tp 2 on 4 ranks, 2 a node; "
          f"inside {topology.inside.latency_s * 1e6:g} us, "
          f"{topology.inside.bandwidth_Bps / 1e9:g} GB/s; between "
          f"{topology.between.latency_s * 1e6:g} us, {topology.between.bandwidth_Bps / 1e9:g} "
          "GB/s")
    print(f"{'placement':<20}{'step (ms)':>12}{'model comm (ms)':>18}")
    with Pool(4, timeout=600) as pool:
        for _ in range(args.repeats):
            results = pool.run(placement_step_times, topology, args.steps).results
            per_rank = [r["times"] for r in results]
            model = placement_predictions(topology, results[0]["param_bytes"])
            med = {name: median_of_slowest(per_rank, name) for name in PLACEMENTS}
            for name in PLACEMENTS:
                print(f"{name:<20}{med[name] * 1e3:>12.1f}{model[name] * 1e3:>18.1f}")
            gap = med["tp across nodes"] - med["tp inside a node"]
            predicted = model["tp across nodes"] - model["tp inside a node"]
            print(f"{'across - inside':<20}{gap * 1e3:>12.1f}{predicted * 1e3:>18.1f}\n")


if __name__ == "__main__":
    main()
