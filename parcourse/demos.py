"""Rank functions that lessons, the CLI and the benchmarks run to measure collectives and
data parallelism, and the exercise checks of lessons 01 and 02."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.basics import run_exercise
from parcourse.collectives import (SimulatedLink, chunk_bounds, naive_all_reduce,
                                   ring_all_reduce, simulated_link)
from parcourse.data_parallel import BucketedDataParallel
from parcourse.launch import Pool, RankContext

Algo = Literal["ring", "naive", "torch"]
ALGOS: tuple[str, ...] = ("ring", "naive", "torch")


def all_reduce_with(algo: Algo, t: torch.Tensor, ctx: RankContext, *,
                    link: SimulatedLink | None = None, traced: bool = False) -> None:
    """One all-reduce of `t` with the chosen algorithm (torch's ignores the link)."""
    tracer = ctx.tracer if traced else None
    if algo == "ring":
        ring_all_reduce(t, ctx.group, tracer=tracer, link=link)
    elif algo == "naive":
        naive_all_reduce(t, ctx.group, tracer=tracer, link=link)
    elif algo == "torch":
        with ctx.tracer.span("torch all_reduce", kind="comm") if traced else nullcontext():
            dist.all_reduce(t, group=ctx.group)
    else:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGOS)}")


def check_all_reduced(ctx: RankContext, algo: str, t: torch.Tensor, expected: float) -> None:
    """Raise, naming this rank, unless every element of `t` equals `expected`."""
    if not bool(t.eq(expected).all()):
        raise AssertionError(f"rank {ctx.rank}: {algo} all-reduce of {t.nbytes} bytes gave "
                             f"{t.view(-1)[:4].tolist()}…, expected {expected}")


# Every integer up to this is exact in the dtype: as far as back-to-back sums of ones may go.
_EXACT_UP_TO = {"float16": 1 << 11, "bfloat16": 1 << 8, "float32": 1 << 24,
                "float64": 1 << 53, "int32": (1 << 31) - 1, "int64": (1 << 63) - 1}


def max_batch(world_size: int, dtype: str = "float32") -> int:
    """The most all-reduces `time_all_reduce` may run back to back from ones:
    world_size ** batch must stay exact in the dtype (any number with one rank)."""
    if world_size == 1:
        return sys.maxsize
    batch = 0
    while world_size ** (batch + 1) <= _EXACT_UP_TO[dtype]:
        batch += 1
    return batch


def _timed(ctx: RankContext, algo: str, t: torch.Tensor, ops: int,
           link: SimulatedLink | None) -> float:
    """Seconds per all-reduce of `ops` run back to back from ones after a barrier;
    the result is checked afterwards (untimed)."""
    t.fill_(1)
    dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    for _ in range(ops):
        all_reduce_with(algo, t, ctx, link=link)  # type: ignore[arg-type]
    if t.is_cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / ops
    check_all_reduced(ctx, algo, t, ctx.world_size ** ops)
    return seconds


