"""A training loop for measuring data parallelism: the rank function lessons, the
CLI and the benchmark run. Same model and data on every implementation."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from parcourse.collectives import SimulatedLink, simulated_link
from parcourse.data import local_regression, regression
from parcourse.data_parallel.bucketed import BucketedDataParallel
from parcourse.data_parallel.naive import NaiveDataParallel
from parcourse.launch import RankContext
from parcourse.models import mlp

Impl = Literal["naive", "bucketed", "torch"]
IMPLS: tuple[str, ...] = ("naive", "bucketed", "torch")


def wrap(model: nn.Module, impl: str, ctx: RankContext, *, bucket_mb: float = 25.0,
         overlap: bool = True, link: SimulatedLink | None = None,
         traced: bool = False) -> nn.Module:
    """The model under one of the data-parallel implementations."""
    tracer = ctx.tracer if traced else None
    algorithm = "ring" if link is not None else "torch"
    if impl == "naive":
        return NaiveDataParallel(model, ctx.group, algorithm=algorithm, link=link, tracer=tracer)
    if impl == "bucketed":
        return BucketedDataParallel(model, ctx.group, bucket_mb=bucket_mb, overlap=overlap,
                                    algorithm=algorithm, link=link, tracer=tracer)
    if impl == "torch":
        if link is not None:
            raise ValueError("torch's DDP cannot use the simulated link; use naive or bucketed")
        return nn.parallel.DistributedDataParallel(model, process_group=ctx.group,
                                                   bucket_cap_mb=bucket_mb)
    raise ValueError(f"unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")


def train_steps(ctx: RankContext, impl: str, steps: int = 5, *, width: int = 256,
                depth: int = 6, batch: int = 64, bucket_mb: float = 25.0,
                overlap: bool = True, latency_us: float = 0.0,
                bandwidth_gbps: float | None = None, traced: bool = True,
                lr: float = 0.01) -> dict[str, Any]:
    """`steps` Adam steps of an MLP on this rank's shard of a synthetic batch.

    Returns per-step seconds (barrier-aligned, slowest-rank comparable), losses
    and the model size. With `traced`, forward / backward / optimizer spans and
    each bucket's all-reduce land in the run's trace.
    """
    link = simulated_link(latency_us, bandwidth_gbps)
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


def compare_step_times(ctx: RankContext, configs: dict[str, dict[str, Any]], steps: int = 10, *,
                       width: int = 512, depth: int = 6, batch: int = 256,
                       latency_us: float = 0.0,
                       bandwidth_gbps: float | None = None) -> dict[str, list[float]]:
    """Step times of several configurations, alternating step by step in one run.

    `configs` maps a name to `wrap` arguments, e.g. {"ours": {"impl": "bucketed",
    "bucket_mb": 25}, "torch": {"impl": "torch", "bucket_mb": 25}}. Each gets its
    own copy of the same model and optimizer (see `alternate_steps`).
    """
    link = simulated_link(latency_us, bandwidth_gbps)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    runs = {}
    for name, cfg in configs.items():
        model = mlp(width, width, width, depth=depth).to(ctx.device)
        ddp = wrap(model, ctx=ctx, link=link if cfg["impl"] != "torch" else None, **cfg)
        runs[name] = (ddp, torch.optim.Adam(ddp.parameters(), lr=0.01))
    return alternate_steps(ctx, runs, x, y, steps)


def alternate_steps(ctx: RankContext, runs: dict[str, tuple[Any, Any]], x: torch.Tensor,
                    y: torch.Tensor, steps: int) -> dict[str, list[float]]:
    """Seconds per training step of each (model, optimizer), alternating step by step.

    The order swaps every step, so that no configuration always runs right after
    the barrier; the first step of each is a warm-up and is not returned.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for step in range(steps + 1):
        for name in names if step % 2 == 0 else names[::-1]:
            model, opt = runs[name]
            dist.barrier(group=ctx.group)
            t0 = time.perf_counter()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if x.is_cuda:
                torch.cuda.synchronize()
            if step:
                times[name].append(time.perf_counter() - t0)
    return times


def final_weights(ctx: RankContext, impl: str, steps: int = 5, *, width: int = 32,
                  depth: int = 3, batch: int = 64, bucket_mb: float = 0.01
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


def one_process_weights(steps: int = 5, *, width: int = 32, depth: int = 3,
                        batch: int = 64) -> dict[str, torch.Tensor]:
    """The same training in one process on the whole batch."""
    model = mlp(width, width, width, depth=depth)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = regression(batch, width, width)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def backward_in_microsteps(module: nn.Module, x: torch.Tensor, y: torch.Tensor,
                           microsteps: int) -> None:
    """Accumulate the gradient of one batch over `microsteps` backward passes; all
    but the last run under the module's no_sync(), so gradients are synchronised once."""
    for i, (xm, ym) in enumerate(zip(x.chunk(microsteps), y.chunk(microsteps))):
        loss = nn.functional.mse_loss(module(xm), ym) / microsteps
        with module.no_sync() if i < microsteps - 1 else nullcontext():
            loss.backward()


def accumulated_gradients(ctx: RankContext, impl: str, microsteps: int, *, width: int = 32,
                          batch: int = 64) -> list[torch.Tensor]:
    """Gradients after `microsteps` backward passes, all but the last under no_sync()."""
    model = mlp(width, width, width, depth=3)
    ddp = wrap(model, impl, ctx, bucket_mb=0.01)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    backward_in_microsteps(ddp, x, y, microsteps)
    return [p.grad.clone() for p in model.parameters()]
