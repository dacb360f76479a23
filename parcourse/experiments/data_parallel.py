"""Lesson 02's runs, and what the CLI and benchmarks/data_parallel.py time: a training loop
over every data-parallel implementation (same model and data), step times over simulated
links, and the overlap exercise (the rule that starts buckets during backward)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Algorithm, SimulatedLink, simulated_link
from parcourse.data import local_regression, regression
from parcourse.data_parallel.base import GradSyncModule
from parcourse.data_parallel.bucketed import BucketedDataParallel
from parcourse.data_parallel.naive import NaiveDataParallel
from parcourse.experiments.exercises import ask, whole_numbers
from parcourse.experiments.timing import Name, take_turns
from parcourse.launch import RankContext
from parcourse.models import mlp

Impl = Literal["naive", "bucketed", "torch"]
IMPLS: tuple[str, ...] = ("naive", "bucketed", "torch")


def wrap(
    model: nn.Module,
    impl: str,
    ctx: RankContext,
    *,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    link: SimulatedLink | None = None,
    traced: bool = False,
) -> GradSyncModule | nn.parallel.DistributedDataParallel:
    """The model under one of the data-parallel implementations."""
    tracer = ctx.tracer if traced else None
    algorithm: Algorithm = "ring" if link is not None else "torch"
    if impl == "naive":
        return NaiveDataParallel(model, ctx.group, algorithm=algorithm, link=link, tracer=tracer)
    if impl == "bucketed":
        return BucketedDataParallel(
            model,
            ctx.group,
            bucket_mb=bucket_mb,
            overlap=overlap,
            algorithm=algorithm,
            link=link,
            tracer=tracer,
        )
    if impl == "torch":
        if link is not None:
            raise ValueError("torch's DDP cannot use the simulated link; use naive or bucketed")
        return nn.parallel.DistributedDataParallel(
            model, process_group=ctx.group, bucket_cap_mb=bucket_mb
        )
    raise ValueError(f"unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")


def train_steps(
    ctx: RankContext,
    impl: str,
    steps: int = 5,
    *,
    width: int = 256,
    depth: int = 6,
    batch: int = 64,
    bucket_mb: float = 25.0,
    overlap: bool = True,
    latency_us: float = 0.0,
    bandwidth_gbps: float | None = None,
    traced: bool = True,
    lr: float = 0.01,
) -> dict[str, Any]:
    """`steps` Adam steps of an MLP on this rank's shard of a synthetic batch.

    Returns per-step seconds (barrier-aligned, slowest-rank comparable), losses
    and the model size. With `traced`, forward / backward / optimizer spans and
    each bucket's all-reduce land in the run's trace.
    """
    link = simulated_link(latency_us, bandwidth_gbps)
    ctx.tracer.set_status("building the model")
    model = mlp(width, width, width, depth=depth).to(ctx.device)
    ddp = wrap(model, impl, ctx, bucket_mb=bucket_mb, overlap=overlap, link=link, traced=traced)
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    tracer = ctx.tracer
    times, losses = [], []
    for step in range(steps):
        dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        with tracer.span("forward", step=step) if traced else nullcontext():
            loss = nn.functional.mse_loss(ddp(x), y)
        if impl == "torch" and traced:
            with tracer.span("backward (DDP inside)", step=step):
                loss.backward()
        else:
            loss.backward()  # our wrappers trace backward and each bucket themselves
        with tracer.span("optimizer", step=step) if traced else nullcontext():
            opt.step()
            opt.zero_grad(set_to_none=True)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    return {"step_s": times, "loss": losses, "params": params}


def compare_step_times(
    ctx: RankContext,
    configs: dict[str, dict[str, Any]],
    steps: int = 10,
    *,
    width: int = 512,
    depth: int = 6,
    batch: int = 256,
    latency_us: float = 0.0,
    bandwidth_gbps: float | None = None,
) -> dict[str, list[float]]:
    """Step times of several configurations, alternating step by step in one run.

    `configs` maps a name to `wrap` arguments, e.g. {"ours": {"impl": "bucketed",
    "bucket_mb": 25}, "torch": {"impl": "torch", "bucket_mb": 25}}. Each gets its
    own copy of the same model and optimizer (see `alternate_steps`).
    """
    link = simulated_link(latency_us, bandwidth_gbps)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    runs = {}
    ctx.tracer.set_status("building the models")
    for name, cfg in configs.items():
        model = mlp(width, width, width, depth=depth).to(ctx.device)
        ddp = wrap(model, ctx=ctx, link=link if cfg["impl"] != "torch" else None, **cfg)
        runs[name] = (ddp, torch.optim.Adam(ddp.parameters(), lr=0.01))
    return alternate_steps(ctx, runs, x, y, steps)


def alternate_steps(
    ctx: RankContext,
    runs: Mapping[Name, tuple[Any, Any]],
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
) -> dict[Name, list[float]]:
    """Seconds per training step of each (model, optimizer) on (x, y), taking turns step
    by step (`timing.take_turns`); the first step of each is a warm-up, not returned."""

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        def run(_: int) -> None:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    return take_turns(
        ctx.group, {name: step(*pair) for name, pair in runs.items()}, steps, device=x.device
    )


def final_weights(
    ctx: RankContext,
    impl: str,
    steps: int = 5,
    *,
    width: int = 32,
    depth: int = 3,
    batch: int = 64,
    bucket_mb: float = 0.01,
) -> dict[str, torch.Tensor]:
    """Weights after `steps` Adam steps under data parallelism (to compare with one process)."""
    model = mlp(width, width, width, depth=depth)
    ddp = wrap(model, impl, ctx, bucket_mb=bucket_mb)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    for _ in range(steps):
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_process_weights(
    steps: int = 5, *, width: int = 32, depth: int = 3, batch: int = 64
) -> dict[str, torch.Tensor]:
    """The same training in one process on the whole batch."""
    model = mlp(width, width, width, depth=depth)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = regression(batch, width, width)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def backward_in_microsteps(
    module: GradSyncModule | nn.parallel.DistributedDataParallel,
    x: torch.Tensor,
    y: torch.Tensor,
    microsteps: int,
) -> None:
    """Accumulate the gradient of one batch over `microsteps` backward passes; all
    but the last run under the module's no_sync(), so gradients are synchronised once."""
    for i, (xm, ym) in enumerate(zip(x.chunk(microsteps), y.chunk(microsteps))):
        loss = nn.functional.mse_loss(module(xm), ym) / microsteps
        with module.no_sync() if i < microsteps - 1 else nullcontext():
            loss.backward()


