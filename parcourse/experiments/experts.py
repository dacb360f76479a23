"""What lesson 11's second part (experts) runs: a router's choices token by token, the
dispatch exercise, the expert-parallel layer measured beside one process and the theory's
bytes, the tokens each expert receives over training under each balancing method, and the
GPT trained with its experts cut over ep."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Comm, Turns, all_to_all
from parcourse.experiments.context_parallel import DTYPES
from parcourse.experiments.exercises import ask, whole_numbers
from parcourse.experiments.timing import one_thread
from parcourse.experts import (
    MoE,
    expert_parallel,
    expert_parameters,
    moe_layers,
    permute,
    update_bias,
)
from parcourse.experts.routing import Routing, Score, capacity
from parcourse.launch import RankContext
from parcourse.mesh import Mesh
from parcourse.models import GPTConfig, gpt
from parcourse.pipeline.actions import Action, Schedule
from parcourse.roles import Roles

if TYPE_CHECKING:
    from parcourse.data_parallel.stages import BucketedStages, StageWeights
    from parcourse.pipeline.runtime import PipelineRuntime

DispatchFn = Callable[[list[list[int]], int, int], Any]


def routing_example(
    tokens: int = 12,
    experts: int = 8,
    top_k: int = 2,
    score: Score = "softmax",
    capacity_factor: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One MoE layer's routing of `tokens` random tokens: each token's experts, weights
    and which were kept (a capacity drops the rest), the assignments each expert was
    chosen for (`counts`, before the drops) and kept (`kept_counts`), and the capacity
    (the most an expert keeps; None: dropless)."""
    torch.manual_seed(seed)
    layer = MoE(
        16,
        experts,
        top_k,
        score=score,
        capacity_factor=capacity_factor,
    )
    with torch.no_grad():
        layer(torch.randn(tokens, 16))
    r = layer.last
    assert r is not None
    return {
        "experts": r.experts.tolist(),
        "weights": r.weights.tolist(),
        "kept": r.kept.tolist(),
        "counts": r.counts.tolist(),
        "kept_counts": torch.bincount(r.experts[r.kept], minlength=experts).tolist(),
        "capacity": capacity(tokens, experts, top_k, capacity_factor),
        "dropped": r.dropped,
    }


def dispatch_plan(chosen: list[list[int]], experts: int, ranks: int) -> tuple[list[int], list[int]]:
    """The solution of the exercise: for tokens' chosen experts (`chosen[t]`: token t's k
    experts), the rows sent to each rank (rank r holds experts r E/P to (r + 1) E/P - 1)
    and the order of the assignments (t k + slot) sorted by expert, token order within one
    expert: what `permute` computes."""
    k = len(chosen[0]) if chosen else 0
    flat = [(e, t * k + s) for t, row in enumerate(chosen) for s, e in enumerate(row)]
    order = [i for _, i in sorted(flat, key=lambda pair: pair[0])]  # stable: token order
    held = experts // ranks
    counts = [sum(1 for e, _ in flat if e // held == r) for r in range(ranks)]
    return counts, order


def check_dispatch(fn: DispatchFn) -> bool:
    """Lesson 11's second exercise: `fn(chosen, experts, ranks)` returns (the rows each
    rank receives, the assignments in dispatch order) for a routing. Checked on a small
    routing the lesson prints and on a larger random one; prints one short verdict, naming
    the mistake when it is a common one."""
    g = torch.Generator().manual_seed(3)
    cases = [
        ([[2, 0], [1, 2], [3, 0], [0, 3], [2, 1]], 4, 2),
        (torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)]).tolist(), 8, 4),
    ]
    for chosen, experts, ranks in cases:
        ok, got = ask(fn, [list(row) for row in chosen], experts, ranks)
        if not ok:
            return False
        want_counts, want_order = dispatch_plan(chosen, experts, ranks)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            print(
                f"Not yet: return two lists, (rows per rank, order); got "
                f"{type(got).__name__}." + (" Hint: a missing `return`?" if got is None else "")
            )
            return False
        if any(isinstance(x, dict) for x in got):
            print(
                "Not yet: give each part as a list in order (rows for rank 0, rank 1, ...; "
                "the assignments' numbers in dispatch order), not a dict."
            )
            return False
        counts, order = (whole_numbers(x) for x in got)
        if counts is None or order is None:
            print(
                "Not yet: both parts should be lists of whole numbers (rows per rank, and "
                "the assignments' numbers t x k + slot)."
            )
            return False
        per_expert = [sum(row.count(e) for row in chosen) for e in range(experts)]
        if counts != want_counts:
            if counts == per_expert:
                hint = (
                    f"those are rows per expert; a rank holds {experts // ranks} experts: "
                    "add up the counts of the experts each rank holds"
                )
            elif sum(counts) != sum(want_counts):
                hint = (
                    f"every token sends one row per chosen expert: {sum(want_counts)} "
                    f"rows in all, your counts add up to {sum(counts)}"
                )
            elif counts == want_counts[::-1]:
                hint = "the ranks are reversed: rank 0 holds the first experts"
            else:
                hint = (
                    f"rank r holds experts r x {experts // ranks} to (r + 1) x "
                    f"{experts // ranks} - 1"
                )
            print(f"Not yet (rows per rank): {hint}. Expected {want_counts}, got {counts}.")
            return False
        if order != want_order:
            flat = [e for row in chosen for e in row]
            if order == list(range(len(flat))):
                hint = "that is the routing's own order: sort the assignments by expert"
            elif sorted(order) != list(range(len(flat))):
                hint = (
                    f"the order should name each assignment (t x k + slot, 0 to "
                    f"{len(flat) - 1}) once"
                )
            elif [flat[i] for i in order] == sorted(flat):
                hint = (
                    "sorted by expert, but within one expert keep the token order (a "
                    "stable sort): the receiver's rows must match the combine's"
                )
            else:
                hint = "sort the assignment numbers by their expert, ties by token"
            print(f"Not yet (order): {hint}.")
            return False
    print(
        "Correct: the rows each rank receives, and the order they leave in, grouped by "
        "expert (so by rank) with the tokens in order within each."
    )
    return True