def time_all_reduce(ctx: RankContext, algos: list[str], sizes: list[int], repeats: int,
                    dtype: str = "float32", link: SimulatedLink | None = None,
                    batch: int = 1) -> dict[tuple[str, int], list[float]]:
    """Seconds per all-reduce on this rank, for each (algorithm, size in bytes).

    Each of the `repeats` samples times `batch` all-reduces run back to back
    after a barrier and divides by `batch`. batch=1 times one all-reduce that
    starts on every rank at the same moment; a larger batch times the steady
    state of one all-reduce after another, as nccl-tests does (and as a
    stream of gradient buckets runs). Algorithms alternate (and swap order
    every sample) so that a change in the machine's load hits all of them
    alike. One warm-up each, untimed.

    Every sample starts from ones and its result is checked, untimed: world
    size ** batch everywhere. (Summing the same tensor without refilling it
    would reach inf after 128 rounds with two ranks.)
    """
    torch_dtype = getattr(torch, dtype)
    if not 1 <= batch <= max_batch(ctx.world_size, dtype):
        raise ValueError(f"batch={batch} with {ctx.world_size} ranks sums to "
                         f"{ctx.world_size}**{batch}, more than {dtype} holds exactly; "
                         "use a smaller batch")
    out: dict[tuple[str, int], list[float]] = {}
    for size in sizes:
        t = torch.ones(max(1, size // torch_dtype.itemsize), dtype=torch_dtype,
                       device=ctx.device)
        for algo in algos:
            _timed(ctx, algo, t, 1, link)  # warm-up
        for i in range(repeats):
            for algo in algos if i % 2 == 0 else algos[::-1]:
                out.setdefault((algo, size), []).append(_timed(ctx, algo, t, batch, link))
    return out


def time_over_links(ctx: RankContext, algos: list[str], nbytes: int,
                    links: Mapping[str, SimulatedLink | None],
                    repeats: int) -> dict[tuple[str, str], list[float]]:
    """Seconds per all-reduce of `nbytes` floats' bytes on this rank, for each
    (algorithm, name of a link in `links`), every combination alternating (and
    swapping order every sample) as in `time_all_reduce`, so that they can be
    compared with each other. One warm-up each, untimed; results checked."""
    t = torch.ones(max(1, nbytes // 4), device=ctx.device)
    combos = [(algo, name) for algo in algos for name in links]
    for algo, name in combos:
        _timed(ctx, algo, t, 1, links[name])  # warm-up
    out: dict[tuple[str, str], list[float]] = {}
    for i in range(repeats):
        for algo, name in combos if i % 2 == 0 else combos[::-1]:
            out.setdefault((algo, name), []).append(_timed(ctx, algo, t, 1, links[name]))
    return out


def data_parallel_steps(ctx: RankContext, configs: Mapping[str, Mapping[str, Any]],
                        links: Mapping[str, SimulatedLink | None], steps: int = 4, *,
                        width: int = 256, depth: int = 6,
                        batch: int = 256) -> dict[tuple[str, str], list[float]]:
    """Seconds per training step of each (configuration, link), all alternating step by
    step (`training.alternate_steps`), so that they can be compared with each other.

    `configs` maps a name to `training.wrap` arguments ("torch" takes no link), or to
    {"impl": "none"}: the model alone, each rank training on its slice without any
    communication (what the compute costs, timed alongside). `links` maps a name to
    a link, e.g. {"link": SimulatedLink.of(500, 0.2), "free": SimulatedLink()}: a
    free link runs the same code and adds no time.
    """
    from parcourse.data import local_regression
    from parcourse.data_parallel.training import alternate_steps, wrap
    from parcourse.models import mlp

    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    runs = {}
    for name, cfg in configs.items():
        for link_name, link in links.items():
            model = mlp(width, width, width, depth=depth).to(ctx.device)
            ddp = model if cfg["impl"] == "none" else wrap(model, ctx=ctx, link=link, **cfg)
            runs[name, link_name] = (ddp, torch.optim.Adam(ddp.parameters(), lr=0.01))
    return alternate_steps(ctx, runs, x, y, steps)


def slowest_rank(per_rank: list[dict[Any, list[float]]], key: Any) -> list[float]:
    """Each repetition lasts as long as its slowest rank."""
    return [max(ts) for ts in zip(*(r[key] for r in per_rank))]


def traced_all_reduce(ctx: RankContext, algo: Algo, numel: int, latency_us: float = 0.0,
                      bandwidth_gbps: float | None = None) -> float:
    """One traced all-reduce of `numel` floats (rank r holds r + 1); returns bytes sent.

    The spans (one per ring step, coloured by chunk) and the bytes_sent counter
    land in the run's trace.
    """
    link = simulated_link(latency_us, bandwidth_gbps)
    t = torch.full((numel,), float(ctx.rank + 1), device=ctx.device)
    dist.barrier(group=ctx.group)
    all_reduce_with(algo, t, ctx, link=link, traced=True)
    check_all_reduced(ctx, algo, t, ctx.world_size * (ctx.world_size + 1) / 2)
    return ctx.tracer.total("bytes_sent")


def _ring_steps_with(ctx: RankContext, step_fn: Callable[..., Any],
                     numel: int) -> tuple[list[float], list[float]]:
    """Run a learner's reduce-scatter step n - 1 times; return (my chunk, expected)."""
    n, rank = ctx.world_size, ctx.rank
    flat = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    expected = torch.arange(numel, dtype=torch.float32) * (n * (n + 1) / 2)
    bounds = chunk_bounds(numel, n)
    for step in range(n - 1):
        step_fn(flat, bounds, step, rank, n, ctx.group)
    start, end = bounds[rank]
    return flat[start:end].tolist(), expected[start:end].tolist()


def check_ring_step(step_fn: Callable[..., Any], pool: Pool, numel: int = 10,
                    timeout: float = 30.0) -> bool:
    """Exercise check for lesson 01: n - 1 of your steps must leave chunk r fully summed
    on rank r. Prints what it found (expected, got and a hint when wrong); True only
    when every rank owns its reduced chunk. Needs at least 2 ranks."""
    if pool.world_size < 2:
        print("One rank has no ring: run this check on a pool of 2 ranks or more.")
        return False
    run = run_exercise(pool, _ring_steps_with, step_fn, numel, timeout=timeout)
    if run is None:
        return False
    for rank, (got, expected) in enumerate(run.results):
        if got != expected:
            print(f"Not quite: rank {rank} ended with chunk {got}, expected {expected}. "
                  "Hint: step s sends chunk (rank - s - 1) % n to the right and adds chunk "
                  "(rank - s - 2) % n, received from the left, into its own copy.")
            return False
    steps = pool.world_size - 1
    print(f"Correct: after {steps} step{'s' * (steps > 1)} every rank owns its fully reduced "
          "chunk.")
    return True


# --------------------------------------------------------------------------- lesson 02

LaunchRule = Callable[[set[int], list[list[int]], int, Callable[[int], None]], int]


def _launches(rule: LaunchRule, buckets: list[list[int]],
              order: list[int]) -> list[tuple[int, int]]:
    """Feed gradients to `rule` in `order`; return (gradients arrived, bucket) per launch."""
    launched: list[tuple[int, int]] = []
    ready: set[int] = set()
    next_bucket = 0
    for param in order:
        ready.add(param)
        next_bucket = rule(ready, buckets, next_bucket,
                           lambda k: launched.append((len(ready), k)))
    return launched


def launch_ready_buckets(ready: set[int], buckets: list[list[int]], next_bucket: int,
                         launch: Callable[[int], None]) -> int:
    """The rule BucketedDataParallel follows when a gradient arrives: start every bucket
    from `next_bucket` on whose gradients have all arrived, in order, stopping at the
    first that is not complete (every rank must start the same buckets in the same
    order); return the first bucket not started."""
    while next_bucket < len(buckets) and all(i in ready for i in buckets[next_bucket]):
        launch(next_bucket)
        next_bucket += 1
    return next_bucket


# (buckets of parameter indices, in launch order; the order gradients arrive in; why)
_LAUNCH_CASES = [
    ([[5, 4], [3, 2], [1, 0]], [5, 4, 3, 2, 1, 0], "backward, last layer first"),
    ([[5, 4, 3], [2, 1, 0]], [5, 3, 4, 1, 2, 0], "arrivals out of order inside buckets"),
    ([[5, 4], [3, 2], [1, 0]], [3, 2, 1, 0, 5, 4], "the first bucket's gradients arrive last"),
    ([[3], [2], [1], [0]], [3, 2, 1, 0], "one parameter per bucket"),
]


def check_launch_rule(rule: LaunchRule) -> bool:
    """Exercise check for lesson 02: does `rule(ready, buckets, next_bucket, launch)`
    start each bucket as soon as it may, in order, once? Prints what it found
    (expected, got and a hint when wrong); True only when every case matches."""
    for buckets, order, why in _LAUNCH_CASES:
        expected = _launches(launch_ready_buckets, buckets, order)
        try:
            got = _launches(rule, buckets, order)
        except NotImplementedError:
            print("Not written yet: fill in the function above, then run this cell again.")
            return False
        except Exception as e:  # the learner's code: say what, not a traceback
            print(f"Not yet: your function raised {type(e).__name__}: {e}")
            return False
        if got != expected:
            show = "; ".join(f"bucket {k} after {n}" for n, k in expected)
            mine = "; ".join(f"bucket {k} after {n}" for n, k in got) or "nothing"
            print(f"Not quite ({why}: buckets {buckets}, gradients arriving {order}): "
                  f"expected {show}; got {mine}. Hint: start buckets strictly in order, each "
                  "as soon as all its gradients are in, and keep going while the next one "
                  "is complete too.")
            return False
    print(f"Correct: every bucket starts as soon as it may, in order ({len(_LAUNCH_CASES)} "
          "cases).")
    return True


def check_buckets(fn: Callable[[list[int], int], list[list[int]]]) -> bool:
    """Exercise check for lesson 02: `fn(sizes, limit)` must group parameter indices as
    BucketedDataParallel does (reverse order, at most `limit` bytes, a larger
    parameter alone). Prints what it found; True only when every case matches."""
    from parcourse.data_parallel import make_buckets

    cases = [([400, 40, 4000, 40], 1000), ([10] * 7, 25), ([5000, 10, 10], 1000), ([1], 1)]
    for sizes, limit in cases:
        params = [torch.nn.Parameter(torch.empty(max(1, s // 4))) for s in sizes]
        index = {id(p): i for i, p in enumerate(params)}
        expected = [[index[id(p)] for p in b.params] for b in make_buckets(params, limit / 2**20)]
        try:
            got = fn([p.numel() * 4 for p in params], limit)
        except NotImplementedError:
            print("Not written yet: fill in the function above, then run this cell again.")
            return False
        except Exception as e:  # the learner's code: say what, not a traceback
            print(f"Not yet: your function raised {type(e).__name__}: {e}")
            return False
        if got != expected:
            print(f"Not quite (sizes {[p.numel() * 4 for p in params]}, limit {limit}): "
                  f"expected {expected}, got {got}. Hint: walk the parameters from the last "
                  "to the first, and start a new bucket when the next one would not fit.")
            return False
    print("Correct: same buckets as BucketedDataParallel.")
    return True


class RuledDataParallel(BucketedDataParallel):
    """BucketedDataParallel whose buckets start by a rule given as a function (lesson
    02's exercise): `rule(ready, buckets, next_bucket, launch)` as
    `launch_ready_buckets`, with parameters and buckets as indices."""

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup | None, rule: LaunchRule,
                 **kwargs: Any) -> None:
        super().__init__(module, group, **kwargs)
        self.rule = rule
        self._index = {id(p): i for i, p in enumerate(self.sync_params)}
        self._indices = [[self._index[id(p)] for p in b.params] for b in self.buckets]
        self._ready: set[int] = set()

    def grad_ready(self, param: torch.Tensor) -> None:
        self._bucket_of[id(param)].ready.add(id(param))
        self._ready.add(self._index[id(param)])
        self._next = self.rule(self._ready, self._indices, self._next,
                               lambda k: self._launch(self.buckets[k]))

    def finish_gradient_sync(self) -> None:
        super().finish_gradient_sync()
        self._ready.clear()


def train_with_rule(ctx: RankContext, rule: LaunchRule | None, steps: int = 3, *,
                    width: int = 256, depth: int = 6, batch: int = 256, bucket_mb: float = 1.0,
                    latency_us: float = 0.0, bandwidth_gbps: float | None = None) -> list[float]:
    """Traced training steps with buckets started by `rule` (None: only after backward,
    no overlap); returns seconds per step, the first one (warm-up) left out."""
    from parcourse.data import local_regression
    from parcourse.models import mlp

    link = simulated_link(latency_us, bandwidth_gbps)
    algorithm = "ring" if link is not None else "torch"
    model = mlp(width, width, width, depth=depth).to(ctx.device)
    kwargs = {"bucket_mb": bucket_mb, "algorithm": algorithm, "link": link, "tracer": ctx.tracer}
    ddp = (BucketedDataParallel(model, ctx.group, overlap=False, **kwargs) if rule is None
           else RuledDataParallel(model, ctx.group, rule, **kwargs))
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    times = []
    for step in range(steps + 1):
        dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        with ctx.tracer.span("forward", step=step):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        with ctx.tracer.span("optimizer", step=step):
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]
