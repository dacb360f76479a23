"""Step time of NaiveDataParallel, BucketedDataParallel and torch's DistributedDataParallel.

    python benchmarks/data_parallel.py [--steps 20] [--width 512] [--depth 6] [--batch 256]

Same model (an MLP), data and bucket size for all; world size 2, gloo, one
thread per rank; configurations alternate step by step in one run; each step
lasts as long as its slowest rank; medians. Then the same with a simulated link
(our implementations only: torch's all_reduce cannot be slowed down), where
overlapping communication with backward matters.

Targets: bucketed / torch DDP <= 1.05; with the link on, bucketed clearly faster
than naive.
"""

from __future__ import annotations

import argparse

import torch

from parcourse import Pool
from parcourse.experiments.data_parallel import compare_step_times
from parcourse.experiments.timing import median_of_slowest


def medians(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    return {name: median_of_slowest(per_rank, name) for name in per_rank[0]}


def table(title: str, med: dict[str, float], baseline: str) -> None:
    print(f"\n{title}")
    print(f"{'configuration':<34}{'step (ms)':>10}{'vs ' + baseline:>16}")
    for name, t in med.items():
        print(f"{name:<34}{t * 1e3:>10.1f}{t / med[baseline]:>15.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    shape = dict(width=args.width, depth=args.depth, batch=args.batch)
    params = args.depth * (args.width * args.width + args.width)
    print(
        f"torch {torch.__version__}, {args.world_size} ranks, gloo, one thread per rank; "
        f"MLP {args.depth} x {args.width} = {params / 1e6:.2f} M parameters "
        f"({params * 4 / 2**20:.1f} MiB of gradients), batch {args.batch}"
    )
    b = args.bucket_mb
    plain = {
        "torch DDP": {"impl": "torch", "bucket_mb": b},
        f"bucketed ({b:g} MB)": {"impl": "bucketed", "bucket_mb": b},
        "bucketed (1 MB)": {"impl": "bucketed", "bucket_mb": 1.0},
        "torch DDP (1 MB)": {"impl": "torch", "bucket_mb": 1.0},
        "naive": {"impl": "naive"},
    }
    linked = {
        "naive": {"impl": "naive"},
        "bucketed (1 MB), no overlap": {"impl": "bucketed", "bucket_mb": 1.0, "overlap": False},
        "bucketed (1 MB), overlap": {"impl": "bucketed", "bucket_mb": 1.0},
    }
    with Pool(args.world_size, timeout=3600) as pool:
        med = medians(pool.run(compare_step_times, plain, args.steps, **shape).results)
        table("loopback (no simulated link)", med, "torch DDP")
        ratio = med[f"bucketed ({b:g} MB)"] / med["torch DDP"]
        print(
            f"bucketed / torch DDP at {b:g} MB: {ratio:.2f} (target <= 1.05: "
            f"{'met' if ratio <= 1.05 else 'MISSED'}); at 1 MB: "
            f"{med['bucketed (1 MB)'] / med['torch DDP (1 MB)']:.2f}"
        )
        # Many small tensors (as real networks have: biases, norms) make per-message
        # latency count, which is what bucketing saves; enough compute to overlap.
        deep = dict(width=256, depth=24, batch=1024)
        med = medians(
            pool.run(
                compare_step_times,
                linked,
                max(4, args.steps // 2),
                **deep,
                latency_us=500.0,
                bandwidth_gbps=0.2,
            ).results
        )
        table("simulated link: 500 us, 0.2 GB/s (our ring); MLP 24 x 256, batch 1024", med, "naive")
        speedup = med["naive"] / med["bucketed (1 MB), overlap"]
        print(
            f"bucketed with overlap is {speedup:.2f}x faster than naive "
            f"(target: clearly faster: {'met' if speedup >= 1.15 else 'MISSED'})"
        )


if __name__ == "__main__":
    main()
