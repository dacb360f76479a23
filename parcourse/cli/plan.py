"""`python -m parcourse plan`: the planner's ranked table of (dp, tp, pp, schedule,
microbatches, ZeRO, recompute, sequence parallel) for a model on a cluster, with the
memory of each configuration's busiest pipeline rank, its predicted step time split into
compute / tp / bubble / dp, tokens/s and MFU, then the reasons the closest others were
turned down. `--check` (the course's GPT on this machine) measures the top ones here;
with `--scaled S`, with the compute simulated (one rank alone S seconds a step, as
`benchmarks/planner.py --only scaled`), where the prediction is within a few percent."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING

from parcourse.cli.options import at_least_one

if TYPE_CHECKING:
    from parcourse.launch import Pool
    from parcourse.models import GPTConfig
    from parcourse.planner import Cluster

HELP = "the planner: predicted memory and step time of every 3D configuration, ranked"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from parcourse.planner import MODELS

    p.add_argument(
        "--model",
        default="course",
        choices=("course", *MODELS),
        help="course: lesson 09's GPT, fp32, on this machine (default); or a "
        "GPT-style shape of that size, bf16",
    )
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument(
        "--gpu",
        default=None,
        choices=("a100", "h100", "h200", "here"),
        help="h100 by default; here (this machine's ranks) for the course's GPT",
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch in sequences (16 for the course's GPT, else 1024)",
    )
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence (2048)")
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="the course's GPT with each block's MLP a mixture of this many "
        "experts (dropless): the planner searches ep too",
    )
    p.add_argument("--top-k", type=int, default=2, help="experts a token (with --experts)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument(
        "--check",
        action="store_true",
        help="measure the top configurations here (the course's GPT only)",
    )
    p.add_argument(
        "--scaled",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the course's GPT here with its compute simulated, as a GPU's beside "
        "this machine's links: one rank alone takes SECONDS a step; each "
        "stage's forward and backward is padded to the planner's compute "
        "(planned and, with --check, measured so)",
    )


def _gpu(args: argparse.Namespace) -> str:
    """The GPU asked for: here (this machine's ranks) for the course's GPT by default,
    else h100."""
    return args.gpu or ("here" if args.model == "course" else "h100")


def _setup(
    args: argparse.Namespace, pool: Pool | None = None
) -> tuple[GPTConfig, Cluster, int, str]:
    from parcourse.experiments.hybrid import LESSON_CONFIG
    from parcourse.planner import Cluster, measure_paced, measured_here, model, scaled

    if args.model == "course":
        config, batch = LESSON_CONFIG, args.batch or 16
        if args.experts:
            config = dataclasses.replace(config, experts=args.experts, top_k=args.top_k)
    else:
        config = model(args.model, 2048 if args.seq is None else args.seq)
        batch = args.batch or 1024
    gpu = _gpu(args)
    if gpu == "here":
        cluster = measured_here(args.gpus, config, pool=pool)
        if args.scaled is not None:  # tp's collectives as such a step meets them
            paced = {}
            if args.gpus > 1:
                assert pool is not None, "--scaled measures on a pool of --gpus ranks"
                paced = pool.run(measure_paced).results[0]
            cluster = scaled(cluster, config, batch, args.scaled, paced)
    else:
        cluster = Cluster.preset(gpu, args.gpus, args.gpus_per_node)
    return config, cluster, batch, "fp32" if args.model == "course" else "bf16"


def check(args: argparse.Namespace) -> str | None:
    if args.experts and args.model != "course":
        return (
            "--experts makes the course's GPT a mixture of experts (the planner prices "
            "experts in fp32): --model course"
        )
    if args.experts < 0 or args.experts and not 1 <= args.top_k <= args.experts:
        return (
            f"--experts must be >= 0 and --top-k between 1 and the experts, got "
            f"{args.experts} and {args.top_k}"
        )
    if problem := at_least_one(args, "gpus", "gpus_per_node", "top"):
        return problem
    if args.batch is not None and args.batch < 1:
        return f"--batch must be at least 1, got {args.batch}"
    if args.seq is not None and args.seq < 1:
        return f"--seq must be at least 1, got {args.seq}"
    if args.check and args.model != "course":
        return "--check measures here: only the course's GPT (--model course) runs here"
    if args.check and args.gpus > 8:
        return f"--check runs {args.gpus} ranks on this machine: at most 8"
    here = _gpu(args) == "here"
    if here and args.gpus > 8:
        return (
            f"--gpu here measures what a step costs on {args.gpus} ranks of this machine: at most 8"
        )
    if args.scaled is not None and not (args.model == "course" and here):
        return "--scaled simulates the course's GPT's compute here: --model course, --gpu here"
    if args.scaled is not None and not (math.isfinite(args.scaled) and args.scaled > 0):
        return f"--scaled must be a positive number of seconds, got {args.scaled}"
    if args.model == "course" and args.seq is not None:
        return "the course's GPT has its own sequence length (16): leave --seq out"
    return None


def _gib(n: float) -> str:
    from parcourse.memory import format_bytes

    return format_bytes(n)


def run(args: argparse.Namespace) -> int:
    from parcourse.launch import Pool

    # One pool of ranks measures this machine's links, prices the collectives (--scaled)
    # and runs the check (a step of it, scaled: about --scaled / --gpus seconds)
    here = args.gpus > 1 and _gpu(args) == "here"
    if not (args.check or args.scaled is not None and here):
        return _run(args, None)
    with Pool(args.gpus, timeout=max(600, 8 * (args.scaled or 0))) as pool:
        return _run(args, pool)


def _run(args: argparse.Namespace, pool: Pool | None) -> int:
    from parcourse.planner import format_plans, parameters, plan

    config, cluster, batch, dtype = _setup(args, pool)
    plans = plan(config, cluster, batch, dtype=dtype)  # type: ignore[arg-type]  # checked str
    print(
        f"plan        {args.model}: {parameters(config) / 1e9:.3g}B parameters, "
        f"{config.n_layers} layers, width {config.d_model}, {config.n_heads} heads, "
        f"{config.block_size} tokens; global batch {batch}; {dtype}"
    )
    print(
        f"cluster     {cluster.gpus} x {cluster.name}, {cluster.gpus_per_node} a node, "
        f"{_gib(cluster.memory)} each, {cluster.peak_flops / 1e12:.3g} TFLOP/s peak x "
        f"{cluster.achievable:g} achievable"
        + (
            f", memory-bound work at {cluster.memory_bandwidth / 1e12:.3g} TB/s"
            if cluster.memory_bandwidth
            else ""
        )
        + (f"; {cluster.gpus} ranks share {cluster.cores} cores" if cluster.cores else "")
        + (" (for the optimizer)" if cluster.compute_simulated else "")
    )
    print()
    print(format_plans(plans, args.top))
    if args.check:
        assert pool is not None, "run() gives --check its pool"
        _check(args, config, cluster, plans, batch, pool)
    return 0


def _check(
    args: argparse.Namespace,
    config: GPTConfig,
    cluster: Cluster,
    plans: object,
    batch: int,
    pool: Pool,
) -> None:
    """The top configurations the course's 3D step runs, measured here beside the
    prediction: the busiest rank's memory and the step time (with --scaled, each stage's
    compute padded to the planner's: `stage_compute`)."""
    from parcourse.parts import PARTS, inside_actions
    from parcourse.planner import Contention, measure, measured_against_predicted, stage_compute

    # Here the search ranks only what the course's step runs (`ParallelPlan.problems`);
    # with the compute simulated, not the parts whose messages run inside an action:
    # padding each action to its compute would hide them (`parts.inside_actions`)
    ranked = plans.ranked  # type: ignore[attr-defined]  # a `Plans`, passed untyped
    runnable = [p for p in ranked if args.scaled is None or not inside_actions(p.choice)]
    runnable = runnable[: min(3, args.top)]
    if runnable != ranked[: len(runnable)]:
        axes = " or ".join(a.name for part in PARTS if part.inside for a in part.axes)
        print(f"\n(plans with {axes} are measured with their compute real: without --scaled)")
    print(
        f"\nmeasured here ({args.gpus} ranks"
        + (
            f", compute simulated: one rank alone {args.scaled:g} s a step"
            if args.scaled is not None
            else ""
        )
        + f"), the top {len(runnable)}:"
    )
    print(
        f"{'':>3}  {'configuration':<44} {'memory pred.':>13} {'measured':>10} "
        f"{'step pred. ms':>14} {'measured':>9}  {Contention.HEADER}"
    )
    busiest = 0.0  # the most that steal or others read in a row
    for k, p in enumerate(runnable, 1):
        compute = (
            stage_compute(config, p.choice, batch, cluster.flops)
            if args.scaled is not None
            else None
        )
        with Contention(pool) as contention:
            results = pool.run(measure, config, p.choice, batch, 4, compute).results
        busiest = max(busiest, contention.steal or 0, contention.others or 0)
        rows = measured_against_predicted(results, config, p.choice, batch)
        got = max(r["measured"]["total"] for r in rows)
        want = max(r["predicted"]["total"] for r in rows)
        times = sorted(max(ts) for ts in zip(*(r["times"] for r in results)))
        print(
            f"{k:>3}  {p.choice.label():<44} {_gib(want):>13} {_gib(got):>10} "
            f"{1e3 * p.time['step']:>14.1f} {1e3 * times[len(times) // 2]:>9.1f}  "
            f"{contention}"
        )
    print(
        "steal: the host's other tenants' share of the processors while the row ran; "
        "others: this machine's other processes'"
        + (
            ". Where either is large, that row's step may read slower than it is."
            if busiest >= 0.05
            else ""
        )
    )