def accumulated_gradients(
    ctx: RankContext, impl: str, microsteps: int, *, width: int = 32, batch: int = 64
) -> list[torch.Tensor]:
    """Gradients after `microsteps` backward passes, all but the last under no_sync()."""
    model = mlp(width, width, width, depth=3)
    ddp = wrap(model, impl, ctx, bucket_mb=0.01)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    backward_in_microsteps(ddp, x, y, microsteps)
    grads = []
    for p in model.parameters():
        assert p.grad is not None  # every weight of the MLP is on the loss's path
        grads.append(p.grad.clone())
    return grads


_LAUNCH_CASES = [
    ([[5, 4], [3, 2], [1, 0]], [5, 4, 3, 2, 1, 0], "backward, last layer first"),
    ([[5, 4, 3], [2, 1, 0]], [5, 3, 4, 1, 2, 0], "arrivals out of order inside buckets"),
    ([[5, 4], [3, 2], [1, 0]], [3, 2, 1, 0, 5, 4], "the first bucket's gradients arrive last"),
    ([[3], [2], [1], [0]], [3, 2, 1, 0], "one parameter per bucket"),
]


def data_parallel_steps(
    ctx: RankContext,
    configs: Mapping[str, Mapping[str, Any]],
    links: Mapping[str, SimulatedLink | None],
    steps: int = 4,
    *,
    width: int = 256,
    depth: int = 6,
    batch: int = 256,
) -> dict[tuple[str, str], list[float]]:
    """Seconds per training step of each (configuration, link), all alternating step by
    step (`alternate_steps`), so that they can be compared with each other.

    `configs` maps a name to `training.wrap` arguments ("torch" takes no link), or to
    {"impl": "none"}: the model alone, each rank training on its slice without any
    communication (what the compute costs, timed alongside). `links` maps a name to
    a link, e.g. {"link": SimulatedLink.of(500, 0.2), "free": SimulatedLink()}: a
    free link runs the same code and adds no time.
    """
    from parcourse.data import local_regression
    from parcourse.models import mlp

    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    runs = {}
    ctx.tracer.set_status("building the models")
    for name, cfg in configs.items():
        for link_name, link in links.items():
            model = mlp(width, width, width, depth=depth).to(ctx.device)
            ddp = model if cfg["impl"] == "none" else wrap(model, ctx=ctx, link=link, **cfg)
            runs[name, link_name] = (ddp, torch.optim.Adam(ddp.parameters(), lr=0.01))
    return alternate_steps(ctx, runs, x, y, steps)


LaunchRule = Callable[[set[int], list[list[int]], int, Callable[[int], None]], int]


def _launches(
    rule: LaunchRule, buckets: list[list[int]], order: list[int]
) -> list[tuple[int, int]]:
    """Feed gradients to `rule` in `order`; return (gradients arrived, bucket) per launch."""
    launched: list[tuple[int, int]] = []
    ready: set[int] = set()
    next_bucket = 0
    for param in order:
        ready.add(param)
        next_bucket = rule(ready, buckets, next_bucket, lambda k: launched.append((len(ready), k)))
    return launched


def launch_ready_buckets(
    ready: set[int], buckets: list[list[int]], next_bucket: int, launch: Callable[[int], None]
) -> int:
    """The rule BucketedDataParallel follows when a gradient arrives: start every bucket
    from `next_bucket` on whose gradients have all arrived, in order, stopping at the
    first that is not complete (every rank must start the same buckets in the same
    order); return the first bucket not started."""
    while next_bucket < len(buckets) and all(i in ready for i in buckets[next_bucket]):
        launch(next_bucket)
        next_bucket += 1
    return next_bucket