def ep_layer(
    ctx: RankContext,
    tokens: int = 64,
    experts: int = 8,
    top_k: int = 2,
    capacity_factor: float | None = None,
    score: Score = "softmax",
    width: int = 32,
) -> dict[str, Any]:
    """One forward and backward of an MoE layer with its experts cut over these ranks,
    every message through a traced `Comm` (dispatch, experts, combine on the timeline),
    beside the whole layer in this process on this rank's tokens: the largest difference
    (output, input gradient), the bytes sent forward and backward, the assignments this
    rank's tokens made to each expert (`chosen`) and those kept and sent (`counts`), the
    assignments dropped, and the rows the dispatch sent to other ranks (`rows_out`) and
    the combine sent back to them (`rows_back`)."""
    if experts % ctx.world_size:
        raise ValueError(f"{experts} experts do not divide by {ctx.world_size} ranks")

    def layer() -> MoE:
        torch.manual_seed(0)
        return MoE(
            width,
            experts,
            top_k,
            score=score,
            capacity_factor=capacity_factor,
        )

    g = torch.Generator().manual_seed(ctx.rank)
    x, up = torch.randn(tokens, width, generator=g), torch.randn(tokens, width, generator=g)
    whole = layer()
    ref_x = x.clone().requires_grad_()
    ref = whole(ref_x)
    ref.backward(up)
    comm = Comm(ctx.group, tracer=ctx.tracer, algorithm="auto")
    mine = layer()
    expert_parallel(mine, comm)  # cuts its experts in place
    # the first messages between two ranks set their connection up (tens of ms on gloo):
    # here, untraced, not on the timeline as the counts' exchange
    size = ctx.world_size
    warm = Comm(ctx.group, algorithm=comm.algorithm)
    all_to_all(warm, torch.zeros(size, dtype=torch.int64), [1] * size, [1] * size)
    counted = len(ctx.tracer.data().counters)
    ctx.tracer.set_status(f"{tokens} tokens to {experts} experts")
    dist.barrier(group=ctx.group)
    here = x.clone().requires_grad_()
    out = mine(here)
    sent = sum(c.value for c in ctx.tracer.data().counters[counted:] if c.name == "bytes_sent")
    out.backward(up)
    every = sum(c.value for c in ctx.tracer.data().counters[counted:] if c.name == "bytes_sent")
    routing = mine.last
    assert routing is not None and here.grad is not None and ref_x.grad is not None
    sort = permute(routing, experts)
    everyone: list[Any] = [None] * ctx.world_size  # each rank's kept rows per expert
    dist.all_gather_object(everyone, sort.counts, group=ctx.group)
    held = range(mine.first, mine.first + mine.local_experts)
    return {
        "error": float(max((out - ref).detach().abs().max(), (here.grad - ref_x.grad).abs().max())),
        "forward": sent,
        "backward": every - sent,
        "counts": sort.counts,  # kept, after a capacity's drops
        "chosen": routing.counts.tolist(),  # before them
        "dropped": routing.dropped,
        "held": list(held),
        # rows the dispatch sends to the other ranks' experts, and rows the combine sends
        # back from this rank's experts to the other ranks' tokens
        "rows_out": sum(c for e, c in enumerate(sort.counts) if e not in held),
        "rows_back": sum(
            theirs[e] for r, theirs in enumerate(everyone) if r != ctx.rank for e in held
        ),
    }


