"""What the 3D step reports: the bytes a rank holds (`memory`, comparable with
`theory.mesh_bytes` and the planner) and the whole state on every rank (`full_state_dict`:
the unsplit GPT's state dict, the same keys, fp32 values, to compare with one process or
to load into one). Its sharded twin, the checkpoint every rank writes its own piece of, is
`parcourse.checkpoint`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parcourse.memory import storage_bytes, tensors_in
from parcourse.tensor_parallel.state_dict import whole_parameters

if TYPE_CHECKING:
    from parcourse.hybrid import Hybrid


def full_state_dict(model: Hybrid) -> dict[str, torch.Tensor]:
    """Each stage's parameters gathered over tp (and a part's cut, such as the experts',
    over its axis), then every stage's over pp (replicas are equal); the buffers where
    this rank's stages hold them."""
    with model.whole_weights():
        mine = whole_parameters(model.model, model.tp_comm.group, only=model.params)
        mine.update(_whole_cut(model))
    # this rank's stages' buffers (a balancing bias moves only where its layer runs)
    stage_buffers = {id(b) for m in model.runtime.stages.values() for b in m.buffers()}
    kept = model.model.state_dict().keys()
    mine.update(
        {
            name: b.detach().cpu().clone()
            for name, b in model.model.named_buffers()
            if id(b) in stage_buffers and name in kept
        }
    )
    stages: list[Any] = [None] * model.mesh.size("pp")
    dist.all_gather_object(
        stages, {k: v.cpu() for k, v in mine.items()}, group=model.mesh.group("pp")
    )
    state: dict[str, torch.Tensor] = {}
    for part in stages:
        state.update(part)
    buffers = {name: b.detach().cpu().clone() for name, b in model.model.named_buffers()}
    return {k: state[k] if k in state else buffers[k] for k in model.model.state_dict()}


def _whole_cut(model: Hybrid) -> dict[str, torch.Tensor]:
    """The weights a part cut over its axis along dim 0 (`Hybrid.cut_over`: the experts
    over ep), every rank's slice gathered, in rank order as they were cut."""
    out = {}
    held = {id(q) for q in model.params}
    for name, p in model.model.named_parameters():
        axis = model.cut_over.get(id(p))
        if axis is None or id(p) not in held:
            continue
        parts = [torch.empty_like(p) for _ in range(model.mesh.size(axis))]
        dist.all_gather(parts, p.detach().contiguous(), group=model.mesh.group(axis))
        out[name] = torch.cat(parts).cpu()
    return out


def memory(model: Hybrid) -> dict[str, int]:
    """Bytes this rank holds, by category: its parameters (under ZeRO-3 with the shards
    it keeps), its gradients' peak in the last step (`grad_bytes`), the optimizer's
    state (under mixed precision with the fp32 masters) and, when traced, the peak of
    the activations kept for backward (0 otherwise). Comparable with
    `theory.mesh_bytes` and the planner."""
    optimizer = storage_bytes(tensors_in(list(model.optimizer.state.values())))
    params = storage_bytes(model.params)  # ZeRO-3's freed weights hold none
    units = model.sharded.units if model.sharded is not None else []
    if model.precision.compute_dtype is not None:  # fp32 masters: the optimizer's (ZeRO's 12 of
        optimizer += storage_bytes(u.master for u in units)  # 2 + 2 + 12 bytes)
        if model.zero == 3:  # the 16-bit slices it gathers from
            params += storage_bytes(u.compute_shard for u in units if u.compute_shard is not None)
    elif model.zero == 3:  # its shards are the weights it keeps
        params += storage_bytes(u.master for u in units)
    return {
        "params": params,
        "grads": model.grad_bytes,
        "optimizer": optimizer,
        "activations": model.runtime.peak_in_flight_bytes,
    }
