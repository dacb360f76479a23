"""Rank functions for ZeRO beyond stage 3: Offload, Infinity, ZeRO++."""

import os

import torch
import zero_fns as Z
from dp_fns import Net
from torch import nn

from parcourse import zero
from parcourse.zero import zeropp


class Wide(nn.Module):
    """Layers wide enough that ZeRO++'s int8 blocks (256 elements) are full: 64 -> 256 ->
    64 -> 8, rows that 2 and 4 divide, so every rank's part is the same size."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.down(torch.tanh(self.up(x)))))


def wide_data(batch, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 64, generator=g), torch.randn(batch, 8, generator=g)


def wide_batch(ctx, batch):
    from parcourse.data import shard

    x, y = wide_data(batch)
    return shard(x, ctx.rank, ctx.world_size), shard(y, ctx.rank, ctx.world_size)


def train(ctx, stage, steps, batch, opt_name="adam", path=None, **options):
    """Net under ZeRO with these options; the full weights, and the placement counts."""
    if path is not None:
        options = {**options, "offload_optimizer": "nvme", "nvme_path": path}
    zmodel, opt = zero.shard(
        Net(), Z.factory(opt_name), stage=stage, group=ctx.group, bucket_mb=0.0005, **options
    )
    Z.fit(zmodel, opt, *Z.local_batch(ctx, batch), steps)
    return zmodel.full_state_dict()


def placement(ctx, stage, dtype, **options):
    """One Adam step of Wide; bytes by placement right after it (before zero_grad)."""
    zmodel, opt = zero.shard(
        Wide(),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        stage=stage,
        group=ctx.group,
        mixed_precision=getattr(torch, dtype),
        **options,
    )
    x, y = wide_batch(ctx, 16)
    nn.functional.mse_loss(zmodel(x), y).backward()
    opt.step()
    return zero.bytes_by_placement(zmodel, opt)


def infinity_killed(ctx, path, steps_before):
    """Adam with its state on disk: `steps_before` steps, the state then, and a step that
    dies after writing its first unit (the process ends there)."""
    zmodel, opt = zero.shard(
        Net(),
        Z.factory("adam"),
        stage=2,
        group=ctx.group,
        bucket_mb=0.0005,
        offload_optimizer="nvme",
        nvme_path=path,
    )
    x, y = Z.local_batch(ctx, 16)
    Z.fit(zmodel, opt, x, y, steps_before)
    torch.save(zero.infinity.read_state(path, ctx.rank), os.path.join(path, f"before{ctx.rank}"))
    stats = opt.disk_stats()
    torch.save(stats, os.path.join(path, f"stats{ctx.rank}"))

    def die(k):
        os._exit(3)

    opt.on_unit_written = die
    Z.fit(zmodel, opt, x, y, 1)


def infinity_stats(ctx, path, steps):
    zmodel, opt = zero.shard(
        Net(),
        Z.factory("adam"),
        stage=3,
        group=ctx.group,
        bucket_mb=0.0005,
        offload_optimizer="nvme",
        nvme_path=path,
    )
    Z.fit(zmodel, opt, *Z.local_batch(ctx, 16), steps)
    state = opt.state_dict()
    return opt.disk_stats(), opt.disk_bytes(), state


def quantized_sum(ctx, ranks_per_node, width, seed=0):
    """quantized_reduce_scatter of random parts against the exact sum."""
    from parcourse.comm import Comm

    g = torch.Generator().manual_seed(seed + ctx.rank)
    parts = torch.randn(ctx.world_size, width + 2, generator=g) * (1 + ctx.rank)
    parts[:, width:] = 1.0  # flags travel exactly
    every = [
        torch.randn(ctx.world_size, width + 2, generator=torch.Generator().manual_seed(seed + r))
        * (1 + r)
        for r in range(ctx.world_size)
    ]
    nodes = zeropp.Nodes.of(ctx.group, ctx.rank, ctx.world_size, ranks_per_node)
    got = zeropp.quantized_reduce_scatter(Comm(ctx.group, algorithm="ring"), parts, width, nodes)
    exact = sum(e[ctx.rank, :width] for e in every)
    most = max(float(e[:, :width].abs().max()) for e in every)
    return got[:width], got[width:], exact, most


def zeropp_step(ctx, steps, options, ranks_per_node=2, lr=0.05):
    """Wide under ZeRO-3 (fp32) with ZeRO++ options: the losses, the full weights, the
    bytes sent across nodes over the steps (all ranks' messages), and the weights forward
    saw against the masters."""
    from parcourse.trace import Tracer

    tracer = Tracer(ctx.rank)
    model = Wide()
    seen = []
    if options.get("hpz_partition_size") or options.get("quantized_gradients"):
        options = {**options, "ranks_per_node": ranks_per_node}
    zmodel, opt = zero.shard(
        model,
        lambda ps: torch.optim.SGD(ps, lr=lr),
        stage=3,
        group=ctx.group,
        tracer=tracer,
        **options,
    )
    # After ZeRO's own hook, which gathers the weights this one reads.
    model.up.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    masters = zmodel.full_state_dict()["up.weight"]
    losses = Z.fit(zmodel, opt, *wide_batch(ctx, 32), steps)
    across = zeropp.bytes_across_nodes(tracer.data().counters, ranks_per_node)
    sizes = [(u.part_numel, len(u.params)) for u in zmodel.units]
    return losses, zmodel.full_state_dict(), across, sizes, seen[0], masters


def fused(ctx, stage, steps, batch, **options):
    """Net under ZeRO stepped by torch's fused Adam, which writes the parameters in one
    kernel without bumping their version counters."""
    zmodel, opt = zero.shard(
        Net(),
        lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
        stage=stage,
        group=ctx.group,
        bucket_mb=0.0005,
        **options,
    )
    Z.fit(zmodel, opt, *Z.local_batch(ctx, batch), steps)
    return zmodel.full_state_dict()


def infinity_resume(ctx, path, before, after):
    """Train with the state on disk, save (whole weights, this rank's optimizer state),
    go on; then a fresh model and InfinityOptimizer load the save and go on alike."""
    x, y = Z.local_batch(ctx, 16)
    options = {"offload_optimizer": "nvme", "bucket_mb": 0.0005}
    zmodel, opt = zero.shard(
        Net(), Z.factory("adam"), 3, ctx.group, nvme_path=os.path.join(path, "a"), **options
    )
    Z.fit(zmodel, opt, x, y, before)
    saved = {"model": zmodel.full_state_dict(), "opt": opt.state_dict()}
    Z.fit(zmodel, opt, x, y, after)
    fresh, opt2 = zero.shard(
        Net(), Z.factory("adam"), 3, ctx.group, nvme_path=os.path.join(path, "b"), **options
    )
    fresh.load_full_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    Z.fit(fresh, opt2, x, y, after)
    return zmodel.full_state_dict(), fresh.full_state_dict()


class Checkpointed(nn.Module):
    """dp_fns.Net's layers, its hidden layer under activation checkpointing (recomputed,
    with ZeRO's forward hooks, during backward) when asked."""

    def __init__(self, checkpointed):
        super().__init__()
        self.net = Net()
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.net.inp(x))
        hidden = self.net.hidden
        h = torch.tanh(
            checkpoint(hidden, h, use_reentrant=False) if self.checkpointed else hidden(h)
        )
        return self.net.out(h)


def hazards(ctx, case, stage=3, steps=4, **options):
    """What a loop may do around ZeRO's gathers: `recompute` (checkpointing: forward
    hooks run again during backward), `peek` (a forward of one layer under no_grad between
    backward and step), `zero_false` (zero_grad(set_to_none=False)), or `plain`. The
    losses and the weights."""
    model = Checkpointed(case == "recompute")
    zmodel, opt = zero.shard(
        model,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        stage=stage,
        group=ctx.group,
        bucket_mb=0.0005,
        **options,
    )
    x, y = Z.local_batch(ctx, 16)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(zmodel(x), y)
        loss.backward()
        if case == "peek":
            with torch.no_grad():
                model.net.inp(x)
        opt.step()
        opt.zero_grad(set_to_none=case != "zero_false")
        losses.append(float(loss.detach()))
    return losses, zmodel.full_state_dict()


def infinity_after_a_failed_step(ctx, path):
    """A step that raises (a hook of the torch optimizer inside, once), then steps that
    go on: the same weights as steps that never failed, less the failed one."""
    zmodel, opt = zero.shard(
        Net(),
        Z.factory("adam"),
        2,
        ctx.group,
        bucket_mb=0.0005,
        offload_optimizer="nvme",
        nvme_path=path,
    )
    x, y = Z.local_batch(ctx, 16)
    failed = []

    def once(optimizer, args, kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError("a transient failure")

    handle = opt.optimizer.register_step_pre_hook(once)
    nn.functional.mse_loss(zmodel(x), y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        message = str(e)
    handle.remove()
    opt.zero_grad()
    Z.fit(zmodel, opt, x, y, 3)
    return message, zmodel.full_state_dict()


def node_groups_twice(ctx):
    """Two models with hpZ over the same ranks: do they share one node group?"""
    made = [
        zero.ZeroModel(Wide(), 3, ctx.group, hpz_partition_size=2, ranks_per_node=2)
        for _ in range(2)
    ]
    return made[0].node_comm.group is made[1].node_comm.group


def fp8_gather(ctx, steps, fp8_all_gather, compute_dtype=None, lr=0.05):
    """Wide under ZeRO-3 with or without the FP8 all-gather: the bytes this rank sends
    for one gather of each unit (by the course's ring, counted message by message), each
    unit's part and parameter count, the weights forward saw against the masters, and the
    losses of `steps` SGD steps."""
    from parcourse.trace import Tracer

    tracer = Tracer(ctx.rank)
    model = Wide()
    seen = []
    zmodel, opt = zero.shard(
        model,
        lambda ps: torch.optim.SGD(ps, lr=lr),
        stage=3,
        group=ctx.group,
        tracer=tracer,
        algorithm="ring",
        mixed_precision=compute_dtype,
        fp8_all_gather=fp8_all_gather,
    )
    gathers = []
    for unit in zmodel.units:
        before = tracer.total("bytes_sent")
        zmodel._wait_gather(unit)
        gathers.append(tracer.total("bytes_sent") - before)
        unit.free()
    model.up.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    masters = zmodel.full_state_dict()["up.weight"]
    losses = Z.fit(zmodel, opt, *wide_batch(ctx, 32), steps)
    sizes = [(u.part_numel, len(u.params)) for u in zmodel.units]
    return gathers, sizes, seen[0].float(), masters, losses


def fp8_gather_with_int8(ctx):
    zero.ZeroModel(Wide(), 3, ctx.group, quantized_weights=True, fp8_all_gather=True)
