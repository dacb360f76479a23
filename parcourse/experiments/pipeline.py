"""Pipeline runs that lessons 06-07, the CLI and benchmarks/pipeline.py launch: a deep MLP
cut into stages, trained under a schedule, with its measured bubble and in-flight memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from parcourse.collectives import simulated_link
from parcourse.launch import RankContext
from parcourse.pipeline.partition import By, partition
from parcourse.pipeline.runtime import PipelineRuntime, SimulatedCompute, measured_bubble
from parcourse.pipeline.schedule import Schedule, gpipe, naive, one_f_one_b
from parcourse.pipeline.simulate import Timeline
from parcourse.trace import Span, Trace

ScheduleName = Literal["naive", "gpipe", "1f1b"]
SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "naive": lambda stages, microbatches: naive(stages),
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stages, microbatches)


def deep_mlp(depth: int, width: int, seed: int = 0) -> list[nn.Module]:
    """`depth` layers Linear + Tanh of equal width: equal stages for any cut."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]


def regression_batch(batch: int, width: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def train(ctx: RankContext, schedule: str, microbatches: int, steps: int = 2, *,
          depth: int = 8, width: int = 16, batch: int = 16, by: By = "layers",
          lr: float = 0.05, compute: SimulatedCompute | None = None,
          forward_ms: float = 0.0, backward_ms: float = 0.0, recompute: bool = False,
          latency_us: float = 0.0, bandwidth_gbps: float | None = None) -> dict[str, Any]:
    """`steps` SGD steps of a deep MLP cut into one stage per rank, under `schedule`.

    Simulated compute: `compute`, or `forward_ms` / `backward_ms` per stage (what panels
    pass). Returns this rank's stage weights (named as in the whole model), the losses
    (last stage), and the last step's spans.
    """
    if compute is None and (forward_ms or backward_ms):
        compute = SimulatedCompute(forward_ms / 1e3, backward_ms / 1e3)
    stages = ctx.world_size
    plan = make_schedule(schedule, stages, microbatches)
    layers = deep_mlp(depth, width)
    cut = partition(layers, stages, by)
    module = cut[ctx.rank].to(ctx.device)
    first = sum(len(c) for c in cut[:ctx.rank])  # index of this stage's first layer
    runtime = PipelineRuntime(plan, {ctx.rank: module}, ctx.group, nn.functional.mse_loss,
                              tracer=ctx.tracer, compute=compute,
                              link=simulated_link(latency_us, bandwidth_gbps),
                              recompute=recompute)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    x, y = regression_batch(batch, width)
    losses = []
    for _ in range(steps):
        torch.distributed.barrier(group=ctx.group)
        spans_before = len(ctx.tracer.data().spans)
        loss = runtime.step(x if ctx.rank == 0 else None, y if ctx.rank == stages - 1 else None)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(loss)
    weights = {f"{first + int(k.split('.')[0])}.{k.split('.', 1)[1]}": v.detach().clone()
               for k, v in module.state_dict().items()}
    last_step = ctx.tracer.data().spans[spans_before:]
    return {"weights": weights, "losses": losses, "spans": last_step}


def one_process(steps: int = 2, *, depth: int = 8, width: int = 16, batch: int = 16,
                lr: float = 0.05) -> dict[str, torch.Tensor]:
    """The same training in one process, on the whole batch."""
    model = nn.Sequential(*deep_mlp(depth, width))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = regression_batch(batch, width)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def bubble_of(run: Any) -> float:
    """The measured bubble of a `train` run's last step, over all ranks."""
    spans = [s for r in run.results for s in r["spans"]]
    return measured_bubble(spans, len(run.results))


def step_times(ctx: RankContext, microbatches: int, steps: int = 10, *, depth: int = 8,
               width: int = 256, batch: int = 256) -> dict[str, list[float]]:
    """Step times (forward, backward and SGD step) of our GPipe and of
    torch.distributed.pipelining's ScheduleGPipe on the same stages, alternating."""
    import time

    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stages, rank = ctx.world_size, ctx.rank
    x, y = regression_batch(batch, width)
    runs: dict[str, Callable[[], None]] = {}

    ours_module = partition(deep_mlp(depth, width), stages)[rank]
    ours = PipelineRuntime(gpipe(stages, microbatches), {rank: ours_module}, ctx.group,
                           nn.functional.mse_loss)
    ours_opt = torch.optim.SGD(ours_module.parameters(), lr=0.01)

    def ours_step() -> None:
        ours.step(x if rank == 0 else None, y if rank == stages - 1 else None)
        ours_opt.step()
        ours_opt.zero_grad()

    theirs_module = partition(deep_mlp(depth, width), stages)[rank]
    stage = PipelineStage(theirs_module, rank, stages, ctx.device, group=ctx.group)
    theirs = ScheduleGPipe(stage, microbatches, loss_fn=nn.functional.mse_loss)
    theirs_opt = torch.optim.SGD(theirs_module.parameters(), lr=0.01)

    def theirs_step() -> None:
        if rank == 0:
            theirs.step(x)
        elif rank == stages - 1:
            theirs.step(target=y)
        else:
            theirs.step()
        theirs_opt.step()
        theirs_opt.zero_grad()

    runs = {"ours": ours_step, "torch ScheduleGPipe": theirs_step}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(steps):
        for name, fn in runs.items():
            torch.distributed.barrier(group=ctx.group)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def as_trace(timeline: Timeline) -> Trace:
    """A simulated timeline as a trace, so that plots.timeline draws it as a measured one."""
    spans = [Span(s.rank, str(s.action), "compute", round(s.start * 1e9), round(s.end * 1e9), 0,
                  {"microbatch": s.action.microbatch, "stage": s.action.stage})
             for s in timeline.spans]
    return Trace(timeline.schedule.ranks, spans=spans)


def check_schedule_exercise(fn: Callable[[int, int], Any]) -> bool:
    """Lesson 06's exercise: `fn(stages, microbatches)` returns GPipe's actions, a list per
    rank. Checked by the dependency checker and against `gpipe`; one short verdict."""
    from parcourse.pipeline.schedule import check

    for p in range(1, 5):
        for m in range(1, 9):
            try:
                got = fn(p, m)
            except NotImplementedError:
                print("Not written yet: fill in the function above, then run this cell again.")
                return False
            per_rank = got.actions if isinstance(got, Schedule) else got
            try:
                schedule = Schedule("yours", m, tuple(range(p)),
                                    tuple(tuple(acts) for acts in per_rank))
                check(schedule)
            except (TypeError, ValueError) as e:
                print(f"Not quite: with {p} stages and {m} microbatches, {e}. Hint: every "
                      "stage runs each microbatch's forward, then backward, once.")
                return False
            if schedule.actions != gpipe(p, m).actions:
                print(f"Not quite: with {p} stages and {m} microbatches the schedule runs, "
                      f"but is not GPipe's: rank 0 runs {' '.join(map(str, schedule[0]))}. "
                      "Hint: all forwards first, then all backwards, the last microbatch's "
                      "first.")
                return False
    print("Correct: every forward, then every backward in reverse, on every stage.")
    return True
