"""ZeRO: bytes per rank against the formula; step time and peak memory against torch's own.

    python benchmarks/zero.py [--params 4M] [--steps 10]

1. Bytes per rank by category (our accounting of live tensor storages) under
   stages 0-3, world size 4, against the ZeRO formula, each at the point where it
   holds (after the step; stage 0-1 gradients at the backward peak). Target:
   within 2% for parameters, gradients and optimizer state. And the bytes each
   rank sent in a step, counted message by message, against data parallelism's
   2(N-1)/N x S: stages 1-2 equal, stage 3 1.5x.
2. Step time, world size 2, alternating step by step in one run: stage 1 vs
   torch's ZeroRedundancyOptimizer (target <= 1.15), stage 3 vs FSDP2
   fully_shard (target <= 1.0).
3. Peak memory in a step, stage 3 vs FSDP2, both measured by torch's MemTracker.
"""

from __future__ import annotations

import argparse

import torch

from parcourse import Pool
from parcourse.cli import parse_count
from parcourse.experiments.timing import median_of_slowest
from parcourse.memory import format_bytes
from parcourse.experiments.zero import (measured_over_formula, memory_by_stage, peak_memory,
                                        step_times)
from parcourse.theory import bytes_sent_per_rank, zero_communication_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="4M")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    params = parse_count(args.params)
    print(f"torch {torch.__version__}, gloo on CPU, one thread per rank; MLP of 4 layers, "
          f"{params / 1e6:g} M parameters, Adam, fp32")

    print("\n1. bytes per rank, world size 4 (largest rank; measured / formula), and bytes "
          "sent per rank in a step / DDP's")
    print(f"{'stage':>5}{'params':>22}{'grads':>22}{'optimizer':>22}  within 2%"
          f"{'sent / DDP':>12}{'theory':>8}")
    with Pool(4, timeout=3600) as pool:
        for stage in (0, 1, 2, 3):
            run = pool.run(memory_by_stage, stage, params, bucket_mb=25.0)
            result = run.results[0]
            worst, cells = 0.0, ""
            for c, (_, largest) in measured_over_formula(run).items():
                worst = max(worst, abs(largest - 1))
                cells += f"{format_bytes(largest * result['theory'][c]):>11} ({largest:.3f})"
            ddp = bytes_sent_per_rank("ring", result["params"] * 4, 4)
            sent = "-" if stage == 0 else f"{max(r['bytes_sent'] for r in run.results) / ddp:.3f}"
            theory = zero_communication_bytes(stage, 1.0, 4) / zero_communication_bytes(0, 1.0, 4)
            print(f"{stage:>5}{cells}  {'met' if worst <= 0.02 else 'MISSED':>9}{sent:>12}"
                  f"{theory:>8.2f}")

    configs = {
        "DDP + Adam": {"kind": "ddp"},
        "stage 1": {"kind": "zero", "stage": 1},
        "ZeroRedundancyOptimizer": {"kind": "zero_redundancy"},
        "stage 3": {"kind": "zero", "stage": 3},
        "FSDP2 fully_shard": {"kind": "fsdp2"},
    }
    with Pool(2, timeout=3600) as pool:
        per_rank = pool.run(step_times, configs, args.steps, params=params).results
        med = {n: median_of_slowest(per_rank, n) for n in configs}
        print("\n2. step time, world size 2 (median, slowest rank)")
        for name, t in med.items():
            print(f"{name:>26}: {t * 1e3:7.1f} ms")
        r1 = med["stage 1"] / med["ZeroRedundancyOptimizer"]
        r3 = med["stage 3"] / med["FSDP2 fully_shard"]
        print(f"stage 1 / ZeroRedundancyOptimizer = {r1:.2f} (target <= 1.15: "
              f"{'met' if r1 <= 1.15 else 'MISSED'})")
        print(f"stage 3 / FSDP2 = {r3:.2f} (target <= 1.0: {'met' if r3 <= 1.0 else 'MISSED'})")

        print("\n3. peak memory in a step, world size 2, torch's MemTracker (rank 0)")
        ours = pool.run(peak_memory, {"kind": "zero", "stage": 3}, params).results[0]
        theirs = pool.run(peak_memory, {"kind": "fsdp2"}, params).results[0]
        for key in ("param", "grad", "opt", "act", "temp", "total"):
            print(f"{key:>8}: stage 3 {format_bytes(ours.get(key, 0)):>10}   "
                  f"FSDP2 {format_bytes(theirs.get(key, 0)):>10}")
        print(f"peak, stage 3 / FSDP2 = {ours['total'] / theirs['total']:.2f}")


if __name__ == "__main__":
    main()
