"""Pipelines: our schedules against torch.distributed.pipelining's, and against the simulator.

    python benchmarks/pipeline.py [--steps 50] [--microbatches 4] [--width 256]

1. Step time and peak activation memory of our schedules (parcourse.pipeline's
   runtime) against torch.distributed.pipelining's counterparts on the same stages
   of a deep MLP (gloo, 2 ranks, real compute), alternating step by step in one run:
   GPipe / ScheduleGPipe, 1F1B / Schedule1F1B, interleaved 1F1B (2 chunks per rank) /
   ScheduleInterleaved1F1B, DualPipeV / ScheduleDualPipeV, on CPU ranks even where
   there is a GPU (on ranks sharing one, torch's pipelining sends CUDA tensors through
   gloo, which aborts: seen on an H200). Time: medians of the
   slowest rank. Memory: the peak bytes autograd holds for backward (PeakSavedBytes,
   a step of each), the larger rank. Targets: ours / torch <= 1.0 for both.
   ZB-H1 has no counterpart in torch (its zero-bubble schedules, ZBV and interleaved
   ZB, hold two or more stages per rank).
2. The measured bubble of GPipe under simulated compute (F 20 ms, B 40 ms per
   stage) beside the simulator's prediction and (p-1)/(m+p-1), for p in {2, 4}
   and m in {1, 2, 4, 8, 16}.
3. Every schedule's measured bubble and peak in-flight activations under simulated
   compute (F 20 ms, B 40 ms for one rank's layers, W half of B) beside the
   simulator's prediction, at p = 4 and m in {4, 8, 16}.
4. DeepSeek-V3's table 2 (1F1B, ZB1P, DualPipe: bubble, parameters, activations per
   rank) beside the simulator's, F&B overlapped at 0.7 and 1.0 of F + B and run apart
   (as the runtime runs it), and DualPipe measured at p = 4, m = 8: the parameters each
   rank holds (two copies' stages, x one stage's) and its peak in-flight microbatches.
"""

from __future__ import annotations

import argparse

import torch

from parcourse import Pool
from parcourse.experiments.pipeline import (
    ALL_SCHEDULES,
    TORCH_SCHEDULES,
    bubble_of,
    step_times,
    summarize,
    train,
)
from parcourse.experiments.timing import median_of_slowest
from parcourse.pipeline import Costs, gpipe, schedule_by_name, simulate
from parcourse.theory import gpipe_bubble


def compare_with_torch(args: argparse.Namespace) -> None:
    print(
        f"\n1. ours against torch.distributed.pipelining, 2 ranks, {args.microbatches} "
        f"microbatches, MLP 8 x {args.width}, batch 256 (median of {args.steps}, "
        "slowest rank; peak saved activations, larger rank)"
    )
    print(
        f"{'schedule':>18}{'ours ms':>9}{'torch ms':>10}{'time ratio':>12}"
        f"{'ours act.':>11}{'torch act.':>12}{'memory ratio':>14}"
    )
    with Pool(2, device="cpu", timeout=3600) as pool:
        for schedule, theirs in TORCH_SCHEDULES.items():
            try:
                per_rank = pool.run(
                    step_times, args.microbatches, args.steps, schedule=schedule, width=args.width
                ).results
            except Exception as e:  # noqa: BLE001 - a torch schedule failing on gloo is a result
                print(
                    f"{schedule:>18}   torch {theirs} failed: {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:80]}"
                )
                continue
            times = [r["times"] for r in per_rank]
            ours = median_of_slowest(times, "ours")
            torch_t = median_of_slowest(times, f"torch {theirs}")
            mem = {k: max(r["peaks"][k] for r in per_rank) for k in per_rank[0]["peaks"]}
            ours_m, torch_m = mem["ours"], mem[f"torch {theirs}"]
            t_ratio, m_ratio = ours / torch_t, ours_m / torch_m
            print(
                f"{schedule:>18}{ours * 1e3:>9.1f}{torch_t * 1e3:>10.1f}{t_ratio:>12.2f}"
                f"{ours_m / 2**20:>9.2f}MB{torch_m / 2**20:>10.2f}MB{m_ratio:>14.2f}"
            )
    print("targets: time ratio <= 1.0, memory ratio <= 1.0")


def gpipe_bubbles() -> None:
    f, b = 20.0, 40.0
    print(
        f"\n2. GPipe bubble under simulated compute (F {f:g} ms, B {b:g} ms per stage): "
        "measured, simulated, formula"
    )
    print(f"{'p':>3}{'m':>4}{'measured':>10}{'simulated':>11}{'formula':>9}")
    for p in (2, 4):
        with Pool(p, device="cpu", timeout=3600) as pool:
            for m in (1, 2, 4, 8, 16):
                run = pool.run(train, gpipe(p, m), 1, batch=32, forward_ms=f, backward_ms=b)
                predicted = simulate(gpipe(p, m), Costs(forward=f / 1e3, backward=b / 1e3)).bubble
                print(
                    f"{p:>3}{m:>4}{bubble_of(run):>10.3f}{predicted:>11.3f}"
                    f"{gpipe_bubble(p, m):>9.3f}"
                )


