"""Models and rank functions for the data-parallel tests."""

import torch
from torch import nn

from parcourse.data import shard
from parcourse.data_parallel import BucketedDataParallel, NaiveDataParallel


class Net(nn.Module):
    """Odd shapes (7 -> 13 -> 5), plus the cases DDP must handle: a frozen layer,
    a branch some steps or ranks do not use, weights tied between two layers."""

    def __init__(self, kind="plain"):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.inp = nn.Linear(7, 13)
        self.hidden = nn.Linear(13, 13)
        self.out = nn.Linear(13, 5)
        self.branch = nn.Linear(13, 5)
        if kind == "frozen":
            self.hidden.requires_grad_(False)
        if kind == "tied":
            self.extra = nn.Linear(13, 13, bias=False)
            self.extra.weight = self.hidden.weight

    def forward(self, x, use_branch=False):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h))
        if self.kind == "tied":
            h = torch.tanh(self.extra(h))
        y = self.out(h)
        if use_branch:
            y = y + self.branch(h)
        return y


def uses_branch(kind, rank, step):
    """unused: never; partly: rank 1 only, on even steps; otherwise never."""
    return kind == "partly" and rank == 1 and step % 2 == 0


def data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 7, generator=g), torch.randn(batch, 5, generator=g)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference(kind, opt_name, steps, batch, world_size):
    """One process: per step, the average over ranks' shard losses, one backward."""
    model = Net("plain" if kind in ("unused", "partly") else kind)
    opt = make_optimizer(opt_name, [p for p in model.parameters() if p.requires_grad])
    x, y = data(batch)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(world_size):
            out = model(shard(x, r, world_size), use_branch=uses_branch(kind, r, step))
            total = total + nn.functional.mse_loss(out, shard(y, r, world_size))
        (total / world_size).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(ctx, impl, kind, opt_name, steps, batch, bucket_mb=0.0005):
    model = Net("plain" if kind in ("unused", "partly") else kind)
    if ctx.rank != 0:  # the wrapper must broadcast rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    if impl == "naive":
        ddp = NaiveDataParallel(model, ctx.group)
    else:
        ddp = BucketedDataParallel(
            model,
            ctx.group,
            bucket_mb=bucket_mb,
            overlap=impl != "bucketed-no-overlap",
            algorithm="ring" if impl == "bucketed-ring" else "torch",
        )
    opt = make_optimizer(opt_name, [p for p in ddp.parameters() if p.requires_grad])
    x, y = data(batch)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = ddp(x, use_branch=uses_branch(kind, ctx.rank, step))
        nn.functional.mse_loss(out, y).backward()
        ddp.finish_gradient_sync()  # a no-op: backward already did it
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def grads_vs_torch_ddp(ctx, impl, batch):
    """The same model and data through torch DDP and through ours: same gradients."""
    ours_model, theirs_model = Net(), Net()
    theirs = nn.parallel.DistributedDataParallel(
        theirs_model, process_group=ctx.group, find_unused_parameters=True
    )
    ours = (
        NaiveDataParallel(ours_model, ctx.group)
        if impl == "naive"
        else BucketedDataParallel(ours_model, ctx.group, bucket_mb=0.0005)
    )
    x, y = data(batch, seed=ctx.rank + 7)  # different data on every rank
    for model in (theirs, ours):
        nn.functional.mse_loss(model(x), y).backward()
    return [(a.grad, b.grad) for a, b in zip(ours_model.parameters(), theirs_model.parameters())]


def traced_step(ctx, overlap, latency_us=2000.0):
    """A deep MLP, small buckets and a slow simulated link: does comm overlap backward?"""
    from parcourse.comm import SimulatedLink
    from parcourse.models import mlp

    model = mlp(64, 256, 64, depth=8)
    ddp = BucketedDataParallel(
        model,
        ctx.group,
        bucket_mb=0.3,
        overlap=overlap,
        algorithm="ring",
        link=SimulatedLink(latency_us * 1e-6),
        tracer=ctx.tracer,
    )
    x = torch.randn(256, 64)
    for _ in range(2):
        ddp(x).square().mean().backward()
    return len(ddp.buckets)


class BatchNormNet(nn.Module):
    """A BatchNorm between two layers: running statistics that each rank updates from
    its own rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bn, self.out = nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x))))


def buffers_after_training(ctx, impl, steps=3):
    """Three SGD steps of BatchNormNet under `impl` (ours, or torch's DDP), then an
    evaluation forward: the state (buffers included) and the evaluation's output."""
    from torch.nn.parallel import DistributedDataParallel

    net = BatchNormNet()
    wrap = {
        "naive": NaiveDataParallel,
        "bucketed": BucketedDataParallel,
        "torch": lambda m, g: DistributedDataParallel(m, process_group=g),
    }[impl]
    model = wrap(net, ctx.group)
    x, y = data(16)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(data(4, seed=5)[0])
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, out
