"""3D runs that lesson 09, the CLI and benchmarks/hybrid.py launch: where the
tensor-parallel group sits on a two-level network, measured beside the alpha-beta model.

"TP inside a node, PP across nodes": tensor parallelism's collectives are on the critical
path of every layer, so they belong on the fast links; pipeline stages exchange only
activations, once per microbatch. `placement_step_times` times the same training step
with the TP group inside a node and across nodes (the data-parallel group then takes
the other links), on a `Topology`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from parcourse.comm import Topology
from parcourse.data import progressions
from parcourse.experiments.timing import take_turns
from parcourse.hybrid import Hybrid
from parcourse.launch import RankContext
from parcourse.mesh import Mesh
from parcourse.models import GPTConfig, gpt
from parcourse.theory import CostModel, tp_collectives, tp_link_seconds

# For each axis, the two placements timed: innermost, its groups are consecutive ranks
# (one node); outermost, they span the nodes. The data-parallel group takes the other links.
PLACEMENTS: dict[str, dict[str, tuple[str, ...]]] = {
    "tp": {"tp inside a node": ("dp", "tp"), "tp across nodes": ("tp", "dp")},
    "pp": {"pp inside a node": ("dp", "pp"), "pp across nodes": ("pp", "dp")},
}
PLACEMENT_CONFIG = GPTConfig(vocab=64, block_size=16, n_layers=2, n_heads=4, d_model=64)


def placement_step_times(
    ctx: RankContext,
    topology: Topology,
    steps: int = 3,
    *,
    axis: str = "tp",
    config: GPTConfig | None = None,
    batch: int = 8,
) -> dict[str, Any]:
    """Seconds per step of the GPT on dp x `axis` = 2 x 2 (4 ranks, 2 a node), with the
    `axis` group inside a node and across nodes, taking turns (`timing.take_turns`); one
    microbatch (GPipe), so that the step's messages are the ones
    `placement_predictions` counts. Also this rank's parameter bytes."""
    config = config or PLACEMENT_CONFIG
    if ctx.world_size != 4 or topology.ranks_per_node != 2:
        raise ValueError("placement_step_times runs on 4 ranks, 2 a node")
    if axis not in PLACEMENTS:
        raise ValueError(f"axis must be one of {sorted(PLACEMENTS)}, got {axis!r}")
    x, y = progressions(batch, config.block_size, config.vocab)
    models = {
        name: Hybrid(
            gpt(config),
            Mesh({"dp": 2, axis: 2}, ctx.group, order=order),
            schedule="gpipe",
            microbatches=1,
            link=topology,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        )
        for name, order in PLACEMENTS[axis].items()
    }

    def step(model: Hybrid) -> Callable[[int], Any]:
        return lambda _: model.step(x, y)

    times = take_turns(ctx.group, {name: step(m) for name, m in models.items()}, steps)
    param_bytes = sum(p.numel() * 4 for p in next(iter(models.values())).params)
    return {"times": times, "param_bytes": param_bytes}


# HSDP against ZeRO-3 over every data-parallel rank, on 4 ranks, 2 a node.
HSDP_MESHES: dict[str, dict[str, int]] = {
    "ZeRO-3 over dp 4": {"dp": 4},
    "HSDP: dp 2 x dp_shard 2": {"dp": 2, "dp_shard": 2},
}


def hsdp_against_zero3(
    ctx: RankContext,
    topology: Topology,
    steps: int = 3,
    *,
    config: GPTConfig | None = None,
    batch: int = 8,
) -> dict[str, Any]:
    """Why HSDP exists: ZeRO-3 over all four data-parallel ranks (4 ranks, 2 a node, on a
    two-level `topology`) gathers every stage's weights from ranks on the other node before
    each action; HSDP (ZeRO-3 over dp_shard's ranks, inside a node, each slice summed
    across dp's, between nodes) gathers inside the node and sends across it only the
    slices' all-reduce, once a step. Seconds per step of each, taking turns, and the bytes
    this rank sent in one traced step of each, across nodes and inside its node (the
    course's ring counts them message by message)."""
    from parcourse.trace import Tracer

    config = config or PLACEMENT_CONFIG
    if ctx.world_size != 4 or topology.ranks_per_node != 2:
        raise ValueError("hsdp_against_zero3 runs on 4 ranks, 2 a node")
    x, y = progressions(batch, config.block_size, config.vocab)
    tracers = {name: Tracer(ctx.rank) for name in HSDP_MESHES}

    def build(name: str, tracer: Tracer | None) -> Hybrid:
        mesh = Mesh(HSDP_MESHES[name], ctx.group, ranks_per_node=2)
        return Hybrid(
            gpt(config),
            mesh,
            schedule="gpipe",
            microbatches=1,
            zero=3,
            link=topology,
            tracer=tracer,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        )

    def step(model: Hybrid) -> Callable[[int], Any]:
        return lambda _: model.step(x, y)

    timed = {name: build(name, None) for name in HSDP_MESHES}
    times = take_turns(ctx.group, {name: step(m) for name, m in timed.items()}, steps)
    sent: dict[str, dict[str, float]] = {}
    for name, tracer in tracers.items():
        build(name, tracer).step(x, y)
        where = {"across": 0.0, "inside": 0.0}
        for c in tracer.data().counters:
            if c.name == "bytes_sent" and "to" in c.meta:
                crosses = topology.node(c.meta["to"]) != topology.node(ctx.rank)
                where["across" if crosses else "inside"] += c.value
        sent[name] = where
    return {"times": times, "sent": sent}


