"""Pipeline runs that lessons 06-07, the CLI and benchmarks/pipeline.py launch: a deep MLP
cut into stages, trained under a schedule, with its measured bubble and in-flight memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from parcourse.comm import simulated_link
from parcourse.experiments.exercises import ask
from parcourse.experiments.timing import take_turns
from parcourse.launch import RankContext
from parcourse.models import GPTConfig, gpt, gpt_layers
from parcourse.pipeline.actions import Action
from parcourse.pipeline.partition import By, partition, tied_weights
from parcourse.pipeline.runtime import PipelineRuntime
from parcourse.pipeline.schedule import SCHEDULES, Schedule, gpipe, schedule_by_name
from parcourse.pipeline.simulate import (
    Costs,
    SimulatedCompute,
    Timeline,
    in_flight,
    measured_bubble,
    simulate,
)
from parcourse.trace import Span, Trace, TraceData

make_schedule = schedule_by_name  # the one registry of names is parcourse.pipeline.schedule's


def deep_mlp(depth: int, width: int, seed: int = 0) -> list[nn.Module]:
    """`depth` layers Linear + Tanh of equal width: equal stages for any cut."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]


def regression_batch(batch: int, width: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


Model = Literal["mlp", "gpt"]
SEQ = 16  # tokens per sequence for the GPT


def model_and_data(
    model: Model, depth: int, width: int, batch: int
) -> tuple[list[nn.Module], nn.Module, Any, Any, Callable[..., torch.Tensor]]:
    """(layers to cut into stages, the whole model, inputs, targets, loss) for a deep MLP
    (`depth` layers of `width`) or a small GPT (embedding, depth - 2 blocks of d_model
    `width`, head; dropout off, so that microbatches see what the whole batch sees)."""
    if model == "mlp":
        layers = deep_mlp(depth, width)
        x, y = regression_batch(batch, width)
        return layers, nn.Sequential(*layers), x, y, nn.functional.mse_loss
    if model == "gpt":
        if depth < 3:
            raise ValueError(
                f"a GPT pipeline needs depth >= 3 (embedding, a block, head), got {depth}"
            )
        whole = gpt(GPTConfig(n_layers=depth - 2, d_model=width, block_size=SEQ))
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, whole.config.vocab, (batch, SEQ + 1), generator=g)

        def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

        return gpt_layers(whole), whole, tokens[:, :-1], tokens[:, 1:], lm_loss
    raise ValueError(f"model must be 'mlp' or 'gpt', got {model!r}")


