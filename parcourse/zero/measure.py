"""Rank functions that measure ZeRO: bytes per rank by category, step times."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.data import local_regression
from parcourse.data_parallel import BucketedDataParallel
from parcourse.data_parallel.training import alternate_steps
from parcourse.launch import RankContext
from parcourse.memory import SavedActivations, zero_bytes, zero_checked_at
from parcourse.models import mlp
from parcourse.zero.sharded import shard as zero_shard


def mlp_for(params: int, depth: int = 4) -> tuple[int, int]:
    """(width, depth) of a square MLP with about `params` parameters."""
    width = max(8, round((params / depth) ** 0.5))
    return width, depth


def memory_by_stage(ctx: RankContext, stage: int, params: int = 1_000_000, depth: int = 4,
                    batch: int = 32, bucket_mb: float = 1.0,
                    mixed_precision: str | None = None) -> dict[str, Any]:
    """Two Adam steps under ZeRO `stage` (0 = plain data parallel); memory samples
    ("after forward", "peak in backward", "after step") go into the trace.
    `mixed_precision`: "bfloat16" or "float16" (stages 1-3).

    Returns the parameter count, the theory for this rank, the sample at which each
    category is checked against it, and the bytes this rank sent in the second step,
    counted message by message (stages 1-3, whose collectives are the ring's).
    """
    dtype = getattr(torch, mixed_precision) if mixed_precision else None
    if dtype is not None and stage == 0:
        raise ValueError("mixed precision is measured here for ZeRO stages 1-3 only")
    width, depth = mlp_for(params, depth)
    model = mlp(width, width, width, depth=depth)
    n_params = sum(p.numel() for p in model.parameters())
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    if stage == 0:
        zmodel: nn.Module = BucketedDataParallel(model, ctx.group, bucket_mb=bucket_mb)
        opt: Any = adam(zmodel.parameters())
    else:
        zmodel, opt = zero_shard(model, adam, stage=stage, group=ctx.group, bucket_mb=bucket_mb,
                                 mixed_precision=dtype, tracer=ctx.tracer)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    tracer = ctx.tracer
    peak: dict[str, Any] = {}

    def sample_in_backward(_: torch.Tensor) -> None:
        s = tracer.memory("in backward", zmodel, opt, acts)
        if not peak or s.total > peak["sample"].total:
            peak["sample"] = s

    for step in range(2):  # the first step creates Adam's state
        if step == 1:
            sent_before = tracer.total("bytes_sent")
        acts = SavedActivations()
        with acts:
            loss = nn.functional.mse_loss(zmodel(x), y)
        if step == 1:
            tracer.memory("after forward", zmodel, opt, acts)
            hooks = [p.register_post_accumulate_grad_hook(sample_in_backward)
                     for p in model.parameters()]
        loss.backward()
        opt.step()
        if step == 1:
            for h in hooks:
                h.remove()
            tracer.memory("after step", zmodel, opt)
            sent = tracer.total("bytes_sent") - sent_before
        opt.zero_grad()
    # Keep only the largest backward sample, relabelled.
    data = tracer.data()
    data.memory = [m for m in data.memory if m.label != "in backward"]
    if peak:
        s = peak["sample"]
        data.memory.insert(1, type(s)(s.rank, "peak in backward", s.t_ns, s.bytes, s.cuda))
    theory = zero_bytes(n_params, ctx.world_size, stage, dtype or torch.float32)
    return {"params": n_params, "theory": theory, "checked_at": zero_checked_at(stage),
            "bytes_sent": sent if stage else None}


def measured_over_formula(run: Any) -> dict[str, tuple[float, float]]:
    """For a `memory_by_stage` run: per category, (mean over ranks, largest rank) of
    measured bytes / formula, each at the sample where the formula holds. Ranks differ
    a little: each parameter's rows split as evenly as they can (the first ranks get
    one row more)."""
    result = run.results[0]
    ratios = {}
    for category, label in result["checked_at"].items():
        measured = [s.bytes[category] for s in run.trace.memory_at(label).values()]
        theory = result["theory"][category]
        ratios[category] = (sum(measured) / len(measured) / theory, max(measured) / theory)
    return ratios


def step_times(ctx: RankContext, configs: dict[str, dict[str, Any]], steps: int = 10, *,
               params: int = 4_000_000, depth: int = 4, batch: int = 64) -> dict[str, list[float]]:
    """Step times of ZeRO stages and torch's ZeroRedundancyOptimizer / FSDP2, alternating.

    configs: name -> {"kind": "zero", "stage": s} | {"kind": "zero_redundancy"} |
    {"kind": "fsdp2"} | {"kind": "ddp"}.
    """
    width, depth = mlp_for(params, depth)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    runs = {}
    for name, cfg in configs.items():
        model = mlp(width, width, width, depth=depth)
        runs[name] = _build(cfg, model, ctx)
    return alternate_steps(ctx, runs, x, y, steps)


def _build(cfg: dict[str, Any], model: nn.Module, ctx: RankContext) -> tuple[Any, Any]:
    kind = cfg["kind"]
    if kind == "zero":
        return zero_shard(model, lambda ps: torch.optim.Adam(ps, lr=1e-3), stage=cfg["stage"],
                          group=ctx.group, bucket_mb=cfg.get("bucket_mb", 25.0),
                          algorithm=cfg.get("algorithm", "auto"))
    if kind == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=ctx.group)
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)
    if kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model, process_group=ctx.group)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam,
                                            process_group=ctx.group, lr=1e-3)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    raise ValueError(f"unknown kind {kind!r}")


def peak_memory(ctx: RankContext, cfg: dict[str, Any], params: int = 4_000_000, depth: int = 4,
                batch: int = 64) -> dict[str, int]:
    """Peak bytes by category in one training step, measured by torch's own MemTracker
    (so that ours and torch's implementations are measured by the same tool)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    width, depth = mlp_for(params, depth)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    model, opt = _build(cfg, mlp(width, width, width, depth=depth), ctx)
    nn.functional.mse_loss(model(x), y).backward()  # a first step creates the optimizer state
    opt.step()
    opt.zero_grad()
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns about parameters without gradients
        tracker.track_external(model, getattr(opt, "optimizer", opt))
        with tracker:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    return {str(k).split(".")[-1].lower(): int(v) for k, v in peak[device].items()}


def communication_bytes(stage: int, nbytes: float, world_size: int) -> float:
    """Theory: bytes each rank sends per step for S = nbytes of parameters (= of gradients).

    A ring all-reduce sends 2(N-1)/N S (lesson 01); reduce-scatter and all-gather
    half of that each. DDP (stage 0): one all-reduce. Stages 1 and 2:
    reduce-scatter the gradients, all-gather the updated parameters: DDP's
    volume, since an all-reduce is exactly those two. Stage 3: all-gather in
    forward, again in backward, reduce-scatter: 1.5x DDP (ZeRO paper, sec. 7).
    """
    half = (world_size - 1) / world_size * nbytes
    return {0: 2 * half, 1: 2 * half, 2: 2 * half, 3: 3 * half}[stage]


def zero3_step(ctx: RankContext, prefetch: bool = True, params: int = 2_000_000,
               depth: int = 6, batch: int = 64, stage: int = 3) -> dict[str, Any]:
    """Two traced training steps under ZeRO (stage 3 by default): forward and optimizer
    spans here; backward and one span per all-gather and reduce-scatter of each layer
    from the model.

    Returns the parameter bytes, the collectives' sizes this rank issued in the
    second step (by kind), and the bytes it sent in that step, counted message by
    message.
    """
    width, depth = mlp_for(params, depth)
    model = mlp(width, width, width, depth=depth)
    zmodel, opt = zero_shard(model, lambda ps: torch.optim.Adam(ps, lr=1e-3), stage=stage,
                             group=ctx.group, prefetch=prefetch, bucket_mb=1.0,
                             tracer=ctx.tracer)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    tracer = ctx.tracer
    for step in range(2):
        dist.barrier(group=ctx.group)  # a common start, for the timeline
        if step == 1:
            first = len(tracer.data().spans)
            sent_before = tracer.total("bytes_sent")
        with tracer.span("forward", step=step):
            loss = nn.functional.mse_loss(zmodel(x), y)
        loss.backward()  # the model traces backward and each layer's collectives
        with tracer.span("optimizer", step=step):
            opt.step()
            opt.zero_grad()
    volume: dict[str, int] = {}
    for s in tracer.data().spans[first:]:
        if s.kind == "comm" and "size" in s.meta:
            volume[s.name] = volume.get(s.name, 0) + s.meta["size"]
    n_params = sum(u.numel for u in zmodel.units)
    return {"param_bytes": n_params * 4, "volume": volume, "params": n_params,
            "bytes_sent": tracer.total("bytes_sent") - sent_before}