def placement_predictions(
    topology: Topology,
    param_bytes: int,
    *,
    axis: str = "tp",
    config: GPTConfig | None = None,
    batch: int = 8,
) -> dict[str, float]:
    """The alpha-beta model's seconds of communication per step for each placement of
    `axis`, on its link, plus data parallelism's ring all-reduce of `param_bytes` (the
    largest rank's) on the other.

    tp: its collectives on the ring (`tp_link_seconds`, each replica's batch). pp (two
    stages, one microbatch): the activation sent forward and its gradient sent back, both
    on the critical path, then the tied embedding's gradient exchanged between the two
    ends: 3 alpha + (2 x activation + embedding bytes) / beta."""
    config = config or PLACEMENT_CONFIG
    inside, between = topology.inside, topology.between
    rows = batch // 2  # each replica's

    def axis_s(link: Any) -> float:
        if axis == "tp":
            collectives = tp_collectives(config, rows, config.block_size, 2)
            return tp_link_seconds(collectives, 2, link.latency_s, link.bandwidth_Bps)
        activation = 4 * rows * config.block_size * config.d_model
        embedding = 4 * config.vocab * config.d_model if config.tie_weights else 0
        return 3 * link.latency_s + (2 * activation + embedding) / link.bandwidth_Bps

    def seconds(axis_link: Any, dp_link: Any) -> float:
        dp_s = CostModel(dp_link.latency_s, dp_link.bandwidth_Bps).all_reduce_s(
            "ring", param_bytes, 2
        )
        return axis_s(axis_link) + dp_s

    inside_name, across_name = PLACEMENTS[axis]
    return {inside_name: seconds(inside, between), across_name: seconds(between, inside)}


# --------------------------------------------------------------------------- lesson 09

LESSON_CONFIG = GPTConfig(vocab=64, block_size=16, n_layers=4, n_heads=4, d_model=32)


