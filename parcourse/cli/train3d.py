"""`python -m parcourse train3d`: the GPT trained a few steps on a dp x tp x pp (x cp) mesh,
its loss beside one process's, and how far its weights are from one process's."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from parcourse.cli.options import (
    at_least_one,
    mesh_against_launcher,
    plan_from,
    plan_options,
    ranks,
)
from parcourse.launch import RankContext, launch
from parcourse.parts import AXES, CORE_AXES, PART_AXES, PARTS
from parcourse.plan import ParallelPlan

if TYPE_CHECKING:
    from parcourse.models import GPTConfig

HELP = "3D parallelism: train the GPT on a dp x tp x pp mesh, beside one process"


# The plan trained when no flag says otherwise.
DEFAULT_PLAN = ParallelPlan(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    plan_options(p, DEFAULT_PLAN)  # --plan, and --dp, --tp, ... from the plan's fields
    p.add_argument(
        "--clip",
        type=float,
        default=None,
        metavar="MAX_NORM",
        help="clip the gradients by their global norm (over every axis)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--width", type=int, default=32, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16, help="tokens per sequence")
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="every block's MLP a mixture of this many experts (0: dense)",
    )
    p.add_argument("--top-k", type=int, default=2, help="experts a token goes to")
    p.add_argument("--timeout", type=float, default=600.0)


def _config(args: argparse.Namespace) -> GPTConfig:
    from parcourse.models import GPTConfig

    return GPTConfig(
        vocab=64,
        block_size=args.block_size,
        n_layers=args.layers,
        n_heads=args.heads,
        d_model=args.width,
        experts=args.experts,
        top_k=args.top_k,
    )


def check(args: argparse.Namespace) -> str | None:
    """Bad sizes, before any rank starts: the plan's own rules (`ParallelPlan.problems`,
    the sentences `Hybrid` and the planner say too), then the model's and the run's."""
    plan = plan_from(args)
    if isinstance(plan, str):
        return plan
    if problem := at_least_one(args, "steps", "batch", "layers", "width", "heads", "block_size"):
        return problem
    try:
        config = _config(args)
    except ValueError as e:
        return str(e)
    if problems := plan.problems(config, args.batch):
        return "; ".join(problems)
    if problem := mesh_against_launcher(args.parallel_plan):
        return problem
    if args.clip is not None and not args.clip > 0:
        return f"--clip must be positive, got {args.clip}"
    return None


def _train(ctx: RankContext, args: argparse.Namespace) -> dict[str, object]:
    import time

    import torch

    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid, bytes_by_axis
    from parcourse.mesh import Mesh
    from parcourse.models import gpt

    config = _config(args)
    plan = args.parallel_plan
    mesh = Mesh(plan.shape, ctx.group, order=plan.order, ranks_per_node=plan.ranks_per_node)
    model = Hybrid.from_plan(
        gpt(config),
        mesh,
        plan,
        max_norm=args.clip,
        tracer=ctx.tracer,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
    )
    x, y = progressions(args.batch, config.block_size, config.vocab)
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(model.step(x, y))
        times.append(time.perf_counter() - start)
    return {
        "losses": losses,
        "times": times,
        "state": model.full_state_dict(),
        "coords": {a: mesh.coordinate(a) for a in AXES},
        "bytes": bytes_by_axis(ctx.tracer.data().counters),
        "memory": model.memory(),
    }


def _one_process(args: argparse.Namespace) -> tuple[list[float], dict[str, object]]:
    import torch
    import torch.nn.functional as F

    from parcourse.data import progressions
    from parcourse.experts import set_aux_scale, update_bias
    from parcourse.models import gpt

    config = _config(args)
    model = gpt(config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = progressions(args.batch, config.block_size, config.vocab)
    # With experts each replica's microbatch routes, caps and weighs its balancing losses
    # on its own rows: the same microbatches in turn (one batch, densely).
    parts = args.parallel_plan.replicas * args.microbatches if config.experts else 1
    set_aux_scale(model, 1 / parts)
    losses = []
    for _ in range(args.steps):
        loss = sum(
            (
                F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()) / parts
                for xs, ys in zip(x.chunk(parts), y.chunk(parts))
            ),
            start=torch.zeros(()),  # 0.0 + the first: the same bits as sum's 0
        )
        loss.backward()
        update_bias(model)
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def run(args: argparse.Namespace) -> int:
    where = ranks(argparse.Namespace(world_size=args.parallel_plan.gpus))
    trained = launch(_train, where.world_size, args, timeout=args.timeout)
    if where.quiet:
        return 0
    config = _config(args)
    plan = args.parallel_plan
    more = "".join(f" x {a} {getattr(args, a)}" for a in PART_AXES if getattr(args, a) > 1)
    parts = "".join(f", {said}" for part in PARTS if (said := part.phrase(plan, config)))
    print(
        f"train3d     dp {args.dp} x tp {args.tp} x pp {args.pp}{more} = {where.world_size} "
        f"ranks ({args.order} order), {args.schedule}, {args.microbatches} microbatches a "
        f"replica{', sequence parallel' if args.sequence_parallel else ''}{parts}"
        f"{f', ZeRO-{args.zero} over dp' if args.zero else ''}"
        f"{f', recompute {args.recompute}' if args.recompute != 'none' else ''}"
        f"{f', clipped at norm {args.clip}' if args.clip is not None else ''}"
        f", backend {trained.backend}"
    )
    print(f"plan        {args.parallel_plan.label()}")
    if plan.ranks_per_node is not None:
        _print_nodes(plan)
    moe = f", MLPs of {config.experts} experts (top {config.top_k})" if config.experts else ""
    print(
        f"model       GPT, {config.n_layers} blocks, d_model {config.d_model}, "
        f"{config.n_heads} heads, {config.block_size} tokens{moe}; global batch "
        f"{args.batch}, Adam, fp32"
    )
    losses = next(r["losses"] for r in trained.results if r["losses"][0] is not None)
    reference, state = _one_process(args)
    print(f"\nloss        step   {where.world_size} ranks    one process")
    for step, (ours, one) in enumerate(zip(losses, reference)):
        print(f"            {step:>4}   {ours:>8.4f}    {one:>8.4f}")
    ours = trained.results[0]["state"]
    diff = max((ours[k] - v).abs().max().item() for k, v in state.items())
    print(
        f"\nweights     largest difference from one process after {args.steps} steps: "
        f"{diff:.2e} (fp32: only the order of the sums differs)"
    )
    _print_bytes_and_memory(args, trained.results)
    times = [max(ts) for ts in zip(*(r["times"] for r in trained.results))][1:]
    if times:
        print(
            f"step time   {1e3 * sorted(times)[len(times) // 2]:.1f} ms (median of "
            f"{len(times)} after the first, slowest rank)"
        )
    return 0


def _print_nodes(plan: ParallelPlan) -> None:
    """Which axes' groups cross the nodes (consecutive `ranks_per_node` ranks a node)."""
    from parcourse.mesh import Layout

    layout, per = Layout.of(plan.shape, plan.order), plan.ranks_per_node
    axes = [a for a in AXES if plan.shape.get(a, 1) > 1]
    across = [a for a in axes if any(layout.crosses_nodes(r, [a], per) for r in range(plan.gpus))]
    inside = [a for a in axes if a not in across]
    print(
        f"nodes       {plan.gpus // (per or 1)} of {per} ranks; inside a node: "
        f"{', '.join(inside) or 'none'}; across nodes: {', '.join(across) or 'none'}"
    )


