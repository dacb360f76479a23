"""Lesson 02's parameter servers: synchronous (BSP) and asynchronous (ASP) SGD of a small
MLP on synthetic data, built and trained here (a lesson run, so it lives in experiments/,
not in the data_parallel strategies).

Rank 0 is the server: it holds the weights and applies updates. Every other rank
is a worker with its own shard of the data: it pulls the weights, computes a
gradient, pushes it back.

- BSP (bulk synchronous): each update waits for every worker's gradient and
  applies their average. Nobody uses stale weights; everybody waits for the
  slowest worker.
- ASP (asynchronous): the server applies each gradient the moment it arrives and
  sends that worker fresh weights. Nobody waits, but a gradient was computed on
  weights that are `staleness` updates old, and with more workers it gets
  staler (Dean et al. 2012, Downpour SGD; Chen et al. 2016, "Revisiting
  distributed synchronous SGD"). This is why synchronous all-reduce won.

Messages are point-to-point (send/recv); a weight message carries the version
it was taken at, a gradient the version it was computed on.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from parcourse.data import regression, shard
from parcourse.launch import RankContext
from parcourse.models import mlp

Mode = Literal["bsp", "asp"]
_STOP = -1.0


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    _loss(model, x, y).backward()
    grads = []
    for p in model.parameters():
        assert p.grad is not None  # every weight of the MLP is on the loss's path
        grads.append(p.grad)
    return parameters_to_vector(grads)


def parameter_server_training(
    ctx: RankContext,
    mode: Mode,
    updates: int = 20,
    *,
    lr: float = 0.1,
    d: int = 16,
    hidden: int = 32,
    samples: int = 256,
    straggler_ms: float = 0.0,
) -> dict[str, Any] | None:
    """Train an MLP by gradient descent through a parameter server on rank 0.

    BSP makes `updates` updates of N-1 averaged gradients; ASP applies the same
    number of gradients, (N-1) x updates, one at a time, each with lr / (N-1). Worker 1 sleeps
    `straggler_ms` per gradient (a slow machine). The server returns the loss on
    all the data after every gradient applied, the staleness of each, times, and the
    weights at the end (as one vector, in `parameters()` order).
    """
    if ctx.world_size < 2:
        raise ValueError("a parameter server needs at least 2 ranks: a server and a worker")
    if mode not in ("bsp", "asp"):
        raise ValueError(f"unknown mode {mode!r}; choose 'bsp' or 'asp'")
    model = mlp(d, hidden, d, depth=2)
    x, y = regression(samples, d, d)
    workers = ctx.world_size - 1
    if ctx.rank == 0:
        return _serve(ctx, mode, model, x, y, updates, lr, workers)
    xs = shard(x, ctx.rank - 1, workers)
    ys = shard(y, ctx.rank - 1, workers)
    _work(model, xs, ys, straggler_ms if ctx.rank == 1 else 0.0, ctx)
    return None


def _serve(
    ctx: RankContext,
    mode: str,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    updates: int,
    lr: float,
    workers: int,
) -> dict[str, Any]:
    weights = parameters_to_vector(model.parameters()).detach()
    n = weights.numel()
    version = 0
    losses, staleness, times = [], [], []
    start = time.perf_counter()

    def push(rank: int, stop: bool = False) -> None:
        tag = _STOP if stop else float(version)
        dist.send(torch.cat([weights, torch.tensor([tag])]), rank, ctx.group)

    def record(stale: int) -> None:
        vector_to_parameters(weights, model.parameters())
        with torch.no_grad():
            losses.append(_loss(model, x, y).item())
        staleness.append(stale)
        times.append(time.perf_counter() - start)

    incoming = torch.empty(n + 1)
    total = updates * workers  # gradients to apply, in both modes
    if mode == "bsp":
        for _ in range(updates):
            for w in range(1, workers + 1):
                push(w)
            grads = []
            for w in range(1, workers + 1):
                with ctx.tracer.span("wait for gradient", kind="idle", worker=w):
                    dist.recv(incoming, w, ctx.group)
                grads.append(incoming[:n].clone())
            weights -= lr * torch.stack(grads).mean(0)
            version += 1
            for _ in range(workers):  # the x-axis counts gradients in both modes
                record(0)
        for w in range(1, workers + 1):
            push(w, stop=True)
    else:
        for w in range(1, workers + 1):
            push(w)
        issued, applied = workers, 0
        while applied < total:
            with ctx.tracer.span("wait for gradient", kind="idle"):
                sender = dist.recv(incoming, None, ctx.group)  # whoever is first
            # lr / workers: N-1 gradients move the weights as far as one BSP update, so
            # the two differ only in staleness.
            weights -= lr / workers * incoming[:n]
            record(version - int(incoming[n].item()))  # updates since that worker pulled
            version += 1
            applied += 1
            if issued < total:
                push(sender)
                issued += 1
            else:
                push(sender, stop=True)
    return {
        "loss": losses,
        "staleness": staleness,
        "time_s": times,
        "workers": workers,
        "weights": weights.clone(),
    }


def _work(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, delay_ms: float, ctx: RankContext
) -> None:
    n = sum(p.numel() for p in model.parameters())
    incoming = torch.empty(n + 1)
    while True:
        with ctx.tracer.span("pull weights", kind="comm"):
            dist.recv(incoming, 0, ctx.group)
        version = incoming[n].item()
        if version == _STOP:
            return
        vector_to_parameters(incoming[:n], model.parameters())
        with ctx.tracer.span("gradient", kind="compute"):
            if delay_ms:
                time.sleep(delay_ms / 1e3)
            grad = _gradient(model, x, y)
        with ctx.tracer.span("push gradient", kind="comm"):
            dist.send(torch.cat([grad, torch.tensor([version])]), 0, ctx.group)
