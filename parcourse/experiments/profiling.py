"""Lesson 12's profiled step: one training step of the course's GPT under bucketed data
parallelism, run with torch.profiler on every rank, read beside the course's spans.

    run = profile_step()                       # 2 ranks, seconds
    print(operator_table(run))                 # the step's operators, by self CPU time
    operator_timeline(run, window=bucket_window(run))   # a bucket's all-reduce, zoomed
    run.to_chrome("step.json")                 # the whole run, for ui.perfetto.dev

The step's collectives are torch's (gloo runs them on its own threads, which
torch.profiler records: a bucket's `gloo:all_reduce` sits beside the backward's
`aten::mm`); the course's ring would run on a Python thread the profiler does not see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from parcourse.data import progressions, shard
from parcourse.data_parallel.bucketed import BucketedDataParallel
from parcourse.launch import Pool, RankContext, Run, launch
from parcourse.models import GPTConfig, gpt
from parcourse.profiler import Profile, RankProfile

if TYPE_CHECKING:
    from matplotlib.figure import Figure, SubFigure

# Small enough for a step in a fraction of a second on one core, large enough for
# several buckets of 1 MB (0.83 M parameters: 3.3 MB of gradients).
CONFIG = GPTConfig(vocab=256, block_size=64, n_layers=4, n_heads=4, d_model=128)
STEP = "step"  # the course span around the profiled step; the table counts what is inside


def dp_step(
    ctx: RankContext, config: GPTConfig = CONFIG, batch: int = 8, bucket_mb: float = 1.0
) -> float:
    """A warm-up step (Adam's state is made there), then one step inside a span "step":
    the GPT under `BucketedDataParallel` (traced: backward, each bucket's all-reduce, the
    wait for the last ones), `batch` sequences split over the ranks. Returns its loss."""
    ctx.tracer.set_status("building the model")
    model = BucketedDataParallel(gpt(config), ctx.group, bucket_mb=bucket_mb, tracer=ctx.tracer)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = progressions(batch, config.block_size, config.vocab)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    loss = torch.zeros(())
    for name in ("warm-up", STEP):
        with ctx.tracer.span(name):
            with ctx.tracer.span("forward"):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()  # the wrapper traces backward and its buckets itself
            with ctx.tracer.span("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return loss.item()


def profile_step(
    world_size: int = 2,
    *,
    config: GPTConfig = CONFIG,
    batch: int = 8,
    bucket_mb: float = 1.0,
    pool: Pool | None = None,
) -> Run:
    """`dp_step` on `world_size` ranks (on `pool` when given) under torch.profiler, its
    operator table counting the step alone (`Profile(within="step")`)."""
    options = Profile(within=STEP)
    if pool is not None:
        return pool.run(dp_step, config, batch, bucket_mb, profile=options)
    return launch(dp_step, world_size, config, batch, bucket_mb, profile=options)


def _profile(run: Run, rank: int) -> RankProfile:
    if not run.profiles:
        raise ValueError("the run was not profiled: run it with profile=True")
    for p in run.profiles:
        if p.rank == rank:
            return p
    raise ValueError(f"no profile of rank {rank}; the run has ranks 0 to {run.world_size - 1}")


def operator_table(run: Run, rank: int = 0, top: int = 12) -> str:
    """The `top` operators of `rank` by self CPU time (torch's key_averages: self excludes
    the operators an operator called), a line each: calls, self and total milliseconds,
    the share of the self time, the bytes it allocated itself."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an int >= 1, got {top!r}")
    rows = _profile(run, rank).averages
    total = sum(r.self_cpu_us for r in rows) or 1.0
    lines = [
        f"{'operator':<40} {'calls':>6} {'self ms':>8} {'self %':>7} {'total ms':>9} {'self MB':>8}"
    ]
    for r in rows[:top]:
        lines.append(
            f"{r.name[:40]:<40} {r.calls:>6} {r.self_cpu_us / 1e3:>8.2f} "
            f"{100 * r.self_cpu_us / total:>6.1f}% {r.cpu_total_us / 1e3:>9.2f} "
            f"{r.self_cpu_memory / 2**20:>8.2f}"
        )
    lines.append(f"{'all ' + str(len(rows)) + ' operators':<40} {'':>6} {total / 1e3:>8.2f}")
    return "\n".join(lines)


def bucket_window(run: Run, rank: int = 0, bucket: int = 0, margin: float = 1.0) -> tuple[int, int]:
    """A window (ns on the course's clock) around bucket `bucket`'s all-reduce in the
    step on `rank`: the all-reduce, and `margin` times its length on each side (at least
    a millisecond: the course draws a bucket that gloo ran beside the one before it from
    when that one finished, which can leave it no length), cut to the step's span."""
    if not margin >= 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    step = run.trace.spans_of(rank=rank, name=STEP)
    reduces = [
        s
        for s in run.trace.spans_of(rank=rank, name="all_reduce")
        if s.meta.get("bucket") == bucket and step and step[-1].start_ns <= s.start_ns
    ]
    if not reduces:
        raise ValueError(f"rank {rank} traced no all-reduce of bucket {bucket} in its step")
    s, within = reduces[-1], step[-1]
    pad = max(int((s.end_ns - s.start_ns) * margin), 1_000_000)
    return max(s.start_ns - pad, within.start_ns), min(s.end_ns + pad, within.end_ns)


def operator_timeline(
    run: Run, rank: int = 0, window: tuple[int, int] | None = None, **kwargs: Any
) -> Figure | SubFigure:
    """`parcourse.plots.operator_timeline` of `rank` in `run` (the course's spans above,
    torch's operators below), in `window` (default: the step)."""
    from parcourse.plots import operator_timeline as draw

    if window is None:
        step = run.trace.spans_of(rank=rank, name=STEP)
        window = (step[-1].start_ns, step[-1].end_ns) if step else None
    return draw(run.trace, _profile(run, rank), window=window, **kwargs)
