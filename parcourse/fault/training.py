"""The training loop of one fault-tolerant replica, for any model: what the tests, the
benchmark and lesson 13 run under `run_replicas`.

`make()` builds the model and its optimizer (seeded: every replica starts alike),
`batch(step, replica)` the replica's rows at a step, `loss_fn(model, x, y)` the mean loss.
The gradient's divisor is the quorum's size, so the step averages over the rows of the
replicas that took part, whoever was lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parcourse.fault.replica import FaultTolerant
from parcourse.fault.run import ReplicaContext

Make = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def train_replica(
    ctx: ReplicaContext,
    make: Make,
    batch: Batch,
    steps: int,
    loss_fn: LossFn | None = None,  # None: mean squared error
    bucket_mb: float = 25.0,
    timeout: float = 10.0,
    lr: Callable[[int], float] | None = None,
    clip: float | None = None,
) -> dict[str, Any]:
    """`steps` committed steps on this replica; its history (one entry a committed step:
    the loss, the quorum's members, when it committed), the quorums, transfers and broken
    all-reduces it saw, and its final weights and optimizer state. `lr(step)`: the
    learning rate of each step; `clip`: the averaged gradients' norm is clipped to it
    (the same on every replica, as the gradients are)."""
    model, optimizer = make()
    ft = FaultTolerant(
        model,
        optimizer,
        ctx.store,
        ctx.replica,
        bucket_mb,
        timeout,
        ctx.host,
        before_send=lambda: ctx.maybe_die("heal"),
    )
    history: list[dict[str, Any]] = []
    trained: dict[str, Any] | None = None  # the step waiting for its commit
    while True:
        q = ft.start_step()
        if trained is not None and q.commit:
            history.append({**trained, "committed_at": q.at})
        trained = None
        if ft.step >= steps:
            break
        step = ft.step
        x, y = batch(step, ctx.replica)
        loss = (loss_fn or mse)(model, x, y)
        loss.backward()
        ctx.maybe_die(step)  # a fault on purpose: mid-step, after backward
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr(step)  # applied at the commit, in the next start_step
        if ft.sync():
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            trained = {"step": step, "loss": loss.item(), "members": q.members, "at": time.time()}
    ft.finish()
    return {
        "history": history,
        "quorums": [q.__dict__ for q in ft.quorums],
        "healed": [h.__dict__ for h in ft.healed],
        "failures": ft.failures,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "steps": ft.step,
        "incarnation": ctx.incarnation,
    }
