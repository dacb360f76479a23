"""`python -m parcourse roofline`: this machine measured (a rank's matrix multiply and memory
bandwidth with one thread, the link as the planner measures it) beside its physical peak,
estimated from the processor's flags; then each strategy's threshold, the tokens per rank
(or d_model) below which its communication takes longer than its compute, for this
machine and for H100 and H200 nodes. `--sweep` also measures where a strategy's
communication stops hiding behind its compute, beside the formula's threshold."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from parcourse.cli.options import at_least_one, link_options, ranks, ranks_option

if TYPE_CHECKING:
    from parcourse.experiments.roofline import Measured
    from parcourse.theory.roofline import Machine

HELP = "this machine's FLOP/s, memory and link beside its peak; each strategy's threshold"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from parcourse.experiments.roofline import SWEEP_STRATEGIES

    ranks_option(p, 2)
    p.add_argument(
        "--group",
        type=int,
        default=8,
        help="ranks in a group on the published hardware (8: a node)",
    )
    p.add_argument(
        "--d-model",
        type=int,
        default=4096,
        help="the width context and expert parallelism's rows use",
    )
    p.add_argument(
        "--sweep",
        choices=SWEEP_STRATEGIES,
        default=None,
        help="also measure where this strategy's communication stops hiding behind its "
        "compute (seconds; over the simulated link, if given)",
    )
    link_options(p)


def check(args: argparse.Namespace) -> str | None:
    if problem := at_least_one(args, "world_size", "group", "d_model"):
        return problem
    if args.latency_us < 0 or (args.bandwidth_gbps is not None and not args.bandwidth_gbps > 0):
        return "--latency-us must be >= 0 and --bandwidth-gbps > 0"
    if (args.latency_us or args.bandwidth_gbps) and args.sweep is None:
        return "a simulated link is for the sweep: give --sweep too"
    return None


def _count(value: float) -> str:
    """A threshold in a few characters: <1, 950, 1.3k, 2.1M, or never (inf)."""
    if math.isinf(value):
        return "never"
    if 0 < value < 1:
        return "<1"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def _this_machine(m: Measured) -> list[str]:
    """The measured figures beside the peak's estimate."""
    peak = m.peak
    lines = [
        f"roofline    this machine, {m.world_size} ranks measuring at once, one thread each",
        f"  matmul    {m.flops / 1e9:.1f} GFLOP/s a rank (1024 x 1024 fp32, one thread)",
    ]
    if peak is None:
        lines.append("  peak      cannot be read here (no /proc/cpuinfo with flags and a clock)")
    else:
        lines.append(
            f"  peak      {peak.per_core / 1e9:.0f} GFLOP/s a core, {peak.flops / 1e9:.0f} in all: "
            f"{peak.describe()}; the matmul reaches {m.flops / peak.per_core:.0%} of a core's"
        )
    lines += [
        f"  the GPT   {m.model_flops / 1e9:.1f} GFLOP/s (lesson 09's GPT, forward and backward: "
        "the planner's measure_flops)",
        f"  memory    {m.memory_Bps / 1e9:.1f} GB/s a rank (STREAM's triad over 3 x 64 MiB)",
    ]
    if m.world_size > 1:
        lines.append(
            f"  link      gloo: a message {m.p2p_s * 1e6:.0f} us one way, "
            f"{m.link_Bps / 1e9:.2f} GB/s (loopback: the planner's measure_links)"
        )
        lines.append(
            f"  ring      the course's: {m.ring.alpha_s * 1e6:.0f} us a step, "
            f"{m.machine().link_Bps / 1e9:.2f} GB/s (alpha and beta fitted to its all-reduces)"
        )
        machine = m.machine()
        lines.append(
            f"  ratios    F/W {machine.flops_per_link_byte:.0f} FLOPs a link byte, "
            f"F/M {machine.flops_per_memory_byte:.1f} a memory byte"
        )
    else:
        lines.append("  link      one rank: nothing to send (--world-size 2 measures the link)")
    return lines


def _thresholds(rows: list[tuple[Machine, int, int]], d_model: int) -> list[str]:
    """Each machine's thresholds, one line each, and the rules under them."""
    from parcourse.theory.roofline import STRATEGIES, thresholds

    head = [f"{name} ({'d_model' if name == 'tp' else 'tokens'})" for name in STRATEGIES]
    lines = [
        "",
        "thresholds  below these, a strategy's communication takes longer than its compute",
        f"{'':<22} {'ranks':>5} {'number':>6} {'F/W':>7} " + " ".join(f"{h:>14}" for h in head),
    ]
    rules = []
    for machine, n, b in rows:
        found = thresholds(machine, n, bytes_per_number=b, d_model=d_model)
        rules = [f"{t.strategy}: {t.rule}" for t in found]
        lines.append(
            f"{machine.name:<22} {n:>5} {'fp32' if b == 4 else 'bf16':>6} "
            f"{machine.flops_per_link_byte:>7.0f} "
            + " ".join(f"{_count(t.value):>14}" for t in found)
        )
    lines += [
        "rules (N ranks, b bytes a number, F/W FLOPs a link byte; alpha the link's latency,",
        f"k = 2 experts a token of 8; context and experts at d_model {d_model}):",
        *(f"  {rule}" for rule in rules),
        "in the link's bandwidth alone, as the scaling book gives them, but the last: in its",
        "bandwidth alone expert parallelism is compute-bound at any count once d_model is",
        "wide enough, and its five all-to-alls' latency is what is left. The published",
        "machines: dense bf16 peak, the planner's presets (Cluster.PRESETS).",
    ]
    return lines


def run(args: argparse.Namespace) -> int:
    """Measure this machine, print its figures and every strategy's threshold; with
    --sweep, the measured crossover beside the formula's."""
    from parcourse.comm import simulated_link
    from parcourse.experiments.roofline import SweepConfig, format_sweep, measure_machine, sweep
    from parcourse.theory.roofline import published_machines

    where = ranks(args)
    measured = measure_machine(where.world_size)
    rows = [(measured.machine(), where.world_size, 4)]
    rows += [(m, args.group, 2) for m in published_machines()]
    if not where.quiet:
        print("\n".join([*_this_machine(measured), *_thresholds(rows, args.d_model)]))
    if args.sweep is not None:
        config = SweepConfig(args.sweep, link=simulated_link(args.latency_us, args.bandwidth_gbps))
        done = sweep(config, where.world_size)
        if not where.quiet:
            print("\nsweep       " + format_sweep(done))
    return 0
