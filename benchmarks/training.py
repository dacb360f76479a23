"""Training for real, measured: the loop's throughput against the planner, and what a
distributed checkpoint costs against torch.save of the gathered weights.

    python benchmarks/training.py [--dp 2] [--tp 1] [--pp 1] [--steps 60] [--width 64]
                                  [--layers 2] [--repeats 5]

1. Tokens/s and MFU of `train_on_corpus` at the given mesh (the median step after the
   first ten, the slowest rank's), beside the planner's prediction for this machine
   (`Cluster.this_machine` with one rank's FLOP/s measured on the model). MFU here: the
   model's FLOPs per second over the ranks' FLOP/s (one rank alone, times the ranks, times
   the share of the cores each gets), the planner's definition.
2. A checkpoint of the same model and its AdamW state after a step, `--repeats` times:
   `parcourse.checkpoint.save` (every rank writes its pieces, then the commit), its
   `load`, DCP's `async_save` (the time the caller is blocked, then the rest), and
   torch's usual single-file way: `full_state_dict()` gathered to every rank, then
   `torch.save` on rank 0 (weights only: the optimizer's state, sharded like the weights,
   would need gathering too). Medians; bytes written per rank; ratios against torch.save.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from parcourse import launch
from parcourse.corpus import build_corpus
from parcourse.experiments.training import checkpoint_costs
from parcourse.plan import ParallelPlan
from parcourse.train import TrainSettings, planned, train_on_corpus

WARM_UP = 10  # steps not timed: the first ones build caches and warm the allocator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis, default in (("dp", 2), ("tp", 1), ("pp", 1)):
        p.add_argument(f"--{axis}", type=int, default=default)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if a.steps <= WARM_UP:
        p.error(f"--steps must be more than {WARM_UP}: the first {WARM_UP} are not timed")
    s = TrainSettings(
        plan=ParallelPlan(dp=a.dp, tp=a.tp, pp=a.pp, microbatches=2),
        steps=a.steps,
        width=a.width,
        layers=a.layers,
        eval_every=a.steps,
        batch=16 * a.dp,
    )
    if problems := s.problems():
        raise SystemExit("; ".join(problems))
    from parcourse.planner import measure_flops

    work = Path(tempfile.mkdtemp(prefix="parcourse-training-"))
    try:
        corpus = build_corpus(work / "corpus")
        run = launch(train_on_corpus, s.world_size, s, str(corpus.directory), timeout=1800)
        steps = [
            max(r["history"][i]["seconds"] for r in run.results) for i in range(WARM_UP, s.steps)
        ]
        seconds = statistics.median(steps)
        tokens = s.batch * s.block_size
        flops = measure_flops(s.config)
        plan = planned(s, flops)
        measured_mfu = tokens / seconds * plan["flops_per_token"] / plan["ranks_flops"]
        print(
            f"training loop: {s.plan.label()}, GPT {s.layers} blocks of "
            f"width {s.width}, batch {s.batch} x {s.block_size} bytes, {s.steps} steps "
            f"(median of steps 10-{s.steps - 1}); one rank alone: {flops / 1e9:.2f} GFLOP/s"
        )
        print(f"{'':>10} {'step ms':>9} {'tokens/s':>10} {'MFU':>7}")
        print(
            f"{'measured':>10} {seconds * 1e3:>9.1f} {tokens / seconds:>10.0f} {measured_mfu:>7.1%}"
        )
        print(
            f"{'planned':>10} {plan['step'] * 1e3:>9.1f} {plan['tokens_per_s']:>10.0f} "
            f"{plan['mfu']:>7.1%}"
        )
        print(f"measured / planned tokens/s: {tokens / seconds / plan['tokens_per_s']:.2f}\n")

        root = work / "checkpoints"
        costs = launch(
            checkpoint_costs, s.world_size, s, str(root), a.repeats, timeout=1800
        ).results
        slowest = {k: max(c["median"][k] for c in costs) for k in costs[0]["median"]}
        torch_s = slowest["torch_save"]
        print(
            f"checkpoint of the weights and AdamW's state ({a.repeats} times, medians, "
            "the slowest rank):"
        )
        print(f"{'':>32} {'seconds':>9} {'/ torch.save':>13}")
        for key, label in (
            ("save", "parcourse.checkpoint.save"),
            ("load", "parcourse.checkpoint.load"),
            ("async_blocked", "DCP async_save, caller blocked"),
            ("async_total", "DCP async_save, until written"),
            ("torch_save", "gather + torch.save on rank 0"),
        ):
            print(f"{label:>32} {slowest[key]:>9.4f} {slowest[key] / torch_s:>13.2f}")
        print(
            "bytes written per rank: "
            + ", ".join(f"rank {r}: {c['written'] / 1e6:.2f} MB" for r, c in enumerate(costs))
            + f"; torch.save (weights only, rank 0): {costs[0]['torch_bytes'] / 1e6:.2f} MB"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
