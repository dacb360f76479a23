"""Rank functions for the ZeRO tests."""

import io

import torch
from torch import nn

from parcourse import zero
from parcourse.data import shard as shard_rows
from parcourse.data_parallel.training import backward_in_microsteps

from dp_fns import Net, data, make_optimizer


def factory(opt_name):
    return lambda params: make_optimizer(opt_name, params)


def local_batch(ctx, batch):
    """This rank's rows of the shared regression batch."""
    x, y = data(batch)
    return shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)


def fit(model, opt, x, y, steps):
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def train(ctx, stage, opt_name, steps, batch, bucket_mb=0.0005):
    model = Net()
    if ctx.rank != 0:  # ZeRO must broadcast rank 0's weights first
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    zmodel, opt = zero.shard(model, factory(opt_name), stage=stage, group=ctx.group,
                             bucket_mb=bucket_mb)
    fit(zmodel, opt, *local_batch(ctx, batch), steps)
    state_numel = sum(t.numel() for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    return zmodel.full_state_dict(), state_numel


def resume(ctx, stage, steps_before, steps_after, batch):
    """Train, save model + sharded optimizer, rebuild from the checkpoint, go on."""
    x, y = local_batch(ctx, batch)
    zmodel, opt = zero.shard(Net(), factory("adam"), stage=stage, group=ctx.group, bucket_mb=0.0005)
    fit(zmodel, opt, x, y, steps_before)
    checkpoint = io.BytesIO()
    torch.save({"model": zmodel.full_state_dict(), "opt": opt.state_dict()}, checkpoint)
    fit(zmodel, opt, x, y, steps_after)
    uninterrupted = zmodel.full_state_dict()

    checkpoint.seek(0)
    saved = torch.load(checkpoint)
    fresh = Net()
    fresh.load_state_dict(saved["model"])
    zmodel2, opt2 = zero.shard(fresh, factory("adam"), stage=stage, group=ctx.group,
                               bucket_mb=0.0005)
    opt2.load_state_dict(saved["opt"])
    fit(zmodel2, opt2, x, y, steps_after)
    return uninterrupted, zmodel2.full_state_dict()


def drop_in(ctx, opt_name, steps, batch):
    """ZeroOptimizer under our NaiveDataParallel, like ZeroRedundancyOptimizer under DDP."""
    from parcourse.data_parallel import NaiveDataParallel
    from parcourse.zero import ZeroOptimizer

    model = Net()
    ddp = NaiveDataParallel(model, ctx.group)
    cls, kw = (torch.optim.Adam, {"lr": 0.01}) if opt_name == "adam" else \
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    opt = ZeroOptimizer(ddp.parameters(), cls, group=ctx.group, **kw)
    fit(ddp, opt, *local_batch(ctx, batch), steps)
    return {k: v.clone() for k, v in model.state_dict().items()}, opt.local_state_bytes()


def mixed(ctx, stage, steps, batch, dtype):
    """SGD under ZeRO with 16-bit compute; returns fp32 masters and what forward saw."""
    seen = []
    model = Net()
    model.inp.register_forward_hook(lambda m, a, out: seen.append((m.weight.dtype, out.dtype)))
    zmodel, opt = zero.shard(model, factory("sgd"), stage=stage, group=ctx.group,
                             mixed_precision=getattr(torch, dtype), bucket_mb=0.0005)
    x, y = local_batch(ctx, batch)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(zmodel(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    masters = {str(p.dtype) for p in opt.shard_params}
    dtypes = sorted({str(d) for pair in seen for d in pair})
    return zmodel.full_state_dict(), losses, dtypes, masters


def accumulate(ctx, stage, microsteps, batch):
    """Gradient shards after `microsteps` backward passes, all but the last under no_sync()."""
    zmodel, _ = zero.shard(Net(), factory("sgd"), stage=stage, group=ctx.group, bucket_mb=0.0005)
    backward_in_microsteps(zmodel, *local_batch(ctx, batch), microsteps)
    return [u.grad_shard.clone() for u in zmodel.units]