def imbalance(
    method: str = "none", steps: int = 60, experts: int = 8, seed: int = 0
) -> list[list[int]]:
    """A small GPT with `experts` experts (top 2) trained `steps` steps in one process on
    the course's counting sequences, balanced by `method` ("none", "aux loss" or "bias"):
    the tokens each expert received at each step (every block's router, summed)."""
    settings = {  # (aux_loss, bias_rate)
        "none": (0.0, 0.0),
        "aux loss": (0.05, 0.0),
        "bias": (0.0, 0.01),
    }
    if method not in settings:
        raise ValueError(f"unknown balancing {method!r}; choose one of {', '.join(settings)}")
    from parcourse.data import progressions

    aux_loss, bias_rate = settings[method]
    config = GPTConfig(
        vocab=64,
        block_size=16,
        n_layers=2,
        n_heads=4,
        d_model=32,
        experts=experts,
        top_k=2,
        aux_loss=aux_loss,
        bias_rate=bias_rate,
    )
    model = gpt(config, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = progressions(32, config.block_size, config.vocab)
    per_step = []
    with one_thread():  # a small model: torch's threads cost more than they give, the more so
        for _ in range(steps):  # on cores busy with other work
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            update_bias(model)
            opt.step()
            opt.zero_grad()
            routings: list[Routing] = []
            for m in moe_layers(model):
                assert m.last is not None  # set by the forward above
                routings.append(m.last)
            per_step.append([sum(int(r.counts[e]) for r in routings) for e in range(experts)])
    return per_step


def ep_training(
    ctx: RankContext, experts: int = 4, steps: int = 3, dtype: str = "float64"
) -> dict[str, Any]:
    """The course's GPT in `dtype` with `experts` experts in every block trained `steps`
    Adam steps on a mesh of ep = world size (`Hybrid`: each rank its rows and 1/ep of the
    experts), and the same microbatches in one process: both runs' losses and the largest
    difference of their weights (fp64 by default, for the reason `cp_training` gives; the
    bar is `WEIGHTS_TOLERANCE`)."""
    from parcourse.data import progressions
    from parcourse.experts import set_aux_scale
    from parcourse.hybrid import Hybrid

    config = GPTConfig(
        vocab=64, block_size=16, n_layers=2, n_heads=4, d_model=32, experts=experts, top_k=2
    )
    model = Hybrid(
        gpt(config).to(DTYPES[dtype]),
        Mesh({"ep": ctx.world_size}, ctx.group),
        microbatches=1,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
    )
    one = gpt(config).to(DTYPES[dtype])
    set_aux_scale(one, 1 / ctx.world_size)
    opt = torch.optim.Adam(one.parameters(), lr=1e-2)
    x, y = progressions(4 * ctx.world_size, config.block_size, config.vocab)  # 4 rows a rank
    ours, theirs = [], []
    for step in range(steps):
        ctx.tracer.set_status(f"step {step + 1} of {steps}")
        ours.append(model.step(x, y))
        loss = sum(
            F.cross_entropy(one(a).flatten(0, 1), b.flatten()) / ctx.world_size
            for a, b in zip(x.chunk(ctx.world_size), y.chunk(ctx.world_size))
        )
        assert isinstance(loss, torch.Tensor)  # a sum of world_size >= 1 losses, never the 0
        loss.backward()
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())
    whole = model.full_state_dict()
    diff = max(float((whole[k] - v).abs().max()) for k, v in one.state_dict().items())
    return {"losses": ours, "one_process": theirs, "weights_diff": diff, "memory": model.memory()}


