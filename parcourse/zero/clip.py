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
def clip_counted_(
    grads: list[tuple[torch.Tensor, bool]], group: dist.ProcessGroup, max_norm: float
) -> torch.Tensor:
    """The norm over `group` of gradients that several ranks may hold copies of: each
    (gradient, counted) pair is scaled, and counted in the norm only where `counted` (so
    that every element is counted once over the group: a weight left whole on every
    tensor-parallel rank on one of them, a tied weight on one of its stages). The squares
    are summed in float64, then over `group`; every gradient is scaled by
    min(1, max_norm / norm), torch's `clip_grad_norm_` coefficient. The 3D step's
    clipping, whose group is every axis that splits the gradients (Megatron-LM's
    model-parallel group, and dp when ZeRO shards them). Returns the norm before."""
    device = grads[0][0].device if grads else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for g, counted in grads:
        if counted:
            total += g.double().square().sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = float(max_norm) / (float(norm) + 1e-6)
    if scale < 1:
        for g, _ in grads:
            g.mul_(scale)
    return norm.reshape(())


@torch.no_grad()
def clip_grad_norm_(
    units: list[FlatUnit],
    kept_params: list[nn.Parameter],
    group: dist.ProcessGroup,
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale the shards' and the kept parameters' gradients so that their norm over
    every rank is at most `max_norm`; returns that norm (before clipping)."""
    shard_grads = [sp.grad for u in units for sp in u.shard_params if sp.grad is not None]
    kept = [p.grad for p in kept_params if p.grad is not None]
    p = float(norm_type)
    if p <= 0 or p != p:
        raise ValueError(
            f"norm_type must be positive (inf for the largest |gradient|), got {norm_type}"
        )
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


def counted_once(
    params: list[nn.Parameter],
    *,
    split: set[int],
    on_first_tp: bool,
    owner: dict[int, int],
    stages: set[int],
    first_copy: bool,
    own: set[int],
) -> list[float]:
    """For each of `params`, whether the norm counts its gradient on this rank
    (`clip_counted_`), so that each element is counted once over the norm's group: a
    weight not cut over tp (not in `split`) only on tp rank 0 (`on_first_tp`), a weight
    several stages share only on its `owner` stage (this rank's are `stages`), and where
    the norm's group holds copies of the same gradients (without ZeRO, the dense weights
    on every ep rank) only on the first copy (`first_copy`), but for the weights this
    rank alone holds (`own`: its experts)."""
    return [
        float(
            (id(p) in split or on_first_tp)
            and owner.get(id(p), min(stages)) in stages
            and (first_copy or id(p) in own)
        )
        for p in params
    ]
