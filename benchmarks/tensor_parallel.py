"""Tensor parallelism: bytes per rank against the formulas; step time against PyTorch's own.

    python benchmarks/tensor_parallel.py [--steps 30] [--batch 8] [--width 64]

1. Parameter bytes and bytes saved for backward (one forward to the logits) on each
   rank, world sizes 2 and 4, with and without sequence parallelism, measured from
   live tensor storages, against `parcourse.theory.tp_parameter_bytes` and
   `tp_activation_bytes`. Target: within 2% (they are counted exactly, so 1.000).
   And the step's collectives against `tp_collectives` (count and bytes).
2. Training step time (forward, vocab-parallel loss, backward, Adam) of the tiny GPT
   split over 2 ranks: ours (parcourse.tensor_parallel, GPT_PLAN) against PyTorch's
   DTensor tensor parallelism (`parallelize_module` with ColwiseParallel /
   RowwiseParallel, plus SequenceParallel and `loss_parallel`) on the same model and
   plan, alternating step by step in one run; median of the slowest rank per step.
   Target: ours / torch <= 1.0 (ours on gloo's collectives, `TPComm`'s default). Both
   start from the same weights; their losses are printed side by side.

torch's DTensor tensor parallelism runs on gloo CPU in torch 2.13 (DESIGN.md lists it as
a baseline). Were it to fail here, the benchmark prints torch's exception (type and
message) in place of its times and times ours alone.
"""

from __future__ import annotations

import argparse

import torch

from parcourse import Pool, RankError
from parcourse.experiments.tensor_parallel import step_times, train
from parcourse.experiments.timing import median_of_slowest
from parcourse.memory import format_bytes
from parcourse.models import GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=64, help="d_model")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be >= 1")
    config = GPTConfig(d_model=args.width, n_layers=args.layers)
    print(
        f"torch {torch.__version__}, gloo on CPU, one thread per rank; GPT {config.n_layers} "
        f"layers, d_model {config.d_model}, {config.n_heads} heads, vocab {config.vocab}, "
        f"{config.block_size} tokens, batch {args.batch}, Adam, fp32"
    )

    print(
        "\n1. bytes per rank (largest rank), measured / formula; collectives of one step "
        "(on the course's ring, which counts them)"
    )
    print(
        f"{'ranks':>5} {'sequence':>9}{'parameters':>24}{'activations':>24}  within 2%"
        f"{'collectives':>14}"
    )
    for world_size in (2, 4):
        with Pool(world_size, timeout=600) as pool:
            for sp in (False, True):
                results = pool.run(train, config, 1, args.batch, sequence_parallel=sp).results
                worst, cells = 0.0, ""
                for what in ("param_bytes", "activation_bytes"):
                    got = max(r[what] for r in results)
                    ratio = got / results[0]["theory"][what]
                    worst = max(worst, abs(ratio - 1))
                    cells += f"{format_bytes(got):>15} ({ratio:.3f})"
                same = all(r["collectives"] == r["theory"]["collectives"] for r in results)
                n = len(results[0]["collectives"])
                print(
                    f"{world_size:>5} {'split' if sp else 'whole':>9}{cells}  "
                    f"{'met' if worst <= 0.02 else 'MISSED':>9}"
                    f"{(f'{n} as formula' if same else 'DIFFER'):>14}"
                )

    print(
        f"\n2. step time, world size 2, {args.steps} steps alternating (median of the "
        "slowest rank per step)"
    )
    print(f"{'':>22}{'ours':>10}{'torch':>10}{'ours / torch':>14}  target <= 1.0")
    with Pool(2, timeout=1800) as pool:
        for sp in (False, True):
            label = "sequence parallel" if sp else "tensor parallel"
            try:
                per_rank = pool.run(
                    step_times, args.steps, config, args.batch, sequence_parallel=sp
                ).results
            except RankError as e:
                print(
                    f"{label:>22}  torch's tensor parallelism failed on gloo CPU: "
                    f"{e.exc_type}: {str(e).splitlines()[0]}"
                )
                per_rank = pool.run(
                    step_times,
                    args.steps,
                    config,
                    args.batch,
                    sequence_parallel=sp,
                    impls=("ours",),
                ).results
                ours = median_of_slowest([r["times"] for r in per_rank], "ours")
                print(f"{'':>22}{ours * 1e3:>8.1f}ms (ours alone)")
                continue
            times = [r["times"] for r in per_rank]
            med = {impl: median_of_slowest(times, impl) for impl in ("ours", "torch")}
            ratio = med["ours"] / med["torch"]
            print(
                f"{label:>22}{med['ours'] * 1e3:>8.1f}ms{med['torch'] * 1e3:>8.1f}ms"
                f"{ratio:>14.2f}  {'met' if ratio <= 1.0 else 'MISSED'}"
            )
            losses = per_rank[0]["losses"]
            print(
                f"{'':>22}losses, first -> last: ours {losses['ours'][0]:.4f} -> "
                f"{losses['ours'][-1]:.4f}, torch {losses['torch'][0]:.4f} -> "
                f"{losses['torch'][-1]:.4f}"
            )


if __name__ == "__main__":
    main()