def train(
    ctx: RankContext,
    schedule: Schedule,
    steps: int = 2,
    *,
    model: Model = "mlp",
    depth: int = 8,
    width: int = 16,
    batch: int = 16,
    by: By = "layers",
    lr: float = 0.05,
    compute: SimulatedCompute | None = None,
    forward_ms: float = 0.0,
    backward_ms: float = 0.0,
    weight_ms: float | None = None,
    recompute: bool = False,
    latency_us: float = 0.0,
    bandwidth_gbps: float | None = None,
    accumulate: int = 1,
    frozen: tuple[str, ...] = (),
    weight_decay: float = 0.0,
) -> dict[str, Any]:
    """`steps` SGD steps of a deep MLP or a small GPT cut into the schedule's stages;
    `schedule` a `Schedule` built for these ranks by the caller, before any rank starts
    (`make_schedule(name, ranks, microbatches, chunks)`, or `gpipe(4, 8)` and its kin:
    every rank runs the same value, never a name to rebuild); each over `accumulate`
    runtime steps (the batch cut in as many parts, gradients added up), with the
    parameters named in `frozen` frozen first; SGD with `weight_decay`.

    Simulated compute: `compute`, or `forward_ms` / `backward_ms` / `weight_ms` (W's part
    of backward; default half) for one rank's share of the model: a stage of a schedule
    with several stages per rank (a chunk) takes its fraction. Returns this rank's
    weights (named as in the whole model), the losses (on the last stage's rank), the
    last step's spans, the schedule, and the last step's peak in-flight activation bytes
    with the bytes one microbatch holds on each of this rank's stages (when traced).

    In three phases: the model cut into this rank's stages (`_rank_stages`) and a runtime
    over them, the steps (`_run_steps`), and what the tracer saw in the last one
    (`_last_step`).
    """
    plan = _schedule(schedule, ctx.world_size)
    per_rank = plan.model_stages // plan.ranks  # a rank's share of the model, in stages
    if compute is None and (forward_ms or backward_ms):
        compute = SimulatedCompute(
            forward_ms / 1e3, backward_ms / 1e3, None if weight_ms is None else weight_ms / 1e3
        ).per_chunk(per_rank)
    ctx.tracer.set_status(f"{plan.name}: building the model")
    layers, whole, x, y, loss_fn = model_and_data(model, depth, width, batch)
    for name in frozen:
        whole.get_parameter(name).requires_grad_(False)
    names = {id(p): n for n, p in whole.named_parameters()}
    cut, mine = _rank_stages(ctx, plan, layers, by)
    runtime = PipelineRuntime(
        plan,
        mine,
        ctx.group,
        loss_fn,
        tracer=ctx.tracer,
        compute=compute,
        link=simulated_link(latency_us, bandwidth_gbps),
        recompute=recompute,
        tied=tied_weights(cut),
    )
    params = list({id(p): p for m in mine.values() for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    losses, spans_before, counters_before = _run_steps(
        ctx, runtime, opt, x, y, steps=steps, accumulate=accumulate
    )
    weights = {names[id(p)]: p.detach().cpu().clone() for p in params}
    last_step, peak, held = _last_step(ctx.tracer.data(), spans_before, counters_before)
    return {
        "weights": weights,
        "losses": losses,
        "spans": last_step,
        "schedule": plan,
        "peak_in_flight_bytes": peak,
        "held_per_stage": held,
    }


def _rank_stages(
    ctx: RankContext, plan: Schedule, layers: Sequence[nn.Module], by: By
) -> tuple[list[nn.Sequential], dict[int, nn.Module]]:
    """The layers cut into the model's stages (DualPipe holds two copies of each), and the
    stages this rank holds in `plan`, on its device."""
    cut = partition(layers, plan.model_stages, by)
    mine: dict[int, nn.Module] = {
        s: cut[plan.model_stage(s)].to(ctx.device)
        for s, r in enumerate(plan.stage_rank)
        if r == ctx.rank
    }
    return cut, mine


def _run_steps(
    ctx: RankContext,
    runtime: PipelineRuntime,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    accumulate: int,
) -> tuple[list[float], int, int]:
    """`steps` optimizer steps, each over `accumulate` runtime steps (the batch cut in as
    many parts, gradients added up). Returns the losses (on the ranks where microbatches
    leave), and how many spans and counters the tracer held when the last step began."""
    plan = runtime.schedule
    first, last = plan.entry_ranks, plan.exit_ranks  # where microbatches enter (DualPipe:
    #                                                  both ends), and where they leave
    losses = []
    # The stages agree on their messages' shapes before the first step, not in it, so
    # that a one-step run's bubble is the schedule's (PipelineRuntime.prepare).
    parts = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
    runtime.prepare(parts[0][0].to(ctx.device) if ctx.rank in first else None)
    for _ in range(steps):
        torch.distributed.barrier(group=ctx.group)
        spans_before = len(ctx.tracer.data().spans)
        counters_before = len(ctx.tracer.data().counters)
        for xs, ys in parts:
            loss = runtime.step(
                xs.to(ctx.device) if ctx.rank in first else None,
                ys.to(ctx.device) if ctx.rank in last else None,
            )
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(loss)
    return losses, spans_before, counters_before


def _last_step(
    data: TraceData, spans_before: int, counters_before: int
) -> tuple[list[Span], float, dict[int, float]]:
    """The last step's spans (those after the first `spans_before`), its peak in-flight
    activation bytes, and the bytes one microbatch holds on each stage (at its first F),
    from the in-flight counters after the first `counters_before`."""
    last_step = data.spans[spans_before:]
    counts = [c for c in data.counters[counters_before:] if c.name == "in_flight_bytes"]
    held: dict[int, float] = {}  # bytes one microbatch holds on each stage: its first F
    for c in counts:
        held.setdefault(c.meta["stage"], c.value)
    return last_step, max((c.meta["now"] for c in counts), default=0.0), held


def bubble_of(run: Any) -> float:
    """The measured bubble of a `train` run's last step, over all ranks."""
    spans = [s for r in run.results for s in r["spans"]]
    return measured_bubble(spans, len(run.results))


TORCH_SCHEDULES = {  # ours -> torch.distributed.pipelining's counterpart
    name: entry.torch for name, entry in SCHEDULES.items() if entry.torch is not None
}


def _schedule(schedule: Schedule, ranks: int) -> Schedule:
    """`schedule`, refused if it is not one or was built for other ranks."""
    if not isinstance(schedule, Schedule):
        raise ValueError(
            f"pass the schedule itself, built before the ranks start (e.g. "
            f"make_schedule({schedule!r}, ranks, microbatches, chunks)), "
            f"not {type(schedule).__name__} {schedule!r}"
        )
    if schedule.ranks != ranks:
        raise ValueError(
            f"{schedule.name} was built for {schedule.ranks} ranks; this run has {ranks}"
        )
    return schedule


def every_runnable(ranks: int, microbatches: int, chunks: int = 2) -> list[Schedule]:
    """Every schedule that runs on `ranks` ranks, built for `microbatches` (which
    `common_microbatches` makes acceptable to all of them)."""
    return [make_schedule(name, ranks, microbatches, chunks) for name in runnable(ranks)]


def step_times(
    ctx: RankContext,
    microbatches: int,
    steps: int = 10,
    *,
    schedule: str = "gpipe",
    chunks: int = 2,
    depth: int = 8,
    width: int = 256,
    batch: int = 256,
) -> dict[str, Any]:
    """Step times (forward, backward and SGD step) and peak saved-activation bytes of our
    `schedule` and of torch.distributed.pipelining's counterpart on the same stages
    (the same cut, on the same ranks), step by step in alternation. Activations are
    measured by PeakSavedBytes over a separate step of each, so timing runs unhooked.

    On CPU ranks (`Pool(n, device="cpu")`): on ranks sharing a GPU, torch's stages
    receive into CUDA buffers through gloo, which aborts the process (seen on an H200)."""
    if ctx.device.type != "cpu":
        raise ValueError(
            f"step_times runs on CPU ranks (Pool(n, device='cpu')); this rank is on {ctx.device}"
        )
    plan = make_schedule(schedule, ctx.world_size, microbatches, chunks)
    x, y = regression_batch(batch, width)
    ours, ours_params = _our_step(ctx, plan, depth, width, x, y)
    theirs, theirs_params = _torch_step(ctx, plan, schedule, microbatches, depth, width, x, y)
    torch_name = f"torch {TORCH_SCHEDULES[schedule]}"
    runs = {"ours": ours, torch_name: theirs}
    peaks = _peak_activations(ctx, runs, {"ours": ours_params, torch_name: theirs_params})
    times = take_turns(
        ctx.group, {name: _each_round(fn) for name, fn in runs.items()}, steps, warmup=0
    )  # warmed up above
    return {"times": times, "peaks": peaks}


def _our_step(
    ctx: RankContext, plan: Schedule, depth: int, width: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[Callable[[], None], list[nn.Parameter]]:
    """One SGD step of a deep MLP under `plan` on our runtime, and this rank's weights."""
    first, last = plan.entry_ranks, plan.exit_ranks  # where microbatches enter (DualPipe:
    #                                                  both ends), and where they leave
    local = [s for s, r in enumerate(plan.stage_rank) if r == ctx.rank]
    cut = partition(deep_mlp(depth, width), plan.stages)
    stages: dict[int, nn.Module] = {s: cut[s] for s in local}
    runtime = PipelineRuntime(plan, stages, ctx.group, nn.functional.mse_loss)
    params = [p for s in local for p in cut[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.01)

    def step() -> None:
        runtime.step(x if ctx.rank in first else None, y if ctx.rank in last else None)
        opt.step()
        opt.zero_grad()

    return step, params


def _torch_step(
    ctx: RankContext,
    plan: Schedule,
    schedule: str,
    microbatches: int,
    depth: int,
    width: int,
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[Callable[[], None], list[nn.Parameter]]:
    """The same step on torch.distributed.pipelining's counterpart of `schedule` (the same
    cut of the same MLP, on the same ranks), and this rank's weights."""
    import torch.distributed.pipelining as pipelining

    first, last = plan.entry_ranks, plan.exit_ranks
    local = [s for s, r in enumerate(plan.stage_rank) if r == ctx.rank]
    cut = partition(deep_mlp(depth, width), plan.stages)
    stages = [
        pipelining.PipelineStage(cut[s], s, plan.stages, ctx.device, group=ctx.group) for s in local
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    theirs = cls(
        stages[0] if len(local) == 1 else stages,
        microbatches,
        loss_fn=nn.functional.mse_loss,
    )
    opt = torch.optim.SGD([p for s in local for p in cut[s].parameters()], lr=0.01)

    def step() -> None:
        args = (x,) if ctx.rank in first else ()
        kwargs = {"target": y} if ctx.rank in last else {}
        theirs.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()

    return step, [p for s in local for p in cut[s].parameters()]


def _peak_activations(
    ctx: RankContext,
    runs: dict[str, Callable[[], None]],
    weights: dict[str, list[nn.Parameter]],
) -> dict[str, int]:
    """Each run's peak saved-activation bytes over one step (its `weights` excluded),
    after a step of warm-up."""
    from parcourse.memory import PeakSavedBytes

    peaks: dict[str, int] = {}
    for name, fn in runs.items():
        fn()  # warm-up
        torch.distributed.barrier(group=ctx.group)
        with PeakSavedBytes(exclude=weights[name]) as saved:  # activations, not weights
            fn()
        peaks[name] = saved.peak
    return peaks


def _each_round(step: Callable[[], None]) -> Callable[[int], None]:
    """`step` as `take_turns` calls it: given the round's number, which it does not need."""
    return lambda _: step()


def as_trace(timeline: Timeline) -> Trace:
    """A simulated timeline as a trace, so that plots.timeline draws it as a measured one."""
    spans = [
        Span(
            s.rank,
            str(s.action),
            "compute",
            round(s.start * 1e9),
            round(s.end * 1e9),
            0,
            {"microbatch": s.action.microbatch, "stage": s.action.stage},
        )
        for s in timeline.spans
    ]
    return Trace(timeline.schedule.ranks, spans=spans)


def _with(p: int, m: int) -> str:
    """'with 1 stage and 2 microbatches': where an exercise check found its mistake."""
    return f"with {p} stage{'s' * (p != 1)} and {m} microbatch{'es' * (m != 1)}"


def check_schedule_exercise(fn: Callable[[int, int], Any]) -> bool:
    """Lesson 06's exercise: `fn(stages, microbatches)` returns GPipe's actions, a list per
    rank. Checked by the dependency checker and against `gpipe`; one short verdict."""
    from parcourse.pipeline.schedule import check

    for p in range(1, 5):
        for m in range(1, 9):
            ok, got = ask(fn, p, m, where=f"{_with(p, m)}, ")
            if not ok:
                return False
            per_rank = got.actions if isinstance(got, Schedule) else got
            if not isinstance(per_rank, (list, tuple)) or not all(
                isinstance(acts, (list, tuple)) for acts in per_rank
            ):
                inner = (
                    f" of {type(per_rank[0]).__name__}"
                    if isinstance(per_rank, (list, tuple)) and per_rank
                    else ""
                )
                print(
                    f"Not quite: {_with(p, m)} your function returned a "
                    f"{type(per_rank).__name__}{inner}; expected one list per rank "
                    f"({p} list{'s' * (p != 1)}), each with that rank's actions in order."
                )
                return False
            try:
                schedule = Schedule(
                    "yours", m, tuple(range(p)), tuple(tuple(acts) for acts in per_rank)
                )
                check(schedule)
            except (TypeError, ValueError) as e:
                print(
                    f"Not quite: {_with(p, m)}, {e}. Hint: every "
                    "stage runs each microbatch's forward, then backward, once."
                )
                return False
            expected = gpipe(p, m)
            if schedule.actions != expected.actions:
                r = next(r for r in range(p) if schedule[r] != expected[r])
                print(
                    f"Not quite: {_with(p, m)} the schedule runs, but is not GPipe's: rank "
                    f"{r} runs {' '.join(map(str, schedule[r]))}, GPipe runs "
                    f"{' '.join(map(str, expected[r]))}. Hint: all forwards first, then all "
                    "backwards, the last microbatch's first."
                )
                return False
    print("Correct: every forward, then every backward in reverse, on every stage.")
    return True


# --------------------------------------------------------------------------- lesson 07

# Every pipeline schedule of the registry (naive runs the batch whole: no pipeline).
ALL_SCHEDULES = tuple(name for name, entry in SCHEDULES.items() if entry.microbatched)


def runnable(ranks: int) -> tuple[str, ...]:
    """The schedules of ALL_SCHEDULES that run on `ranks` ranks with some number of
    microbatches (DualPipe needs an even number of ranks)."""
    return tuple(
        name
        for name in ALL_SCHEDULES
        if any(SCHEDULES[name].accepts(ranks, m) for m in range(1, 4 * ranks + 3))
    )


def common_microbatches(ranks: int, microbatches: int) -> int:
    """The smallest m >= `microbatches` that every schedule that runs on `ranks` ranks
    accepts (as the registry states: e.g. a multiple of the ranks for interleaved 1F1B's
    rounds, at least 2 ranks for DualPipeV, an even count for DualPipe)."""
    m = microbatches
    while not all(SCHEDULES[name].accepts(ranks, m) for name in runnable(ranks)):
        m += 1
    return m


def every_schedule(
    ctx: RankContext, schedules: Sequence[Schedule], **kwargs: Any
) -> dict[str, dict[str, Any]]:
    """One step of each of `schedules` (e.g. `every_runnable(ranks, m)`) in turn on the
    same ranks (train's keyword arguments); what each `train` returned, by schedule name,
    without the weights."""
    out = {}
    for k, schedule in enumerate(schedules, 1):
        ctx.tracer.set_status(f"{schedule.name}, schedule {k} of {len(schedules)}")
        result = train(ctx, schedule, 1, **kwargs)
        result.pop("weights")
        out[schedule.name] = result
    return out


@dataclass
class ScheduleSummary:
    """A schedule's step, measured and simulated (all ranks)."""

    name: str
    bubble: float
    simulated_bubble: float
    peak_bytes: float  # the busiest rank's peak in-flight activations
    simulated_peak_bytes: float  # the simulator's count on each stage x the bytes measured
    per_rank_bytes: list[float]
    messages: int  # between ranks, per step (simulated)
    # the most microbatches each rank holds at once (the schedule's count, which the
    # runtime follows), and what one microbatch holds on each of its stages
    per_rank_in_flight: list[int] = field(default_factory=list)
    per_rank_microbatch_bytes: list[list[float]] = field(default_factory=list)


def summarize(results: Sequence[dict[str, Any]], costs: Costs) -> ScheduleSummary:
    """`results`: one `train` result per rank; `costs` for one rank's layers (a chunk of a
    schedule with v stages per rank costs a v-th)."""
    plan: Schedule = results[0]["schedule"]
    predicted = simulate(plan, costs.per_chunk(plan.model_stages // plan.ranks))
    held: dict[int, float] = {}
    for r in results:
        held.update(r["held_per_stage"])
    per_stage = [held.get(s, 0.0) for s in range(plan.stages)]
    expected = [max(in_flight(plan[r], per_stage), default=0.0) for r in range(plan.ranks)]
    per_rank = [r["peak_in_flight_bytes"] for r in results]
    spans = [s for r in results for s in r["spans"]]
    mine = [
        [per_stage[st] for st, r in enumerate(plan.stage_rank) if r == rank]
        for rank in range(plan.ranks)
    ]
    return ScheduleSummary(
        plan.name,
        measured_bubble(spans, plan.ranks),
        predicted.bubble,
        max(per_rank),
        max(expected),
        per_rank,
        predicted.messages,
        list(predicted.peak_in_flight),
        mine,
    )


def check_one_f_one_b_exercise(fn: Callable[[int, int, int], Any]) -> bool:
    """Lesson 07's exercise: `fn(stage, stages, microbatches)` returns the actions of one
    stage under 1F1B. Checked for 1-6 stages and 1-12 microbatches: the schedule built
    from it must run (the dependency checker), hold at most p - s microbatches on stage
    s (the simulator), and keep GPipe's bubble. Prints one short verdict; True if right."""
    from parcourse.pipeline.schedule import check
    from parcourse.theory import gpipe_bubble

    for p in range(1, 7):
        for m in range(1, 13):
            ok, per_rank = ask(
                lambda: [list(fn(s, p, m)) for s in range(p)],  # noqa: B023
                where=f"{_with(p, m)}, ",
            )
            if not ok:
                return False
            odd = next((a for acts in per_rank for a in acts if not isinstance(a, Action)), None)
            if odd is not None:
                print(
                    f"Not quite: {_with(p, m)}, a stage's list holds {odd!r} "
                    f"({type(odd).__name__}); expected actions, F(s, i) and B(s, i)."
                )
                return False
            schedule = Schedule("yours", m, tuple(range(p)), tuple(map(tuple, per_rank)))
            try:
                check(schedule)
            except (TypeError, ValueError) as e:
                print(
                    f"Not quite: {_with(p, m)}, {e}. Hint: stage s "
                    "starts with p - s - 1 forwards, never more than m."
                )
                return False
            timeline = simulate(schedule, Costs(forward=1, backward=2))
            for s, peak in enumerate(timeline.peak_in_flight):
                if peak > min(p - s, m):
                    print(
                        f"Not quite: {_with(p, m)}, stage {s} holds "
                        f"{peak} microbatches at once; 1F1B holds at most "
                        f"{min(p - s, m)}. Hint: after the warm-up, each forward is "
                        "followed by the oldest backward."
                    )
                    return False
            if abs(timeline.bubble - gpipe_bubble(p, m)) > 1e-9:
                print(
                    f"Not quite: {_with(p, m)}, the bubble is "
                    f"{timeline.bubble:.3f}, not GPipe's {gpipe_bubble(p, m):.3f}: too few "
                    "forwards in the warm-up stall the stages after it."
                )
                return False
    print(
        "Correct: warm-up, one forward and one backward in turn, cool-down; at most p - s "
        "microbatches on stage s, and GPipe's bubble."
    )
    return True
