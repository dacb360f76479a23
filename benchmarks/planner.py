"""The planner against the published record and against runs here.

    python benchmarks/planner.py [--only paper|here]

1. Narayanan et al. 2021 (arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters
   on 32 to 3072 A100s (80 GB, 312 TFLOP/s dense bf16 peak), with the paper's own tensor-
   and pipeline-parallel sizes, GPUs, global batch, sequence 2048, vocabulary 51200, full
   activation recomputation, Megatron-LM's split (the blocks evenly over the stages, the
   embeddings with the first, the head with the last); microbatches of one sequence, 1F1B
   (the paper interleaves some runs; with this many microbatches per stage the bubble
   differs little). Printed
   beside the paper's achieved TFLOP/s per GPU: the planner's, counted as the paper
   counts (its Eq. 3: recomputation's extra forward included), and the busiest GPU's
   predicted memory. The achievable fraction of the peak is an input (0.5 here, about
   what large GEMMs reach): the comparison checks what the planner adds to it (the
   pipeline's bubble and messages, tp's collectives, dp's reduction), not GEMM
   efficiency. Target: within 15%.
2. Here: the course's GPT on 4 ranks, a few configurations, predicted beside measured
   (memory of the busiest rank; step time, median of 5 after a warm-up). The time model
   for gloo on two shared cores (link costs, Python overheads) is not calibrated yet:
   the error is reported, not targeted.
"""

from __future__ import annotations

import argparse

from parcourse.models import GPTConfig
from parcourse.planner import Choice, Cluster, predict_memory, predict_time

# (parameters in billions, heads, width, layers, tp, pp, GPUs, global batch, achieved
# TFLOP/s per GPU), Narayanan et al. 2021, Table 1.
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def paper_flops(config: GPTConfig, batch: int) -> float:
    """Narayanan et al.'s Eq. 3: FLOPs of one step with activation recomputation,
    96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    b, s, lay, h, v = batch, config.block_size, config.n_layers, config.d_model, config.vocab
    return 96 * b * s * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))


def against_the_paper() -> None:
    print("Narayanan et al. 2021, Table 1, beside the planner (A100 80 GB, 312 TFLOP/s, "
          "achievable 0.5; 1F1B, one sequence a microbatch, full recompute, blocks split evenly)")
    print(f"{'params':>8} {'tp':>3} {'pp':>3} {'GPUs':>5} {'batch':>6} {'paper':>7} "
          f"{'planner':>8} {'ratio':>6} {'bubble':>7} {'tp':>5} {'dp':>5} {'memory GiB':>11}")
    ratios = []
    for billions, heads, width, layers, tp, pp, gpus, batch, achieved in TABLE_1:
        config = GPTConfig(vocab=51200, block_size=2048, n_layers=layers, n_heads=heads,
                           d_model=width)
        dp = gpus // (tp * pp)
        choice = Choice(dp, tp, pp, "1f1b", batch // dp, recompute="full", split="blocks")
        cluster = Cluster.preset("a100", gpus)
        time = predict_time(config, choice, batch, cluster, dtype="bf16")
        memory = max(m["total"] for m in predict_memory(config, choice, batch, "bf16"))
        ours = paper_flops(config, batch) / time["step"] / gpus / 1e12
        ratios.append(ours / achieved)
        share = {k: time[k] / time["step"] for k in ("bubble", "tp", "dp")}
        print(f"{billions:>7.1f}B {tp:>3} {pp:>3} {gpus:>5} {batch:>6} {achieved:>7} "
              f"{ours:>8.1f} {ours / achieved:>6.2f} {share['bubble']:>7.1%} "
              f"{share['tp']:>5.1%} {share['dp']:>5.1%} {memory / 2**30:>11.1f}")
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"planner / paper: mean {sum(ratios) / len(ratios):.2f}, worst {worst:.2f} "
          "(target: within 15%)")


def here() -> None:
    from parcourse import Pool
    from parcourse.experiments.hybrid import LESSON_CONFIG
    from parcourse.planner import (measure, measure_flops, measure_links,
                                   measured_against_predicted)

    batch = 16
    with Pool(4, timeout=600) as pool:
        links = pool.run(measure_links).results[0]
    cluster = Cluster.this_machine(4, flops=measure_flops(LESSON_CONFIG), links=links)
    choices = [Choice(4, 1, 1, "1f1b", 2), Choice(2, 2, 1, "1f1b", 2),
               Choice(2, 1, 2, "1f1b", 4), Choice(1, 2, 2, "1f1b", 4, zero=0),
               Choice(1, 1, 4, "gpipe", 4), Choice(2, 1, 2, "interleaved-1f1b", 4, zero=1)]
    print(f"\nthe course's GPT here, 4 ranks, global batch {batch}; one rank alone reaches "
          f"{cluster.peak_flops / 1e9:.2f} GFLOP/s on it, shared {cluster.achievable:g}; gloo: "
          f"a message {1e3 * links['p2p_s']:.2f} ms, a tiny all-reduce "
          + ", ".join(f"{1e3 * v:.2f} ms on {k}" for k, v in links["collective_s"].items()))
    print(f"{'configuration':<40} {'memory pred.':>13} {'measured':>10} {'step pred. ms':>14} "
          f"{'measured':>9} {'ratio':>6}")
    with Pool(4, timeout=600) as pool:
        for choice in choices:
            results = pool.run(measure, LESSON_CONFIG, choice, batch, 6).results
            rows = measured_against_predicted(results, LESSON_CONFIG, choice, batch)
            got = max(r["measured"]["total"] for r in rows)
            want = max(r["predicted"]["total"] for r in rows)
            times = sorted(max(ts) for ts in zip(*(r["times"] for r in results)))
            step = times[len(times) // 2]
            predicted = predict_time(LESSON_CONFIG, choice, batch, cluster)["step"]
            print(f"{choice.label():<40} {want / 1024:>10.1f} KiB {got / 1024:>6.1f} KiB "
                  f"{1e3 * predicted:>14.1f} {1e3 * step:>9.1f} {predicted / step:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("paper", "here"), default=None)
    args = parser.parse_args()
    if args.only in (None, "paper"):
        against_the_paper()
    if args.only in (None, "here"):
        here()


if __name__ == "__main__":
    main()
