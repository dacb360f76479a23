"""Training in fewer bits: the course's GPT on the corpus under ZeRO-2, once per precision,
its final loss against fp32's and the bytes each rank sends a step.

    python benchmarks/low_precision.py [--world-size 2] [--steps 60] [--corpus runs/corpus]

Then the wire formats: the same GPT in fp32 under bucketed data parallelism with each
communication hook of `parcourse.data_parallel.compress` (bf16, FP8 e4m3 with a scale a
128 values, PowerSGD at rank 4 from step 10 with error feedback), and under ZeRO-3 in bf16
with and without `fp8_all_gather`: the loss, each step's gradient error against the exact
fp32 average (`Measured`, an uncounted second all-reduce), and the bytes a rank sends a
step (the mean over ranks of the last step) against the formula.

Precisions: fp32; bf16 compute (fp32 masters); fp16 compute with torch's ShardedGradScaler
over the group; fp16 with no scaler; FP8 (`parcourse.fp8.convert_to_float8`: every
Linear's products on e4m3 / e5m2 operands, fp32 elsewhere). The same seed, data and Adam
for each; bytes counted message by message by the course's ring (`tracer.total`),
against the formula 2 (N-1)/N x P x the message's bytes an element (ZeRO-2 sends what
data parallelism does). FP8 in this table changes the compute only: its messages are fp32 (the
wire formats below move fewer bits). There is no GPU here: no step times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parcourse.corpus import build_corpus  # noqa: E402
from parcourse.experiments.low_precision import (  # noqa: E402
    CONFIG,
    PRECISIONS,
    WIRES,
    sent_formula,
    train,
    train_wire,
)
from parcourse.launch import Pool  # noqa: E402


def wires(pool: Pool, corpus: str, steps: int) -> None:
    n = pool.world_size
    print()
    print(
        f"Wire formats: the same GPT, bucketed data parallelism over {n} ranks in fp32 (or "
        f"ZeRO-3 in bf16), {steps} Adam steps"
    )
    print(
        f"{'wire':<24}{'loss':>8}{'vs fp32':>9}{'grad error':>12}"
        f"{'bytes / step':>14}{'formula':>11}"
    )
    base = None
    for wire in WIRES:
        results = pool.run(train_wire, corpus, wire, steps).results
        loss = statistics.fmean(results[0]["losses"][-5:])
        base = loss if base is None else base
        sent = statistics.fmean(r["sent"] for r in results)
        errors = results[0]["errors"]
        error = f"{statistics.fmean(errors):.2e}" if errors else "-"
        formula = results[0]["formula"]
        shown = "-" if formula != formula else f"{formula:,.0f}"
        print(f"{wire:<24}{loss:>8.3f}{loss / base:>9.3f}{error:>12}{sent:>14,.0f}{shown:>11}")
    print(
        "(grad error: |average - fp32's| / |fp32's| a step, the mean over steps; PowerSGD's "
        "over the steps from 10 on, plain all-reduces before it. ZeRO-3's rows: its gathers, "
        "reduce-scatter and flags; FP8 halves the gathers' bytes)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--corpus", default=str(REPO / "runs" / "corpus"))
    args = p.parse_args()
    if args.world_size < 2 or args.steps < 5:
        p.error("--world-size must be at least 2 and --steps at least 5")
    corpus = build_corpus(args.corpus)
    n = args.world_size
    print(
        f"GPT {CONFIG.n_layers} x {CONFIG.d_model} (vocab {CONFIG.vocab}), ZeRO-2 over {n} "
        f"ranks, the corpus, {args.steps} Adam steps; loss: mean of the last 5 steps"
    )
    print(
        f"{'precision':<16}{'loss':>8}{'vs fp32':>9}{'skipped':>9}"
        f"{'bytes sent / step':>19}{'formula':>11}"
    )
    fp32_loss = None
    with Pool(n) as pool:
        for precision in PRECISIONS:
            results = pool.run(train, str(corpus.directory), precision, args.steps).results
            r = results[0]
            loss = statistics.fmean(r["losses"][-5:])
            fp32_loss = loss if fp32_loss is None else fp32_loss
            formula = sent_formula(r["params"], n, precision)
            print(
                f"{precision:<16}{loss:>8.3f}{loss / fp32_loss:>9.3f}{r['skipped']:>9}"
                f"{r['sent']:>19,.0f}{formula:>11,.0f}"
            )
        print(
            "(bytes of rank 0 in its last step; the formula counts parameters only, the "
            "messages also carry padding rows and one used-flag a parameter)"
        )
        wires(pool, str(corpus.directory), args.steps)


if __name__ == "__main__":
    main()