def _print_bytes_and_memory(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Per rank: its coordinates, bytes it sent on each axis over all steps (tp's
    collectives are torch's and not counted message by message), and what it holds,
    beside `theory.mesh_bytes`."""
    from parcourse.memory import format_bytes
    from parcourse.theory import mesh_bytes

    shape = args.parallel_plan.shape
    plan = args.parallel_plan.schedule_value()
    theory = mesh_bytes(_config(args), shape, args.zero, stages_per_rank=plan.stages // args.pp)
    print(f"\nper rank    (bytes sent over all {args.steps} steps; what each rank holds after)")
    more = [a for a in PART_AXES if getattr(args, a) > 1]
    axes = (*CORE_AXES, *more)
    # each part's own traffic (cp: attention's keys and values; ep: tokens to their
    # experts and back); "dp": the dense gradients' mean, over dp and every part's axis
    # whose ranks average the gradients and take the same rows (cp's)
    on_more = "".join(f" {f'on {a}':>10}" for a in more)
    roles = args.parallel_plan.roles
    on_dp = "on " + ", ".join(a for a in roles.dense if a not in roles.batch[1:])
    print(
        f"{'rank':>8}    {' '.join(axes):>8}  {'sent on pp':>10} {on_dp:>10}{on_more}  "
        f"{'params':>9} {'grads':>9} {'Adam':>9}"
    )
    for rank, r in enumerate(results):
        c, sent, mem = r["coords"], r["bytes"], r["memory"]
        cp_sent = "".join(f" {format_bytes(sent.get(a, 0)):>10}" for a in more)
        print(
            f"{rank:>8}    {' '.join(f'{c[a]:>2}' for a in axes)}  "
            f"{format_bytes(sent.get('pp', 0)):>10} {format_bytes(sent.get('dp', 0)):>10}"
            f"{cp_sent}  "
            f"{format_bytes(mem['params']):>9} {format_bytes(mem['grads']):>9} "
            f"{format_bytes(mem['optimizer']):>9}"
        )
    print(
        f"{'theory':>8}    {'(stages that balance)':<32}  {format_bytes(theory['params']):>9} "
        f"{format_bytes(theory['grads']):>9} {format_bytes(theory['optimizer']):>9}"
    )
