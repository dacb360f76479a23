"""Gradient clipping by the norm over the whole model, when each rank holds a shard.

`torch.nn.utils.clip_grad_norm_` over a rank's shard parameters would see only this
rank's rows: the squared norms of the shards are summed over ranks first (Megatron's
finalize_model_grads sums the squared norm over every group whose gradients are
sharded), and the parameters left whole on every rank are counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parcourse.zero.layout import FlatUnit


@torch.no_grad()
def clip_grad_norm_(units: list[FlatUnit], kept_params: list[nn.Parameter],
                    group: dist.ProcessGroup, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale the shards' and the kept parameters' gradients so that their norm over
    every rank is at most `max_norm`; returns that norm (before clipping)."""
    shard_grads = [sp.grad for u in units for sp in u.shard_params if sp.grad is not None]
    kept = [p.grad for p in kept_params if p.grad is not None]
    p = float(norm_type)
    if p <= 0 or p != p:
        raise ValueError(f"norm_type must be positive (inf for the largest |gradient|), "
                         f"got {norm_type}")
    if p == float("inf"):  # the largest |gradient| anywhere, as torch's inf norm
        total = torch.zeros((), dtype=torch.float64)
        for g in [*shard_grads, *kept]:
            if g.numel():
                total = torch.maximum(total, g.double().abs().max().cpu())
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        norm = total
    else:
        total = torch.zeros((), dtype=torch.float64)
        for g in shard_grads:
            total += g.double().abs().pow(p).sum().cpu()
        dist.all_reduce(total, group=group)
        for g in kept:  # replicated: count once, not once per rank
            total += g.double().abs().pow(p).sum().cpu()
        norm = total.pow(1 / p)
    scale = float(max_norm) / (float(norm) + 1e-6)
    if scale < 1:
        for g in [*shard_grads, *kept]:
            g.mul_(scale)
    return norm.float()