class _NotAnIndex(BaseException):
    """A launch rule's answer that is not a bucket's index (BaseException: `ask` lets it
    through, since it is not the learner's code that raised)."""


def check_launch_rule(rule: LaunchRule) -> bool:
    """Exercise check for lesson 02: does `rule(ready, buckets, next_bucket, launch)`
    start each bucket as soon as it may, in order, once? Prints what it found
    (expected, got and a hint when wrong); True only when every case matches."""
    returned: list[Any] = []

    def recorded(*args: Any) -> int:  # stops at an answer that is not a bucket's index
        returned.append(rule(*args))
        if isinstance(returned[-1], bool) or not isinstance(returned[-1], int):
            raise _NotAnIndex
        return returned[-1]

    for buckets, order, why in _LAUNCH_CASES:
        expected = _launches(launch_ready_buckets, buckets, order)
        try:
            answered, got = ask(_launches, recorded, buckets, order)
        except _NotAnIndex:
            print(
                f"Not quite: your rule returned {returned[-1]!r}"
                f"{' (is a return missing?)' if returned[-1] is None else ''}; it must "
                "return the first bucket not started yet, a whole number."
            )
            return False
        if not answered:
            return False
        if got != expected:
            show = "; ".join(f"bucket {k} after {n}" for n, k in expected)
            mine = "; ".join(f"bucket {k} after {n}" for n, k in got) or "nothing"
            print(
                f"Not quite ({why}: buckets {buckets}, gradients arriving {order}): "
                f"expected {show}; got {mine}. Hint: start buckets strictly in order, each "
                "as soon as all its gradients are in, and keep going while the next one "
                "is complete too."
            )
            return False
    print(f"Correct: every bucket starts as soon as it may, in order ({len(_LAUNCH_CASES)} cases).")
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
        answered, got = ask(fn, [p.numel() * 4 for p in params], limit)
        if not answered:
            return False
        try:
            got = [whole_numbers(group) for group in got]
        except TypeError:  # not a list of anything
            got = None
        if got is None or None in got:
            print(
                "expected a list of buckets, each a list (or tuple) of parameter indices, "
                f"e.g. {expected}"
            )
            return False
        if got != expected:
            print(
                f"Not quite (sizes {[p.numel() * 4 for p in params]}, limit {limit}): "
                f"expected {expected}, got {got}. Hint: walk the parameters from the last "
                "to the first, and start a new bucket when the next one would not fit."
            )
            return False
    print("Correct: same buckets as BucketedDataParallel.")
    return True


class RuledDataParallel(BucketedDataParallel):
    """BucketedDataParallel whose buckets start by a rule given as a function (lesson
    02's exercise): `rule(ready, buckets, next_bucket, launch)` as
    `launch_ready_buckets`, with parameters and buckets as indices."""

    def __init__(
        self,
        module: torch.nn.Module,
        group: dist.ProcessGroup | None,
        rule: LaunchRule,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, group, **kwargs)
        self.rule = rule
        self._index = {id(p): i for i, p in enumerate(self.sync_params)}
        self._indices = [[self._index[id(p)] for p in b.params] for b in self.buckets]
        self._ready: set[int] = set()

    def grad_ready(self, param: torch.Tensor) -> None:
        self._bucket_of[id(param)].ready.add(id(param))
        self._ready.add(self._index[id(param)])
        self._next = self.rule(
            self._ready, self._indices, self._next, lambda k: self._launch(self.buckets[k])
        )

    def finish_gradient_sync(self) -> None:
        super().finish_gradient_sync()
        self._ready.clear()


def train_with_rule(
    ctx: RankContext,
    rule: LaunchRule | str | None,
    steps: int = 3,
    *,
    width: int = 256,
    depth: int = 6,
    batch: int = 256,
    bucket_mb: float = 1.0,
    latency_us: float = 0.0,
    bandwidth_gbps: float | None = None,
) -> list[float]:
    """Traced training steps with buckets started by `rule` (None: only after backward,
    no overlap; "library": `BucketedDataParallel`'s own rule); returns seconds per step,
    the first one (warm-up) left out."""
    from parcourse.data import local_regression
    from parcourse.models import mlp

    link = simulated_link(latency_us, bandwidth_gbps)
    algorithm: Algorithm = "ring" if link is not None else "torch"
    ctx.tracer.set_status("building the model")
    model = mlp(width, width, width, depth=depth).to(ctx.device)
    kwargs: dict[str, Any] = {
        "bucket_mb": bucket_mb,
        "algorithm": algorithm,
        "link": link,
        "tracer": ctx.tracer,
    }
    if rule is None or rule == "library":
        ddp = BucketedDataParallel(model, ctx.group, overlap=rule == "library", **kwargs)
    elif callable(rule):
        ddp = RuledDataParallel(model, ctx.group, rule, **kwargs)
    else:
        raise ValueError(f"rule: a function, None or 'library', got {rule!r}")
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