def hidden_traffic(
    ctx: RankContext,
    schedule: Schedule,
    overlap: bool = True,
    *,
    steps: int = 3,
    layers: int = 4,
    width: int = 64,
    experts: int = 8,
    rows: int = 4,
    forward_ms: float = 0.0,
    backward_ms: float = 0.0,
    latency_us: float = 1000.0,
    bandwidth_gbps: float = 0.05,
    lr: float = 0.05,
) -> dict[str, Any]:
    """Experts' all-to-all under a pipeline schedule: two pipelines of `schedule.ranks`
    ranks each (world = 2 x schedule.ranks), the course's GPT with `experts` experts in
    each of its `layers` blocks cut into the schedule's stages, every MoE layer's experts
    cut over the two ranks that hold the same stages (ep 2, across the pipelines: each
    pipeline its own batch, the two exchanging tokens), the all-to-all over a simulated
    link (`latency_us`, `bandwidth_gbps`), the stages' messages free. `overlap`: the
    schedule's overlapped pairs (DualPipe's) run at once, taking turns on the rank
    (`PipelineRuntime(turns=)`); without it one after the other. `steps` SGD steps of
    `schedule.microbatches` microbatches of `rows` sequences a pipeline, the gradients
    averaged over the two pipelines. The stages run on CPU, over gloo, on any machine (the
    turns take CPU threads in turns). `forward_ms`, `backward_ms`: simulated compute, each
    stage's forward and backward of a microbatch padded to those seconds, piece by piece
    between its all-to-alls (`Turns.paced`), so that four ranks on two cores behave as
    four devices would (0: the real math alone).

    Returns, per step, this rank's seconds: the step, the all-to-all waited for, the part
    of it exposed (the rank computing nothing), the compute; the last step's actions as
    `taking_turns`' segments (compute, all-to-all wait, compute, ...: what the simulator
    replays); when the last step started, the intervals in which the turn was held (by an
    action of kind F, B, I or W) and those spent waiting for an all-to-all
    (`time.perf_counter()` seconds, one clock for the machine's processes); the weights
    (named as in the whole model, this rank's experts' slice)."""
    pp = schedule.ranks
    if ctx.world_size != 2 * pp:
        raise ValueError(
            f"two pipelines of {pp} ranks: run on {2 * pp} ranks, not {ctx.world_size}"
        )
    rank = _traffic_rank(
        ctx,
        schedule,
        overlap,
        config=traffic_config(layers, width, experts),
        rows=rows,
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        latency_us=latency_us,
        bandwidth_gbps=bandwidth_gbps,
        lr=lr,
    )
    per_step, start = _timed_steps(ctx, schedule, rank, steps)
    turns = rank.turns
    return {
        "steps": per_step,
        "segments": segments_of(turns),
        "start": start,
        "held": [(cast(Action, h.label).kind, h.start, h.end) for h in turns.held_intervals],
        "waits": [(w.start, w.end) for w in turns.waits if w.reason == "all-to-all"],
        "weights": {rank.names[id(p)]: p.detach().clone() for p in rank.params},
    }


@dataclasses.dataclass
class _TrafficRank:
    """One rank of `hidden_traffic`, ready to step: its stages' runtime and the turns its
    actions take, its parameters (each once), their gradient synchronisation (lesson 02's
    buckets over the dense replicas, the experts' over theirs, with the optimizer), the
    whole world's group (for the barrier), each parameter's name in the whole model, and
    its batch's inputs and targets (None where its stages neither take nor end the
    batch)."""

    runtime: PipelineRuntime
    turns: Turns
    params: list[nn.Parameter]
    sync: BucketedStages
    everyone: dist.ProcessGroup
    names: dict[int, str]
    inputs: torch.Tensor | None
    targets: torch.Tensor | None


