"""A split model's parameters made whole again: each rank's shards gathered over the
tensor-parallel group and cut back to the unsplit size (vocabulary shards are padded).
What a user exports, to load into the single-process model."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from parcourse.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def split_dims(model: nn.Module) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (the dim its shards were cut along, its unsplit size there)."""
    dims: dict[int, tuple[int, int]] = {}
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            for p in (m.weight, m.bias):
                if p is not None:
                    dims[id(p)] = (0, m.out_features)
        elif isinstance(m, RowParallelLinear):
            dims[id(m.weight)] = (1, m.in_features)
        elif isinstance(m, VocabParallelEmbedding):
            dims[id(m.weight)] = (0, m.num_embeddings)
    return dims


@torch.no_grad()
def whole_parameters(
    model: nn.Module, group: dist.ProcessGroup, only: Iterable[nn.Parameter] | None = None
) -> dict[str, torch.Tensor]:
    """{name: the whole parameter} for the model's parameters (or those in `only`), named
    as in the unsplit model (a tied parameter under each of its names). Every rank of
    `group` must call it on the same model, split the same way: it all-gathers each split
    parameter over the group, in the order of `model.named_parameters()`."""
    keep = None if only is None else {id(p) for p in only}
    dims = split_dims(model)
    world_size = dist.get_world_size(group)
    whole: dict[int, torch.Tensor] = {}
    for _, p in model.named_parameters():
        if keep is not None and id(p) not in keep:
            continue
        shard = p.detach().contiguous()
        if id(p) not in dims:  # replicated: the same on every rank
            whole[id(p)] = shard.clone()
            continue
        dim, size = dims[id(p)]
        parts = [shard]
        if world_size > 1:
            parts = [torch.empty_like(shard) for _ in range(world_size)]
            dist.all_gather(parts, shard, group=group)
        whole[id(p)] = torch.cat(parts, dim).narrow(dim, 0, size).clone()
    return {
        name: whole[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in whole
    }