def against_the_simulator() -> None:
    f, b = 20.0, 40.0
    print(
        f"\n3. measured against simulated, p = 4, simulated compute (F {f:g} ms, B {b:g} ms "
        "for one rank's layers, W half of B)"
    )
    print(
        f"{'schedule':>18}{'m':>4}{'bubble':>8}{'simulated':>11}{'peak act.':>11}"
        f"{'simulated':>11}{'ratio':>7}"
    )
    with Pool(4, device="cpu", timeout=3600) as pool:
        for schedule in ALL_SCHEDULES:
            for m in (4, 8, 16):
                try:
                    schedule_by_name(schedule, 4, m)
                except ValueError as e:  # e.g. DualPipeV needs m >= 2p = 8
                    print(f"{schedule:>18}{m:>4}   ({e})")
                    continue
                run = pool.run(
                    train,
                    schedule_by_name(schedule, 4, m),
                    1,
                    batch=32,
                    forward_ms=f,
                    backward_ms=b,
                )
                s = summarize(run.results, Costs(forward=f / 1e3, backward=b / 1e3))
                print(
                    f"{schedule:>18}{m:>4}{s.bubble:>8.3f}{s.simulated_bubble:>11.3f}"
                    f"{s.peak_bytes / 1024:>9.1f}kB{s.simulated_peak_bytes / 1024:>9.1f}kB"
                    f"{s.peak_bytes / s.simulated_peak_bytes:>7.2f}"
                )


def deepseek_table() -> None:
    from parcourse.pipeline.schedule import dualpipe, one_f_one_b, zero_bubble_h1
    from parcourse.theory import deepseek_table as table

    p, m, f, b, w = 4, 16, 1.0, 2.0, 1.0
    print(
        f"\n4. DeepSeek-V3's table 2 at PP = {p}, F = {f:g}, B = {b:g}, W = {w:g} (idle time "
        "per rank; parameters and activations per rank, x one stage's / microbatch's)"
    )
    print(f"{'':>24}{'formula':>9}{'simulated':>11}{'params':>8}{'activations':>13}")
    for overlap in (0.7, 1.0, None):
        fb = (overlap or 1.0) * (f + b)
        rows = table(p, f, b, w, fb)
        for name, build in (
            ("1F1B", one_f_one_b),
            ("ZB1P", zero_bubble_h1),
            ("DualPipe", dualpipe),
        ):
            if name != "DualPipe" and overlap != 0.7:
                continue
            t = simulate(
                build(p, m),
                Costs(
                    forward=f, backward=b, weight=w, overlap=overlap if name == "DualPipe" else None
                ),
            )
            idle = max(t.step_time - busy for busy in t.busy)
            label = (
                name
                if name != "DualPipe"
                else (f"DualPipe, F&B {overlap:g}(F+B)" if overlap else "DualPipe, run apart")
            )
            formula = f"{rows[name]['bubble']:.2f}" if overlap else "-"
            print(
                f"{label:>24}{formula:>9}{idle:>11.2f}{rows[name]['parameters']:>8}"
                f"{max(t.peak_in_flight):>6} ({rows[name]['activations']})"
            )
    print(
        "run apart, the formula does not apply (F&B = F + B but the pair need not start "
        "together): theory.dualpipe_apart_bubble_time gives (PP/2-1)(F+B-2W) = "
        f"{(p / 2 - 1) * (f + b - 2 * w):.2f}"
    )
    with Pool(p, device="cpu", timeout=3600) as pool:
        run = pool.run(
            train,
            schedule_by_name("dualpipe", p, 8),
            1,
            batch=32,
            forward_ms=20.0,
            backward_ms=40.0,
        )
        per_rank = [sum(t.numel() for t in r["weights"].values()) for r in run.results]
        stage = per_rank[0] / 2  # the MLP's stages are equal
        s = summarize(run.results, Costs(forward=0.02, backward=0.04))
        print(
            f"DualPipe measured, p = {p}, m = 8: parameters per rank "
            f"{[round(n / stage, 2) for n in per_rank]} x one stage's (table: 2); peak "
            f"in-flight microbatches per rank {s.per_rank_in_flight} (table: PP + 1 = "
            f"{p + 1}); bubble {s.bubble:.3f} measured, {s.simulated_bubble:.3f} simulated"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--only", choices=("torch", "gpipe", "simulator", "deepseek"), default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, gloo on CPU, one thread per rank")
    if args.only in (None, "torch"):
        compare_with_torch(args)
    if args.only in (None, "gpipe"):
        gpipe_bubbles()
    if args.only in (None, "simulator"):
        against_the_simulator()
    if args.only in (None, "deepseek"):
        deepseek_table()


if __name__ == "__main__":
    main()