def lesson_shape(world_size: int) -> dict[str, int]:
    """A dp x tp x pp shape for any world size: tp 2 and pp 2 where they divide it."""
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if (world_size // tp) % 2 == 0 else 1
    return {"dp": world_size // (tp * pp), "tp": tp, "pp": pp}


def mesh_shapes(world_size: int, config: GPTConfig = LESSON_CONFIG) -> list[dict[str, int]]:
    """Every dp x tp x pp shape of `world_size` ranks the GPT allows (tp divides the
    heads, pp at most its layers: embedding, blocks, head), dp first."""
    shapes = []
    for tp in range(1, world_size + 1):
        for pp in range(1, world_size // tp + 1):
            if (
                world_size % (tp * pp) == 0
                and config.n_heads % tp == 0
                and pp <= config.n_layers + 2
            ):
                shapes.append({"dp": world_size // (tp * pp), "tp": tp, "pp": pp})
    return sorted(shapes, key=lambda s: (-s["dp"], -s["tp"]))


def train_on_mesh(
    ctx: RankContext,
    shape: dict[str, int],
    steps: int = 2,
    *,
    order: str = "megatron",
    schedule: str = "1f1b",
    microbatches: int = 2,
    batch: int = 8,
    sequence_parallel: bool = False,
    zero: Literal[0, 1, 2, 3] = 0,
    link: Topology | None = None,
    traced: bool = False,
) -> dict[str, Any]:
    """`steps` Adam steps of lesson 09's GPT on a mesh of `shape`: the losses (on the last
    stage's ranks), the bytes each axis sent and the count of tp's collectives (torch's,
    whose bytes cannot be counted message by message) when `traced`, what this rank
    holds (`Hybrid.memory`), what each of its groups reduces (`reductions`), and
    the whole trained weights (rank 0 only). `link`: a `Topology` for every message."""
    from parcourse.hybrid import bytes_by_axis

    ctx.tracer.set_status("building the mesh and the model")
    mesh = Mesh(shape, ctx.group, order=order)
    model = Hybrid(
        gpt(LESSON_CONFIG),
        mesh,
        schedule=schedule,
        microbatches=microbatches,
        sequence_parallel=sequence_parallel,
        zero=zero,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
        link=link,
        tracer=ctx.tracer if traced else None,
    )
    x, y = progressions(batch, LESSON_CONFIG.block_size, LESSON_CONFIG.vocab)
    losses = [model.step(x, y) for _ in range(steps)]
    state = model.full_state_dict()
    counters = ctx.tracer.data().counters if traced else []
    return {
        "losses": losses,
        "coords": {a: mesh.coordinate(a) for a in shape},
        "bytes": bytes_by_axis(counters),
        "tp_collectives": sum(1 for c in counters if c.name == "tp_collective"),
        "memory": model.memory(),
        "reductions": reductions(model),
        "state": state if ctx.rank == 0 else None,
    }


def memory_on_mesh(
    ctx: RankContext,
    shape: dict[str, int],
    zero: Literal[0, 1, 2, 3] = 0,
    microbatches: int = 2,
) -> dict[str, int]:
    """What this rank holds after one step of lesson 09's GPT on `shape`."""
    mesh = Mesh(shape, ctx.group)
    model = Hybrid(gpt(LESSON_CONFIG), mesh, microbatches=microbatches, zero=zero)
    batch = shape["dp"] * microbatches
    x, y = progressions(batch, LESSON_CONFIG.block_size, LESSON_CONFIG.vocab)
    model.step(x, y)
    return model.memory()


def one_process(steps: int = 2, batch: int = 8) -> dict[str, Any]:
    """The same training in one process: the losses and the weights."""
    import torch.nn.functional as F

    model = gpt(LESSON_CONFIG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = progressions(batch, LESSON_CONFIG.block_size, LESSON_CONFIG.vocab)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def check_coordinates(fn: Any) -> bool:
    """Lesson 09's exercise: `fn(rank, sizes)` returns {axis: coordinate} of `rank` on a
    mesh whose `sizes` are given outermost first (e.g. {"pp": 2, "dp": 2, "tp": 2}), as
    `Layout` lays ranks out. Prints one line: the first wrong rank, or that all agree."""
    from parcourse.experiments.exercises import ask
    from parcourse.mesh import Layout

    cases = [
        {"pp": 2, "dp": 2, "tp": 2},
        {"dp": 2, "pp": 2, "tp": 2},
        {"dp": 3, "tp": 2},
        {"tp": 4},
        {"pp": 3, "dp": 1, "tp": 2},
    ]
    for sizes in cases:
        layout = Layout(tuple(sizes), tuple(sizes.values()))
        for rank in range(layout.world_size):
            expected = layout.coordinates(rank)
            answered, got = ask(fn, rank, dict(sizes), where=f"with rank {rank} of {sizes}, ")
            if not answered:
                return False
            if not isinstance(got, dict):
                same = isinstance(got, (list, tuple)) and list(got) == list(expected.values())
                print(
                    f"Not quite: rank {rank} of {sizes}: your function returned "
                    f"{type(got).__name__} {got!r}"
                    f"{', the right numbers' if same else ''}; return a dict "
                    f"{{axis: coordinate}}, here {expected}."
                )
                return False
            if got != expected:
                print(
                    f"Not quite: on a mesh {sizes} (outermost first), rank {rank} sits at "
                    f"{expected}, your function says {got}. Hint: the last axis changes "
                    "fastest: rank = ((c0 x s1) + c1) x s2 + c2, so peel the axes off from "
                    "the last with divmod."
                )
                return False
    print(f"Correct: every rank of {len(cases)} meshes, both orders among them.")
    return True


# A row of `reductions`: (when, what, axis, op, ranks), kept where the group has more than one rank.
Row = Callable[[str, str, str, str, list[int]], None]


def reductions(model: Hybrid) -> list[dict[str, Any]]:
    """What each group of this rank of a `Hybrid` does to the numbers in one step, in the order it
    happens, as this model is built (sequence parallel or not, ZeRO-1 or not,
    clipping or not, the tied weights cut apart or not): rows of {"when", "what",
    "axis", "op", "ranks"} (`ranks`: this rank's group). Lesson 09's table."""
    rows = []

    def row(when: str, what: str, axis: str, op: str, ranks: list[int]) -> None:
        if len(ranks) > 1:
            rows.append({"when": when, "what": what, "axis": axis, "op": op, "ranks": ranks})

    ep = model.mesh.ranks("ep") if model.cut_over else []
    _forward_rows(model, ep, row)
    _backward_rows(model, ep, row)
    _finalize_rows(model, ep, row)
    return rows


def _forward_rows(model: Hybrid, ep: list[int], row: Row) -> None:
    """The forward's rows, then the loss's: tp, cp, ep and pp, in the order a microbatch
    meets them."""
    sp = model.sequence_parallel
    tp, pp, cp = (model.mesh.ranks(a) for a in ("tp", "pp", "cp"))
    row(
        "forward",
        "the token embedding's vocabulary shards",
        "tp",
        "all-reduce (sum)" if not sp else "reduce-scatter (sum) along the sequence",
        tp,
    )
    row(
        "forward",
        "the row-parallel layers' partial outputs (attention out, MLP down)",
        "tp",
        "reduce-scatter (sum) along the sequence" if sp else "all-reduce (sum)",
        tp,
    )
    if sp:
        row(
            "forward",
            "the sequence chunks entering attention and the MLP",
            "tp",
            "all-gather",
            tp,
        )
    if model.shard is not None:
        attention = {
            "ring": "send / recv round the ring (no sum)",
            "all-gather": "all-gather",
            "ulysses": "all-to-all, to a head cut and back",
        }[model.shard.method]
        row(
            "forward",
            "attention's keys and values, every block of the sequence",
            "cp",
            attention,
            cp,
        )
    row(
        "forward",
        "each MoE layer's tokens to their experts' ranks (after the counts), and the outputs back",
        "ep",
        "all-to-all, there and back (no sum)",
        ep,
    )
    row("forward", "activations, stage to stage", "pp", "send / recv (no sum)", pp)
    row(
        "loss",
        "the logits' max, sum of exps and target logit (vocabulary-parallel cross entropy)",
        "tp",
        "all-reduce (max, sum)",
        tp,
    )


def _backward_rows(model: Hybrid, ep: list[int], row: Row) -> None:
    """The backward's rows (the forward's groups the other way), then ZeRO-3's gathers
    and ZeRO-2's reduce-scatters, which run inside the schedule."""
    sp = model.sequence_parallel
    tp, pp, cp = (model.mesh.ranks(a) for a in ("tp", "pp", "cp"))
    # the replicas: dp's ranks, and cp's with them when the sequence is cut
    replicas, dp = model.roles.label("dense"), model.mesh.ranks(*model.roles.dense)
    row(
        "backward",
        "the column-parallel layers' input gradients (qkv, MLP up)",
        "tp",
        "reduce-scatter (sum) along the sequence" if sp else "all-reduce (sum)",
        tp,
    )
    if sp:
        row(
            "backward",
            "the LayerNorm weights' gradients (each rank saw its chunk)",
            "tp",
            "all-reduce (sum)",
            tp,
        )
    if model.shard is not None:
        back = {
            "ring": "K and V round the ring again, their gradients with them, home "
            "(send / recv, summed on the way)",
            "all-gather": "reduce-scatter (sum) to each block's owner",
            "ulysses": "all-to-all, to a head cut and back",
        }[model.shard.method]
        row("backward", "attention's keys' and values' gradients", "cp", back, cp)
    row(
        "backward",
        "the combine's and the dispatch's gradients, the other way",
        "ep",
        "all-to-all, there and back (no sum)",
        ep,
    )
    row("backward", "activations' gradients, stage to stage", "pp", "send / recv (no sum)", pp)
    if model.zero == 3:
        row(
            "forward and backward",
            "a stage's weights, before each of its actions (freed after it)",
            replicas,
            "all-gather",
            dp,
        )
    if model.zero >= 2:
        row(
            "backward",
            "a stage's gradients, after each microbatch's backward of it",
            replicas,
            "reduce-scatter (mean) into a slice each, while the schedule goes on",
            dp,
        )


def _finalize_rows(model: Hybrid, ep: list[int], row: Row) -> None:
    """After the schedule: the tied weights' sum, the gradients' mean over the replicas
    (and each expert's over its copies), the norm, the updated slices and the loss."""
    zero, roles = model.sharded is not None, model.roles
    replicas, dp = roles.label("dense"), model.mesh.ranks(*roles.dense)
    if model.runtime.tied:
        embedding = next(
            (g for g in model.mesh.layout.embedding_groups() if model.mesh.local_rank in g), []
        )
        row(
            "end of schedule",
            "the tied embedding's and head's gradients",
            "embedding",
            "sum over the first and last stage",
            embedding,
        )
    if model.zero >= 2:
        row(
            "finalize 1",
            "the tied weights' gradients (the rest went in backward)",
            replicas,
            "reduce-scatter (mean): a slice each",
            dp,
        )
    elif zero:
        row("finalize 1", "every gradient", replicas, "reduce-scatter (mean): a slice each", dp)
    else:
        row(
            "finalize 1",
            "every gradient, in buckets: the tied weights' start here, each "
            "stage's started after its last backward" + (", the experts' apart" if ep else ""),
            replicas,
            "all-reduce (mean)",
            dp,
        )
    if ep:
        copies = roles.experts
        row(
            "finalize 1",
            "each expert's gradient, over the ranks holding the same experts",
            "-".join(copies),
            "reduce-scatter (mean over every replica)"
            if zero
            else "all-reduce (mean over every replica)",
            model.mesh.ranks(*copies),
        )
    if model.max_norm is not None:
        axes = roles.norm
        row(
            "finalize 2",
            "the squared gradient norm (each element once)",
            "-".join(axes),
            "all-reduce (sum)",
            model.mesh.ranks(*axes),
        )
    if zero and model.zero < 3:
        row("after the step", "the updated slices of the parameters", replicas, "all-gather", dp)
    row("report", "the replicas' losses", replicas, "all-reduce (mean)", dp)


def reductions_table(rows: list[dict[str, Any]]) -> str:
    """`reductions()` as a text table, one row per communication, in step order
    (a line saying so where there is none: one rank)."""
    if not rows:
        return "no group of more than one rank: nothing is reduced or sent"
    widths = {"when": 16, "axis": 9, "op": 40}
    lines = [f"{'when':<16} {'axis':<9} {'op':<40} {'ranks':<12} what"]
    for r in rows:
        ranks = ",".join(str(x) for x in r["ranks"])
        lines.append(
            " ".join(f"{r[k]:<{w}}" for k, w in widths.items()) + f" {ranks:<12} {r['what']}"
        )
    return "\n".join(lines)


def check_mesh_choice(
    world_size: int,
    shape: dict[str, int],
    schedule: str,
    microbatches: int,
    ranks_per_node: int,
    sequence_parallel: bool = False,
    batch: int | None = None,
) -> None:
    """Lesson 09's panel: a choice the model or the schedule cannot take, as a ValueError
    naming the numbers, before any rank starts (the plan's own rules,
    `ParallelPlan.problems`: what `Hybrid`, the CLI and the planner say too)."""
    from parcourse.plan import ParallelPlan

    ParallelPlan(
        dp=shape.get("dp", 1),
        tp=shape.get("tp", 1),
        pp=shape.get("pp", 1),
        schedule=schedule,
        microbatches=microbatches,
        sequence_parallel=sequence_parallel,
        ranks_per_node=ranks_per_node,
    ).check(LESSON_CONFIG, batch, world=world_size)


def mesh_step_figure(run: Any, title: str) -> Any:
    """A traced 3D run (`train_on_mesh`, traced): the timeline with communication coloured
    by axis, beside the bytes each rank sent per axis and what each rank holds."""
    import matplotlib.pyplot as plt

    from parcourse import plots

    results = run.results
    n = len(results)
    fig = plt.figure(figsize=(11, 2.2 + 0.45 * n), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[2.2, 1], hspace=0.15)
    plots.timeline(run.trace, ax=fig.add_subplot(grid[:, 0]), color_by="axis", title=title)
    sent_ax, mem_ax = fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, 1])
    left = [0.0] * n
    counted = {axis for r in results for axis in r["bytes"]}
    for axis, color in plots.AXIS_COLORS.items():  # the timeline's colours
        if axis in counted:
            kib = [r["bytes"].get(axis, 0.0) / 1024 for r in results]
            sent_ax.barh(range(n), kib, left=left, color=color, label=axis)
            left = [a + b for a, b in zip(left, kib)]
    uncounted = "" if "tp" in counted else " (tp: torch's, uncounted)"
    sent_ax.set_title(f"KiB sent, by axis{uncounted}", loc="left", fontsize=9)
    left = [0.0] * n
    for k, c in enumerate(("params", "grads", "optimizer")):
        kib = [r["memory"][c] / 1024 for r in results]
        mem_ax.barh(
            range(n), kib, left=left, color=f"C{k}", label={"optimizer": "Adam state"}.get(c, c)
        )
        left = [a + b for a, b in zip(left, kib)]
    mem_ax.set_title("KiB held", loc="left", fontsize=9)
    for ax in (sent_ax, mem_ax):
        if ax.get_legend_handles_labels()[0]:  # one rank sends nothing: no legend
            ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
        ax.invert_yaxis()
    return fig
