"""Pipelines: our GPipe against torch.distributed.pipelining's, and the bubble against theory.

    python benchmarks/pipeline.py [--steps 15] [--microbatches 4] [--width 256]

1. Step time of our GPipe (parcourse.pipeline.PipelineRuntime) against
   torch.distributed.pipelining.ScheduleGPipe on the same two stages of a deep MLP
   (gloo, 2 ranks, real compute), alternating step by step in one run; medians of
   the slowest rank and their ratio. Target: ours / torch <= 1.0.
2. The measured bubble of GPipe under simulated compute (F 20 ms, B 40 ms per
   stage) beside the simulator's prediction and (p-1)/(m+p-1), for p in {2, 4}
   and m in {1, 2, 4, 8, 16}.
"""

from __future__ import annotations

import argparse

import torch

from parcourse import Pool
from parcourse.experiments.common import median_of_slowest
from parcourse.experiments.pipeline import bubble_of, step_times, train
from parcourse.pipeline import Costs, gpipe, simulate
from parcourse.pipeline.runtime import SimulatedCompute
from parcourse.theory import gpipe_bubble


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, gloo on CPU, one thread per rank")

    with Pool(2, timeout=3600) as pool:
        per_rank = pool.run(step_times, args.microbatches, args.steps, width=args.width).results
    med = {name: median_of_slowest(per_rank, name) for name in per_rank[0]}
    print(f"\n1. step time, 2 stages, {args.microbatches} microbatches, MLP 8 x {args.width}, "
          f"batch 256 (median of {args.steps}, slowest rank)")
    for name, t in med.items():
        print(f"{name:>22}: {t * 1e3:7.1f} ms")
    ratio = med["ours"] / med["torch ScheduleGPipe"]
    print(f"ours / torch = {ratio:.2f} (target <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'})")

    f, b = 0.02, 0.04
    print("\n2. GPipe bubble under simulated compute (F 20 ms, B 40 ms): measured, simulated, "
          "formula")
    print(f"{'p':>3}{'m':>4}{'measured':>10}{'simulated':>11}{'formula':>9}")
    for p in (2, 4):
        with Pool(p, timeout=3600) as pool:
            for m in (1, 2, 4, 8, 16):
                run = pool.run(train, "gpipe", m, 1, batch=32, compute=SimulatedCompute(f, b))
                predicted = simulate(gpipe(p, m), Costs(forward=f, backward=b)).bubble
                print(f"{p:>3}{m:>4}{bubble_of(run):>10.3f}{predicted:>11.3f}"
                      f"{gpipe_bubble(p, m):>9.3f}")


if __name__ == "__main__":
    main()