def _traffic_rank(
    ctx: RankContext,
    schedule: Schedule,
    overlap: bool,
    *,
    config: GPTConfig,
    rows: int,
    forward_ms: float,
    backward_ms: float,
    latency_us: float,
    bandwidth_gbps: float,
    lr: float,
) -> _TrafficRank:
    """`hidden_traffic`'s groups, this rank's stages of the GPT with their experts cut
    over ep, the runtime that runs them and the optimizer, the runtime prepared."""
    from parcourse.comm import SimulatedLink
    from parcourse.data_parallel.stages import StageWeights
    from parcourse.models import gpt_layers
    from parcourse.pipeline.partition import partition, tied_weights
    from parcourse.pipeline.runtime import PipelineRuntime
    from parcourse.pipeline.simulate import SimulatedCompute

    pp = schedule.ranks
    # The mesh ep 2 x pp (pp innermost: ranks 0..pp-1 are the first pipeline), its groups
    # by role: ep's ranks take their own rows and hold the same dense weights.
    mesh = Mesh({"ep": 2, "pp": pp}, ctx.group, order=("ep", "pp"))
    roles = Roles.from_sizes({"ep": 2, "pp": pp})
    here, place = roles.index(mesh.layout.coordinates(mesh.local_rank)), mesh.coordinate("pp")
    turns = Turns()
    ep = Comm(
        mesh.group("ep"),
        tracer=ctx.tracer,
        link=SimulatedLink.of(latency_us, bandwidth_gbps),
        algorithm="ring",
    )
    ep.turns = turns  # the all-to-all hands on the turns the runtime takes
    ctx.tracer.set_status(f"{schedule.name}: building the model")
    whole = gpt(config)
    cut = partition(gpt_layers(whole), schedule.model_stages)
    mine: dict[int, nn.Module] = {
        s: cut[schedule.model_stage(s)] for s, r in enumerate(schedule.stage_rank) if r == place
    }
    for module in mine.values():
        expert_parallel(module, ep)
    names = {id(p): n for n, p in whole.named_parameters()}
    tied = tied_weights(cut)

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    plan = schedule if overlap else dataclasses.replace(schedule, together=())
    runtime = PipelineRuntime(
        plan,
        mine,
        mesh.group("pp"),
        lm_loss,
        tracer=ctx.tracer,
        tied=tied,
        turns=turns,
        compute=SimulatedCompute(forward_ms / 1e3, backward_ms / 1e3)
        if forward_ms or backward_ms
        else None,
    )
    held = nn.ModuleList(mine.values())  # the rank's stages, each parameter once (tied ones)
    params = list(held.parameters())
    shared = {id(cut[s].get_parameter(name)) for g in tied for s, name in g.items()}
    experts = {id(p) for p in expert_parameters(held)}
    sync = _traffic_sync(mesh, roles, StageWeights.of(mine, shared, experts), params, lr)
    x, y = traffic_batch(config, rows * schedule.microbatches, here)
    inputs = x if place in schedule.entry_ranks else None
    targets = y if place in schedule.exit_ranks else None
    runtime.prepare(inputs)
    return _TrafficRank(runtime, turns, params, sync, ctx.group, names, inputs, targets)


def _traffic_sync(
    mesh: Mesh, roles: Roles, weights: StageWeights, params: list[nn.Parameter], lr: float
) -> BucketedStages:
    """The 3D step's gradient sync for `hidden_traffic`'s rank (lesson 02's buckets):
    the dense weights averaged over the dense replicas (`roles.dense`), each expert over
    the ranks holding the same experts (`roles.experts`), both divided by the dense
    replicas. Every bucket is launched by `finalize`, after the timed schedule (no stage's
    last backward starts one), so that a step's seconds are its pipeline's and
    all-to-alls' alone."""
    from parcourse.data_parallel.stages import BucketedStages, SyncGroups

    groups = SyncGroups(
        Comm(mesh.group(*roles.dense)), Comm(mesh.group(*roles.experts)), roles.size("dense")
    )
    return BucketedStages(weights, params, groups, lambda ps: torch.optim.SGD(ps, lr=lr), {})


def _timed_steps(
    ctx: RankContext, schedule: Schedule, rank: _TrafficRank, steps: int
) -> tuple[list[dict[str, float]], float]:
    """`steps` SGD steps, each timed from a barrier of the whole world: per step the
    seconds of the step, of the all-to-all waited for and exposed, and of the compute;
    and when the last step started."""
    per_step, start, turns = [], 0.0, rank.turns
    for step in range(steps):
        ctx.tracer.set_status(f"{schedule.name}: step {step + 1} of {steps}")
        dist.barrier(group=rank.everyone)
        start = time.perf_counter()
        rank.runtime.step(rank.inputs, rank.targets)
        seconds = time.perf_counter() - start
        per_step.append(
            {
                "step": seconds,
                "waited": turns.waited("all-to-all"),
                "exposed": turns.exposed("all-to-all"),
                "compute": turns.busy(),
            }
        )
        rank.sync.finalize()
        rank.sync.step()
        rank.sync.optimizer.zero_grad()
    return per_step, start


