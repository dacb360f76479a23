"""Rank functions for the tests of gradients in fewer bits (parcourse.data_parallel.compress)."""

import torch
from dp_fns import Net, data, make_optimizer
from torch import nn

from parcourse.comm import Comm
from parcourse.data import shard
from parcourse.data_parallel import BucketedDataParallel
from parcourse.data_parallel import compress as C


def hooked(
    ctx,
    hook_name,
    steps,
    batch,
    kind="plain",
    algorithm="torch",
    opt_name="adam",
    bucket_mb=0.0005,
    **options,
):
    """Net trained under BucketedDataParallel with a communication hook; its weights."""
    model = Net("plain" if kind in ("unused", "partly") else kind)
    ddp = BucketedDataParallel(model, ctx.group, bucket_mb=bucket_mb, algorithm=algorithm)
    comm = Comm(ctx.group, algorithm=algorithm)
    if hook_name == "torch-allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(ctx.group, default_hooks.allreduce_hook)
    elif hook_name == "powersgd":
        ddp.register_comm_hook(C.PowerSGDState(comm, **options), C.powerSGD_hook)
    elif hook_name != "none":
        ddp.register_comm_hook(C.LowPrecision(comm, hook_name, **options), C.low_precision_hook)
    opt = make_optimizer(opt_name, ddp.parameters())
    x, y = data(batch)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        use = kind == "partly" and ctx.rank == 1 and step % 2 == 0
        nn.functional.mse_loss(ddp(x, use_branch=use), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def torch_ddp_with_hook(ctx, hook_name, steps, batch):
    """The same run through torch's DDP and torch's hook, for comparison."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = Net()
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=ctx.group, find_unused_parameters=True
    )
    ddp.register_comm_hook(ctx.group, getattr(default_hooks, hook_name))
    opt = make_optimizer("adam", ddp.parameters())
    x, y = data(batch)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ours_with_torch_hook(ctx, hook_name, steps, batch):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = Net()
    ddp = BucketedDataParallel(model, ctx.group)  # one bucket, as DDP's first iteration
    ddp.register_comm_hook(ctx.group, getattr(default_hooks, hook_name))
    opt = make_optimizer("adam", ddp.parameters())
    x, y = data(batch)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_grads(rank, step, shapes):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(*s, generator=g) for s in shapes]


def powersgd_feedback(ctx, shapes, steps, rank, low_rank=False):
    """PowerSGD's hook by hand on one bucket of random gradients: what it applied each
    step, the true averages, and the ranks' errors left at the end."""
    import torch.distributed as dist

    params = [nn.Parameter(torch.zeros(*s)) for s in shapes]
    state = C.PowerSGDState(Comm(ctx.group), matrix_approximation_rank=rank, start_powerSGD_iter=0)
    applied = torch.zeros(sum(p.numel() for p in params))
    exact = torch.zeros_like(applied)
    for step in range(steps):
        grads = local_grads(ctx.rank, step, shapes)
        if low_rank:  # every rank's a multiple of the same rank-1 matrices
            grads = [
                torch.outer(*local_grads(0, step, [(s[0],), (s[1],)])) * (ctx.rank + 1)
                for s in shapes
            ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        true = flat.clone()
        dist.all_reduce(true, group=ctx.group)
        exact += true / ctx.world_size
        buffer = flat.clone()
        applied += C.powerSGD_hook(state, C.GradBucket(0, buffer, params, True)).wait()
    error = state.errors[0].clone()
    dist.all_reduce(error, group=ctx.group)
    return applied, exact, error / ctx.world_size


def wire_bytes_measured(ctx, fmt, numel, block=128):
    """One bucket of `numel` random gradients averaged through the course's ring with a
    tracer: the bytes this rank's messages carried, and the result against the exact
    average (the largest difference and the largest magnitude)."""
    import torch.distributed as dist

    comm = Comm(ctx.group, algorithm="ring", tracer=ctx.tracer)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(numel, generator=g)
    exact = x.clone()
    dist.all_reduce(exact, group=ctx.group)
    exact /= ctx.world_size
    p = nn.Parameter(torch.zeros(numel))
    if fmt == "fp32":
        got = comm.all_reduce(x.clone()) / ctx.world_size
    else:
        state = C.LowPrecision(comm, fmt, block)
        got = C.low_precision_hook(state, C.GradBucket(0, x.clone(), [p], True)).wait()
    sent = ctx.tracer.total("bytes_sent")
    return sent, float((got - exact).abs().max()), float(exact.abs().max())


def measured_errors(ctx, fmt, steps):
    """Net trained with a hook under `Measured`: its per-step error against fp32."""
    model = Net()
    ddp = BucketedDataParallel(model, ctx.group, bucket_mb=0.0005)
    comm = Comm(ctx.group)
    measured = C.Measured(C.LowPrecision(comm, fmt), C.low_precision_hook, ctx.group)
    ddp.register_comm_hook(measured, C.measured_hook)
    opt = make_optimizer("adam", ddp.parameters())
    x, y = data(16)
    x, y = shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return measured.errors


def misuse(ctx, what):
    model = Net()
    ddp = BucketedDataParallel(model, ctx.group)
    x, y = data(8)
    if what == "twice":
        ddp.register_comm_hook(ctx.group, lambda s, b: None)
        ddp.register_comm_hook(ctx.group, lambda s, b: None)
    elif what == "late":
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp.register_comm_hook(ctx.group, C.low_precision_hook)
    elif what == "no future":
        ddp.register_comm_hook(ctx.group, lambda s, b: b.buffer())
        nn.functional.mse_loss(ddp(x), y).backward()
