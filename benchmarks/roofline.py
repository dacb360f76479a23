"""The roofline (lesson 12): where a strategy's communication stops hiding behind its
compute, measured, beside the formula's threshold (`parcourse.theory.roofline`).

    python benchmarks/roofline.py [--world-size 2] [--latency-us 100] [--bandwidth-gbps 0.25]
                                  [--only dp,zero3,tp] [--repeats 3] [--rounds 5]
                                  [--no-loopback]

1. This machine, measured (`experiments.roofline.measure_machine`): a rank's matrix
   multiply and triad with one thread, beside the peak estimated from the processor's
   flags; gloo's link (the planner's `measure_links`) and the course's ring over it.
2. For each strategy, on the simulated link and on this machine's loopback: the sweep
   (`experiments.roofline.sweep`: dp, lesson 02's buckets, and ZeRO-3, lesson 04's, over
   tokens per rank for an MLP of 4 x 512; tp, lesson 05's layers, over d_model, two MLP
   blocks of 96 tokens), seven sizes around the formula's threshold, each the slowest
   rank's median of its compute alone, its communication alone and the strategy's step;
   the crossover where the compute alone catches up with the communication alone,
   beside the formula's at the machine measured in the same run (its FLOP/s, and the
   ring's alpha and beta fitted to its all-reduces over that link). --repeats sweeps
   each, their median ratio. Target: measured / formula within a factor 1.5, on the
   simulated link (the loopback's latency, on shared cores, is the scheduler's).
"""

from __future__ import annotations

import argparse
import statistics

from parcourse.comm import simulated_link
from parcourse.experiments.roofline import (
    NAMES,
    SWEEP_STRATEGIES,
    SweepConfig,
    format_sweep,
    link_label,
    measure_machine,
    sweep,
)
from parcourse.launch import Pool

TARGET = 1.5


def machine_lines(world_size: int, pool: Pool) -> list[str]:
    m = measure_machine(world_size, pool)
    peak = m.peak
    return [
        f"this machine, {world_size} ranks at once, one thread each:",
        f"  matmul {m.flops / 1e9:.1f} GFLOP/s a rank"
        + (
            f" ({m.flops / peak.per_core:.0%} of a core's {peak.per_core / 1e9:.0f}: "
            f"{peak.describe()})"
            if peak
            else " (no peak to read here)"
        ),
        f"  memory {m.memory_Bps / 1e9:.1f} GB/s (triad); gloo {m.p2p_s * 1e6:.0f} us, "
        f"{m.link_Bps / 1e9:.2f} GB/s; the course's ring {m.ring.alpha_s * 1e6:.0f} us a step, "
        f"{m.machine().link_Bps / 1e9:.2f} GB/s",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--latency-us", type=float, default=100.0)
    p.add_argument("--bandwidth-gbps", type=float, default=0.25)
    p.add_argument("--only", default=",".join(SWEEP_STRATEGIES))
    p.add_argument("--repeats", type=int, default=3, help="sweeps of each, their median ratio")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-loopback", action="store_true", help="the simulated link only")
    args = p.parse_args()
    strategies = [s for s in args.only.split(",") if s]
    unknown = [s for s in strategies if s not in SWEEP_STRATEGIES]
    if unknown or args.repeats < 1 or args.world_size < 2:
        p.error(
            f"--only takes {', '.join(SWEEP_STRATEGIES)}; --repeats >= 1, --world-size >= 2 "
            f"(got {', '.join(unknown) or args.repeats})"
        )
    links = [simulated_link(args.latency_us, args.bandwidth_gbps)]
    if not args.no_loopback:
        links.append(None)
    summary = []
    with Pool(args.world_size, timeout=1800) as pool:
        print("\n".join(machine_lines(args.world_size, pool)))
        for strategy in strategies:
            for link in links:
                config = SweepConfig(strategy, link=link, rounds=args.rounds)  # type: ignore[arg-type]  # checked above
                done = [sweep(config, args.world_size, pool) for _ in range(args.repeats)]
                print("\n" + format_sweep(done[-1]))
                summary.append((strategy, link, done))
    print(
        f"\n{'':<20} {'link':<30} {'formula':>8} {'measured':>9} {'ratios':>18} "
        f"{'median':>7}  target (within {TARGET})"
    )
    for strategy, link, done in summary:
        ratios = [
            s.measured_crossover / s.formula_crossover
            for s in done
            if s.measured_crossover is not None and s.formula_crossover > 0
        ]
        median = statistics.median(ratios) if ratios else float("nan")
        met = 1 / TARGET <= median <= TARGET
        got = [s.measured_crossover for s in done if s.measured_crossover is not None]
        print(
            f"{NAMES[strategy]:<20} {link_label(link):<30} "
            f"{statistics.median(s.formula_crossover for s in done):>8.0f} "
            f"{statistics.median(got) if got else float('nan'):>9.0f} "
            f"{' '.join(f'{r:.2f}' for r in ratios):>18} {median:>7.2f}  "
            + ("met" if met else "not met")
            + ("" if link is not None else " (loopback: no target)")
        )


if __name__ == "__main__":
    main()