def traffic_config(layers: int = 4, width: int = 64, experts: int = 8) -> GPTConfig:
    """`hidden_traffic`'s GPT: every block's MLP `experts` experts, top 2, dropless, no
    balancing loss (a loss per microbatch is not one batch's: the runs compare weights)."""
    return GPTConfig(
        vocab=64,
        block_size=32,
        n_layers=layers,
        n_heads=4,
        d_model=width,
        experts=experts,
        top_k=2,
        aux_loss=0.0,
    )


def traffic_batch(config: GPTConfig, rows: int, pipeline: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pipeline `pipeline`'s batch in `hidden_traffic`: `rows` random sequences, inputs
    and next-token targets."""
    g = torch.Generator().manual_seed(pipeline)
    tokens = torch.randint(0, config.vocab, (rows, config.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def traffic_summary(
    results: list[dict[str, Any]],
    schedule: Schedule,
    measured: list[dict[Action, list[float]]],
    overlap: bool,
) -> dict[str, float]:
    """Every rank's `hidden_traffic` results in a few seconds: the step, the all-to-all
    waited for and exposed (each the median over the steps after the first, then the
    mean over the ranks), and the exposure the simulator predicts from `measured`
    (`predicted_exposure`, the mean over the pipeline's ranks)."""
    out = {
        k: statistics.mean(statistics.median(s[k] for s in r["steps"][1:]) for r in results)
        for k in ("step", "waited", "exposed")
    }
    out["simulated"] = statistics.mean(predicted_exposure(schedule, measured, overlap)[0])
    return out


def segments_of(turns: Turns) -> dict[Action, list[float]]:
    """Each action's seconds from a `Turns` record, in `taking_turns`' form: compute (the
    turn held, receives from other stages left out), all-to-all wait, compute, ..."""
    events: dict[Action, list[tuple[float, float, bool]]] = {}
    for h in turns.held_intervals:  # the runtime holds the turn with an Action as its label
        events.setdefault(cast(Action, h.label), []).append((h.start, h.end - h.start, True))
    for w in turns.waits:
        if w.reason == "all-to-all":
            events.setdefault(cast(Action, w.label), []).append((w.start, w.end - w.start, False))
    out = {}
    for label, seen in events.items():
        parts = [0.0]
        for _, seconds, computing in sorted(seen):
            if computing:
                parts[-1] += seconds
            else:
                parts += [seconds, 0.0]
        out[label] = parts
    return out


def predicted_exposure(
    schedule: Schedule,
    measured: list[dict[Action, list[float]]],
    overlap: bool = True,
    weight_share: float = 0.5,
) -> tuple[list[float], float]:
    """What the simulator predicts for `schedule` from another schedule's measured actions
    (`measured`: every rank's `segments_of`, 1F1B's): each stage's forward and backward
    as the median of those measured (compute, all-to-all wait, compute, ...), the pairs
    taking turns if `overlap`. A split backward (I, then W), as simulated compute pads
    it (W `weight_share` of B's compute, I the rest): on a stage where microbatches enter
    (no input gradient), I is compute alone and W has the backward's waits, its pieces
    scaled to W's share; elsewhere I has them, scaled to I's, and W is compute alone.
    With the math alone (no simulated compute) an entry stage's I takes next to nothing
    and its W the whole backward: the prediction's step is then off by that much.
    Returns each rank's exposed all-to-all seconds and the step's seconds
    (`simulate.exposed_waits`)."""
    from parcourse.pipeline.simulate import exposed_waits

    alike: dict[tuple[int, str], list[list[float]]] = {}
    for rank in measured:
        for a, parts in rank.items():
            alike.setdefault((a.stage, a.kind), []).append(parts)
    typical = {}
    for key, runs in alike.items():
        longest = max(len(r) for r in runs)  # the first step of a key may miss its waits
        runs = [r for r in runs if len(r) == longest]
        typical[key] = [statistics.median(r[i] for r in runs) for i in range(longest)]

    def scaled(parts: list[float], by: float) -> list[float]:
        return [p * by if i % 2 == 0 else p for i, p in enumerate(parts)]

    def segments(a: Action) -> list[float]:
        stage = schedule.model_stage(a.stage)
        if a.kind in ("F", "B"):
            return typical[(stage, a.kind)]
        whole = typical[(stage, "B")]
        alone = [sum(whole[::2]) * (weight_share if a.kind == "W" else 1 - weight_share)]
        entry = a.stage in schedule.entry_stages
        if (a.kind == "W") == entry:  # the piece that runs the backward's all-to-alls
            return scaled(whole, weight_share if a.kind == "W" else 1 - weight_share)
        return alone

    return exposed_waits(schedule, segments, overlap)
