"""The model, rows and references of the fault-tolerance tests."""

import time

import torch
from torch import nn

ROWS = 5  # each replica's rows a step


def make(opt="adamw"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    if opt == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt == "sgd-plain":
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def make_sgd():
    return make("sgd")


def batch(step, replica):
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(ROWS, 7, generator=g)
    return x, torch.tanh(x[:, :5]) + 0.1 * torch.randn(ROWS, 5, generator=g)


def slow_batch(step, replica):
    """Steps of 20 ms, so that a replacement started after a death joins well before
    the end."""
    time.sleep(0.02)
    return batch(step, replica)


def one_process(steps, members_at, make_fn=make):
    """One process on the rows of the replicas `members_at(step)` each step."""
    model, opt = make_fn()
    for step in range(steps):
        rows = [batch(step, r) for r in members_at(step)]
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def bucketed(ctx, steps, bucket_mb):
    """The same training under `BucketedDataParallel` (one rank a replica)."""
    from parcourse.data_parallel import BucketedDataParallel

    model, opt = make()
    dp = BucketedDataParallel(model, ctx.group, bucket_mb=bucket_mb)
    for step in range(steps):
        x, y = batch(step, ctx.rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(dp(x), y).backward()
        dp.finish_gradient_sync()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def sharded(ctx):
    """FaultTolerant around ZeroRedundancyOptimizer: the one-line refusal."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from parcourse.fault import FaultTolerant

    model, _ = make()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    store = torch.distributed.HashStore()
    store.set("round", "0")
    try:
        FaultTolerant(model, opt, store, ctx.rank)
    except ValueError as e:
        return str(e)
    return None


def local(ctx, kind, every, steps):
    """Each rank a replica on its own rows, meeting every `every` steps (LocalSGD or
    DiLoCo; inner SGD for LocalSGD, AdamW for DiLoCo)."""
    from parcourse.fault import DiLoCo, LocalSGD

    model, opt = make("sgd-plain" if kind == "local" else "adamw")
    sync = (LocalSGD if kind == "local" else DiLoCo)(model, ctx.group, every)
    for step in range(steps):
        x, y = batch(step, ctx.rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sync.step()
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "bytes": sync.bytes_sent,
    }


def local_reference(kind, every, steps, replicas):
    """The same in one process: the replicas' copies side by side, the meeting by hand
    (DiLoCo's outer step written out: Nesterov momentum, v = m v + g, w0 -= lr (g + m v))."""
    copies = [make("sgd-plain" if kind == "local" else "adamw") for _ in range(replicas)]
    start = [p.detach().clone() for p in copies[0][0].parameters()]
    velocity = [torch.zeros_like(w) for w in start]
    for step in range(steps):
        for r, (model, opt) in enumerate(copies):
            x, y = batch(step, r)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if (step + 1) % every:
            continue
        params = [list(m.parameters()) for m, _ in copies]
        with torch.no_grad():
            for i in range(len(start)):
                mean = sum(ps[i] for ps in params) / replicas
                if kind == "local":
                    new = mean
                else:
                    g = start[i] - mean
                    velocity[i] = 0.9 * velocity[i] + g
                    start[i] = start[i] - 0.7 * (g + 0.9 * velocity[i])
                    new = start[i]
                for ps in params:
                    ps[i].copy_(new)
    return copies[0][0].state_dict()
